"""Finding blocks and their branches in a probe forward (``moga.depth.trace``), or resolving the ones named."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from moga.depth.scale import ResidualScale
from moga.depth.trace import Trace, outer_residual_add, residual_adds

class probe_mode:
    """Eval mode, no gradients, every existing scale at 1; all restored on exit."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        self.training = {m: m.training for m in self.model.modules()}
        self.scales = {m: m.alpha for m in self.model.modules() if isinstance(m, ResidualScale)}
        self.grad = torch.is_grad_enabled()
        self.model.eval()
        for m in self.scales:
            m.alpha = 1.0
        torch.set_grad_enabled(False)

    def __exit__(self, *exc):
        torch.set_grad_enabled(self.grad)
        for m, mode in self.training.items():
            m.training = mode
        for m, a in self.scales.items():
            m.alpha = a


def declared_blocks(model: nn.Module) -> dict[str, list[str]]:
    modules = {id(m): name for name, m in model.named_modules()}
    blocks: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if inside(name, blocks) or not callable(getattr(module, "residual_branches", None)):
            continue
        branches = list(module.residual_branches())
        if any(id(b) not in modules for b in branches):
            raise ValueError(f"{name}.residual_branches() returned a module that is not part of the model")
        blocks[name] = [modules[id(b)] for b in branches]
    return blocks


def _candidates(model: nn.Module) -> list[str]:
    """Elements of ModuleList/Sequential containers and modules that declare their branches."""
    found = []
    for name, module in model.named_modules():
        if callable(getattr(module, "residual_branches", None)):
            found.append(name)
        elif isinstance(module, (nn.ModuleList, nn.Sequential)):
            found += [f"{name}.{k}" if name else k for k in module._modules]
    return found


def find(model: nn.Module, args: tuple, kwargs: dict, use_declared: bool = True):
    """Blocks -> their branches (declared or found), each block's recorded call, and the problems met."""
    candidates = _candidates(model)
    trace = Trace(model, set(candidates))
    run_forward(model, trace, args, kwargs, "the unscaled probe forward")
    declared = declared_blocks(model) if use_declared else {}
    found: dict[str, list[str]] = {}
    problems: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        if name not in candidates or inside(name, found):
            continue
        costs = trace.costs(name)
        if name in declared:
            found[name] = declared[name]
        elif costs is not None and residual_adds(costs.call, costs):
            found[name], problems[name] = trace.branches(name)
        elif len(trace.calls.get(name, [])) > 1:
            problems[name] = [f"it ran {len(trace.calls[name])} times in one forward (shared weights?), and a block "
                              "must run once for its scale to be checked"]
    # Blocks whose residual add is in the caller's forward (for f in self.blocks: h = h + f(h)): the element
    # is its own branch. Only where no block was found inside or around it.
    for name in candidates:
        if (name in found or inside(name, found) or any(inside(b, {name: 0}) for b in found)
                or not trace.ran_once(name) or name not in trace.param_modules):
            continue
        if outer_residual_add(trace.recorder, trace.calls[name][0]) is not None:
            found[name] = [name]
            problems.pop(name, None)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    found = {b: sorted(found[b], key=order.__getitem__) for b in sorted(found, key=order.__getitem__)}
    calls = {c: (trace.calls[c][0].args, trace.calls[c][0].kwargs, trace.calls[c][0].output.tensor)
             for c in candidates if trace.ran_once(c)}  # tensors only: the recorded graph can go
    return found, calls, problems


def none_found(model: nn.Module, problems: dict[str, list[str]]) -> str:
    why = "".join(f" In {b}, {'; '.join(p)}." for b, p in list(problems.items())[:3] if p)
    sample = [n for n, _ in model.named_modules()][1:9]
    return (f"found no residual branches in {type(model).__name__}: no element of a ModuleList or Sequential "
            f"adds the output of one of its submodules to its own input in the probe forward, and no forward adds "
            f"an element's output to that element's input.{why} Name the "
            "modules whose output is added to the residual stream, e.g. scale_residual_branches(model, depth=K, "
            f"branches=[...]) with module names such as {sample}, or give the block class a residual_branches() "
            "method that returns them")


def blocks_of(model: nn.Module, targets: list[str], found: dict[str, list[str]]) -> dict[str, list[str]]:
    """The blocks named branches belong to: the blocks found, each needing at least one named branch."""
    blocks: dict[str, list[str]] = {}
    for target in targets:
        owner = next((b for b in found if target == b or inside(target, {b: 0})), None)
        if owner is None:  # no block found around it: verify on its enclosing container element or parent
            owner = _enclosing(model, target)
        blocks.setdefault(owner, []).append(target)
    missed = [b for b in found if found[b] and b not in blocks]
    if missed:
        raise ValueError(
            f"branches= names no module in block(s) {missed[:4]}{' ...' if len(missed) > 4 else ''}, which add "
            f"branches to the residual stream too; depth scaling scales every block, so name a branch in each: "
            f"{[n for b in missed for n in found[b]][:8]}")
    return blocks


def _enclosing(model: nn.Module, name: str) -> str:
    candidates = set(_candidates(model))
    if name in candidates:  # its own block, the add in its caller's forward (verify checks it is)
        return name
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:k]) in candidates:
            return ".".join(parts[:k])
    return ".".join(parts[:-1])


def run_forward(model: nn.Module, trace: Trace | None, args: tuple, kwargs: dict, what: str):
    try:
        return trace.run(lambda: model(*args, **kwargs)) if trace is not None else model(*args, **kwargs)
    except Exception as error:
        raise ValueError(f"{what} of {type(model).__name__} failed ({type(error).__name__}: {error}). The probe "
                         "input is derived from the model (see moga.depth.probe); pass example_input= with inputs "
                         "its forward accepts") from error


def inside(name: str, blocks) -> bool:
    return any(b == "" or name.startswith(b + ".") for b in blocks)


def resolve(model: nn.Module, branches: Iterable[str | nn.Module]) -> list[str]:
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
            matches = [m for m in matches if not inside(m, set(matches) - {m, ""})]  # "blocks.*": the outermost
        found += [m for m in matches if m not in found]
    return found

