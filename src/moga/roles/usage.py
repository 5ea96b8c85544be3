"""What a module's own parameter is (vector, embedding, linear, conv, or an odd kind a module declares), read
from the modules that own it; and the model facts the role rules need: each tensor's owners, whether a module
sits in a repeated block, and the modules' call order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moga.layout import EMBEDDING, LINEAR


def param_usage(module: nn.Module, pname: str, p: torch.Tensor) -> tuple[str, str | None] | None:
    """(kind, layout) of parameter ``pname`` directly owned by ``module``; None when unknown.

    Kinds: vector, embedding, linear, conv, and the odd ones in ``ODD_KINDS`` (placed with a reason)."""
    if p.ndim == 0:
        return "scalar", None
    if p.ndim <= 1:
        return "vector", None
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and pname == "weight":
        return "embedding", EMBEDDING
    if isinstance(module, nn.Linear) and pname == "weight":
        return "linear", LINEAR
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and pname == "weight":
        return "conv", "io" + "i" * (p.ndim - 2)  # (in, out/groups, *kernel)
    if isinstance(module, nn.modules.conv._ConvNd) and pname == "weight":
        return "conv", "o" + "i" * (p.ndim - 1)  # (out, in/groups, *kernel)
    if isinstance(module, nn.MultiheadAttention) and pname.endswith("proj_weight") and p.ndim == 2:
        return "linear", LINEAR  # in_proj_weight stacks q, k, v as rows of one (3E, E) matrix
    if type(module).__name__ == "Conv1D" and pname == "weight" and p.ndim == 2:
        return "linear", EMBEDDING  # Hugging Face's Conv1D stores (in, out) and computes x @ W
    if sum(s > 1 for s in p.shape) <= 1:
        return "vector", None  # a vector with singleton axes, e.g. a class token (1, 1, d)
    if type(module).__name__.endswith("Embeddings") and pname == "position_embeddings" and p.ndim == 3:
        return "embedding", "bio"  # Hugging Face vision models: a (1, positions, d) table added to the patches
    return moe_or_ssm_usage(module, pname, p)


# Kinds that no torch layer declares: role, and the reason the plan prints for them.
ODD_KINDS: dict[str, tuple[str, str]] = {
    "router": ("hidden", "a MoE router, (num_experts x hidden) read as F.linear(x, weight): a hidden matrix"),
    "experts": ("hidden", "a fused expert stack (num_experts x out x in, or x in x out where the module says "
                          "is_transposed): one hidden matrix per expert, the expert axis a batch axis"),
    "expert_bias": ("vector", "per-expert biases (num_experts x d): vectors"),
    "elementwise": ("vector", "a state-space parameter used elementwise (Mamba's A = -exp(A_log)): a vector"),
    "scalar": ("vector", "a scalar (a temperature such as CLIP's logit_scale): a vector, Adam's step on one "
                         "number"),
}


def moe_or_ssm_usage(module: nn.Module, pname: str, p: torch.Tensor) -> tuple[str, str | None] | None:
    """Mixture-of-experts and state-space parameters, recognized by what their module declares, so that an
    unknown module with the same shapes is still an error rather than a guess."""
    experts = getattr(module, "num_experts", None)
    if isinstance(experts, int) and p.shape[0] == experts:
        if p.ndim == 3 and isinstance(getattr(module, "is_transposed", None), bool):
            # transformers' use_experts_implementation: (E, out, in), or (E, in, out) when transposed
            return "experts", "bio" if module.is_transposed else "boi"
        hidden = getattr(module, "hidden_dim", None)
        if p.ndim == 2 and pname == "weight" and p.shape[1] == hidden and hidden != experts:
            return "router", LINEAR
        if p.ndim == 2 and pname.endswith("bias"):  # a bias has no orientation to get wrong
            return "expert_bias", None
    if pname == "A_log" and p.ndim == 2:
        return "elementwise", None
    return None


@dataclass(eq=False)
class OwnedParam:
    param: nn.Parameter
    names: list[str] = field(default_factory=list)
    owners: list[tuple[str, nn.Module, str]] = field(default_factory=list)  # (module name, module, pname)


def owned_params(model: nn.Module) -> list[OwnedParam]:
    by_id: dict[int, OwnedParam] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            if p is None:
                continue
            entry = by_id.setdefault(id(p), OwnedParam(p))
            full = f"{mname}.{pname}" if mname else pname
            if full not in entry.names:
                entry.names.append(full)
            entry.owners.append((mname, module, pname))
    return list(by_id.values())


def in_repeated_block(model: nn.Module, module_name: str) -> bool:
    """True inside a ModuleList, or inside one of several sibling blocks of the same class."""
    parts = module_name.split(".") if module_name else []
    modules = dict(model.named_modules(remove_duplicate=False))
    for depth in range(len(parts) - 1):  # ancestors strictly above the owning module
        parent = modules[".".join(parts[:depth])] if depth else model
        child = modules[".".join(parts[: depth + 1])]
        if isinstance(child, nn.ModuleList):
            return True
        if isinstance(child, (nn.Sequential, nn.ModuleDict)):
            continue  # a plain container (nanoGPT's `transformer` dict) says nothing; its children are looked at next
        if sum(type(c) is type(child) for c in parent.children()) > 1:
            return True
    return False


def call_order(model: nn.Module, example_inputs) -> dict[int, int]:
    order: dict[int, int] = {}

    def record(module, args):  # returns None, so the inputs pass unchanged
        order.setdefault(id(module), len(order))

    hooks = [
        m.register_forward_pre_hook(record)
        for m in model.modules() if any(True for _ in m.parameters(recurse=False))
    ]
    try:
        with torch.no_grad():
            inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return order


def param_usages(item: OwnedParam) -> set[tuple[str, str | None]]:
    """The (kind, layout) pairs the tensor's owning modules give it."""
    return {u for (_, mod, pname) in item.owners if (u := param_usage(mod, pname, item.param)) is not None}
