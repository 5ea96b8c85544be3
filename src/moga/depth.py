"""Inverse-depth residual scaling: ``y_k = y_{k-1} + alpha * f_k(y_{k-1})`` with ``alpha = beta / K``.

With this scaling the loss's Lipschitz and smoothness constants in the block norm do not depend on the
depth ``K``, so a learning rate tuned at a reference depth ``K_base`` needs no depth correction
(docs/math.md §4; [depth], Definition 1 and Theorems 1-2). ``beta`` defaults to ``K_base``
(``alpha = K_base / K``, ``K_base = 2`` in the paper's figure 1), so at ``K = K_base`` the network is the
unscaled one. ``mode="none"`` gives ``alpha = 1``, the unscaled baseline.

What ``K`` counts (``K_base`` is counted in the same unit):

- residual MLP: its two-linear-layer branches, one per block;
- ResNet: residual blocks (BasicBlock or Bottleneck): 8, 16, 32 for stages [2,2,2,2], [3,4,6,3],
  [8,8,8,8]. Projection shortcuts are not branches and are never scaled;
- GPT (this project's ``Block``, Hugging Face's ``GPT2Block``): transformer blocks, ``n_layer``. Both
  sub-blocks of a block (attention and MLP) are branches and get the same ``alpha = beta / n_layer``.
  Counting sub-blocks (``K = 2 n_layer``) would only halve ``alpha`` at every depth, a constant that
  ``beta = Theta(1)`` absorbs; counting blocks matches the depths the paper's GPT-2 sweep reports
  (2..128) and makes ``K_base`` "the ``n_layer`` the learning rate was tuned at".
- feedforward and shared-weights nets have no residual branches, so nothing is scaled.

How it is applied, to any model and without editing its code: each branch module gets a child
:class:`ResidualScale` (``<branch>.residual_scale``) and a forward hook that multiplies the branch's
output by that child's ``alpha``. So the scaling

- is part of the module tree: it shows in ``print(model)``, is copied by ``copy.deepcopy`` and pickled
  by ``torch.save(model)``, and nothing is stored on tensors (which loses it, microsoft/mup#59);
- is in ``state_dict`` as ``<branch>.residual_scale._extra_state = {"alpha": ...}``: loading a checkpoint
  restores the alpha it was saved with. Scale the receiving model first (any alpha); a strict load of
  a scaled checkpoint into an unscaled model fails on these keys, rather than silently changing the
  function. Parameter names are unchanged, so unscaled checkpoints load with ``strict=False``;
- can be removed: ``handle.remove()`` or :func:`remove_residual_scaling` (which also works on copies).

Branches are found from known block types: any module with a ``residual_branches()`` method (this
project's blocks), torchvision's ``BasicBlock``/``Bottleneck`` (the branch ends at ``bn2``/``bn3``,
just before ``out += identity``) and Hugging Face's ``GPT2Block`` (``attn``, ``mlp``, and
``crossattention`` when present), ``LlamaDecoderLayer``, ``MistralDecoderLayer`` and
``Qwen2DecoderLayer`` (``self_attn``, ``mlp``), ``BertLayer`` (the ``dense`` layers before each
post-norm addition), ``ViTLayer`` and ``T5Block`` (self-attention, cross-attention, feed-forward); see
``FOREIGN_BLOCKS``. K counts blocks: for T5, encoder and decoder blocks together. Otherwise name them
with ``branches=``: the modules whose output is added to the residual stream. A branch must run once per
forward; a tuple output (Hugging Face attention returns ``(output, weights)``) has its first element
scaled; an ``nn.Sequential`` branch is scaled at its last module.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

MODES = ("inverse_depth", "none")
SCALE_NAME = "residual_scale"

# (module, class) -> submodules of the block (dotted paths, those present) that are its branches, for
# blocks we cannot edit. Each ends where the block adds it to the residual stream.
_HF = "transformers.models."
_DECODER_LAYER = ("self_attn", "mlp")  # LLaMA-style pre-norm layers
FOREIGN_BLOCKS: dict[tuple[str, str], tuple[str, ...]] = {
    ("torchvision.models.resnet", "BasicBlock"): ("bn2",),
    ("torchvision.models.resnet", "Bottleneck"): ("bn3",),
    (_HF + "gpt2.modeling_gpt2", "GPT2Block"): ("attn", "crossattention", "mlp"),
    (_HF + "llama.modeling_llama", "LlamaDecoderLayer"): _DECODER_LAYER,
    (_HF + "mistral.modeling_mistral", "MistralDecoderLayer"): _DECODER_LAYER,
    (_HF + "qwen2.modeling_qwen2", "Qwen2DecoderLayer"): _DECODER_LAYER,
    # Post-LN: LayerNorm(x + dropout(dense(h))); the dense output is the branch (dropout is linear).
    (_HF + "bert.modeling_bert", "BertLayer"): ("attention.output.dense", "crossattention.output.dense", "output.dense"),
    # transformers 5 names the sub-blocks attention and mlp; 4.x ends the MLP at output.dense.
    (_HF + "vit.modeling_vit", "ViTLayer"): ("attention", "mlp", "output.dense"),
    # Encoder blocks: self-attention, feed-forward; decoder blocks add cross-attention between them.
    (_HF + "t5.modeling_t5", "T5Block"): ("layer.0.SelfAttention", "layer.1.EncDecAttention",
                                          "layer.1.DenseReluDense", "layer.2.DenseReluDense"),
}


def residual_alpha(depth: int, mode: str = "inverse_depth", k_base: float = 2, beta: float | None = None) -> float:
    """``beta / depth`` (``beta`` defaults to ``k_base``) for ``mode="inverse_depth"``; 1.0 for ``"none"``."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth (K, the number of residual blocks) must be an integer >= 1, got {depth!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} ('none' is the unscaled alpha = 1), got {mode!r}")
    _check_positive("k_base", k_base)
    if beta is not None:
        _check_positive("beta", beta)
    if mode == "none":
        return 1.0
    return float(k_base if beta is None else beta) / depth


class ResidualScale(nn.Module):
    """Multiplies a residual branch's output by ``alpha``; ``alpha`` travels in ``state_dict``."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = _check_positive("alpha", alpha)

    def forward(self, output):
        if isinstance(output, tuple):  # Hugging Face attention: (output, weights, ...)
            return (output[0] * self.alpha, *output[1:])
        return output * self.alpha

    # A float, not a buffer: it keeps its value under .half() and is not a tensor to optimize.
    def get_extra_state(self) -> dict:
        return {"alpha": self.alpha}

    def set_extra_state(self, state: dict) -> None:
        self.alpha = _check_positive("alpha", state["alpha"])

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:g}"


def _apply_scale(module: nn.Module, args, output):
    # A plain function looked up by name at call time, so deepcopy and pickling keep it pointing at the
    # copy's own ResidualScale.
    return getattr(module, SCALE_NAME)(output)


@dataclass
class ResidualScaling:
    """What :func:`scale_residual_branches` did; ``remove()`` undoes it."""

    model: nn.Module = field(repr=False)
    branches: tuple[str, ...]
    alpha: float
    depth: int | None

    def remove(self) -> None:
        for name in self.branches:
            _detach(self.model.get_submodule(name))


def scale_residual_branches(
    model: nn.Module,
    alpha: float | None = None,
    *,
    branches: Iterable[str | nn.Module] | None = None,
    depth: int | None = None,
    mode: str = "inverse_depth",
    k_base: float = 2,
    beta: float | None = None,
) -> ResidualScaling:
    """Scale every residual branch of ``model`` by ``alpha``, in place.

    ``alpha`` defaults to ``residual_alpha(depth, mode, k_base, beta)``, where ``depth`` defaults to the
    number of residual blocks found. ``branches`` names the branch modules (glob patterns over module
    names, or the modules themselves) for models whose blocks are not known; then ``depth`` or ``alpha``
    must be given, since only you know what K counts. A branch already scaled gets the new alpha
    (alpha is set, never multiplied).
    """
    if branches is None:
        blocks = residual_blocks(model)
        if not blocks:
            raise ValueError(
                f"found no residual branches in {type(model).__name__}. Name the modules whose output is added "
                "to the residual stream, e.g. scale_residual_branches(model, depth=K, "
                "branches=['blocks.*.attn', 'blocks.*.mlp']), or give the block class a residual_branches() "
                "method that returns them")
        targets = [name for names in blocks.values() for name in names]
        depth = len(blocks) if depth is None else depth
    else:
        targets = _resolve(model, branches)
        if alpha is None and depth is None:
            raise ValueError("with explicit branches, give depth=K (for a transformer, K counts blocks, not "
                             "attention and MLP sub-blocks; see moga.depth) or alpha")
    alpha = residual_alpha(depth, mode, k_base, beta) if alpha is None else _check_positive("alpha", alpha)

    scaled = []
    for name in targets:
        name, module = _output_module(model, name)
        existing = getattr(module, SCALE_NAME, None)
        if isinstance(existing, ResidualScale):
            existing.alpha = alpha
        elif existing is not None:
            raise ValueError(f"{name or type(model).__name__} already has an attribute {SCALE_NAME!r}")
        else:
            module.add_module(SCALE_NAME, ResidualScale(alpha))
            module.register_forward_hook(_apply_scale)
        scaled.append(name)
    return ResidualScaling(model, tuple(scaled), alpha, depth)


def remove_residual_scaling(model: nn.Module) -> list[str]:
    """Remove every residual scale from ``model`` (and from copies of it); returns the branch names."""
    names = [name for name, m in model.named_modules() if isinstance(getattr(m, SCALE_NAME, None), ResidualScale)]
    for name in names:
        _detach(model.get_submodule(name))
    return names


def residual_scales(model: nn.Module) -> dict[str, float]:
    """Branch name -> alpha, for every scaled branch of ``model``."""
    return {
        name: getattr(m, SCALE_NAME).alpha
        for name, m in model.named_modules() if isinstance(getattr(m, SCALE_NAME, None), ResidualScale)
    }


def residual_blocks(model: nn.Module) -> dict[str, list[str]]:
    """Block name -> names of its branch modules, for every known block type in ``model``."""
    modules = {id(m): name for name, m in model.named_modules()}
    blocks: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if any(name.startswith(b + ".") or b == "" for b in blocks):
            continue  # a block inside a block is part of the outer block's branch
        branches = _known_branches(module)
        if branches:
            missing = [b for b in branches if id(b) not in modules]
            if missing:
                raise ValueError(f"{name}.residual_branches() returned a module that is not part of the model")
            blocks[name] = [modules[id(b)] for b in branches]
    return blocks


# --- helpers -------------------------------------------------------------------------------------------


def _known_branches(module: nn.Module) -> list[nn.Module] | None:
    if callable(getattr(module, "residual_branches", None)):
        return list(module.residual_branches())
    for cls in type(module).__mro__:
        paths = FOREIGN_BLOCKS.get((cls.__module__, cls.__name__))
        if paths is not None:
            return [m for m in (_submodule(module, p) for p in paths) if m is not None]
    return None


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module``'s submodule at a dotted path, or None where the path is absent or not a module."""
    for part in path.split("."):
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
    return module if isinstance(module, nn.Module) else None


def _resolve(model: nn.Module, branches: Iterable[str | nn.Module]) -> list[str]:
    named = list(model.named_modules())
    by_id = {id(m): name for name, m in named}
    found: list[str] = []
    for branch in branches:
        if isinstance(branch, nn.Module):
            if id(branch) not in by_id:
                raise ValueError(f"branch {type(branch).__name__} is not a module of the model")
            matches = [by_id[id(branch)]]
        else:
            matches = [name for name, _ in named if fnmatch.fnmatchcase(name, branch)]
            if not matches:
                raise ValueError(f"branch pattern {branch!r} matches no module; module names look like "
                                 f"{[n for n, _ in named[1:9]]}")
        found += [m for m in matches if m not in found]
    return found


def _output_module(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The module whose output is the branch's output: a Sequential's is its last module's."""
    module = model.get_submodule(name)
    while isinstance(module, nn.Sequential) and len(module):
        name = f"{name}.{len(module) - 1}" if name else str(len(module) - 1)
        module = module[-1]
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(f"branch {name!r} is a {type(module).__name__}, which has no forward; name its modules")
    return name, module


def _detach(module: nn.Module) -> None:
    # What RemovableHandle.remove() does, found by the hook function so that copies can be cleaned too.
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook is _apply_scale:
            del module._forward_hooks[hook_id]
            module._forward_hooks_with_kwargs.pop(hook_id, None)
            module._forward_hooks_always_called.pop(hook_id, None)
    if isinstance(getattr(module, SCALE_NAME, None), ResidualScale):
        delattr(module, SCALE_NAME)


def _check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
