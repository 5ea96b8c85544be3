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

Branches are found from the forward, not from class names (``moga.depth.trace``): one probe forward is
recorded op by op, the blocks are the outermost elements of ``ModuleList``/``Sequential`` containers
whose forward adds something to its own input, and a block's branches are the modules whose outputs
those adds take (the outermost submodule with parameters that returned it, through dropout, casts and
sums). A module with a ``residual_branches()`` method (this project's blocks) names its own. K counts
blocks: for encoder-decoders (T5, Whisper) and two-tower models (CLIP), the blocks of both stacks.
``branches=`` names them by hand (glob patterns or modules); K is then yours to give (``depth=``).

Every call proves what it did (``verify=True``), on a probe input (``moga.depth.probe``: derived from
the model, or ``example_input=``), in the model's eval mode and without gradients:

1. an unscaled forward, recorded: each block's input and output;
2. the same block inputs with every branch scaled by a probe alpha (the given alpha when it lies in
   [2^-8, 2^-4], else 2^-4: near 1 a misplaced scale cannot be told from a right one; 2^-2 for models
   with 16-bit floating parameters, whose rounding hides smaller branches), recorded: every
   residual add must take its branch through linear ops from a scaled output (so a norm after the scaled
   module, as Gemma2's post-norms, is an error), and no scale may sit on the residual stream itself (as
   Bloom's ``self_attention``, which adds the residual inside);
3. the same inputs with the branches scaled by 0. Each block's contribution, its output at alpha minus
   its output at 0, must be alpha times the unscaled one, within a factor of ``1/sqrt(alpha)`` in norm:
   halfway, in log scale, between a right scale (ratio 1) and one that does nothing (ratio 1/alpha, a
   norm after it) or acts twice (ratio alpha). Not exactly alpha: a later branch of a block sees an input
   the earlier ones changed, and a nonlinearity after the add (a post-activation ResNet's ReLU) bends the
   contribution: a CIFAR ResNet-66 block measured 2.04 at 2^-2, which the old factor 2 refused.

Any failure raises, naming the block and what was measured, and leaves the model as it was. The ratios
are in ``ResidualScaling.measured``. On the meta device (shapes, no values) only step 2 runs.
``verify=False`` skips the probe, for models whose blocks contribute nothing yet (zero-initialized
branches) or that cannot run a forward.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from moga.depth.probe import example_call
from moga.depth.trace import Trace, branch_sources, residual_adds, spine

MODES = ("inverse_depth", "none")
SCALE_NAME = "residual_scale"
PROBE_RANGE = (2.0 ** -8, 2.0 ** -4)  # alphas the probe uses as given; others are probed at PROBE_ALPHA
PROBE_ALPHA = 2.0 ** -4
# In bfloat16/float16 a branch scaled by 2^-4 drowns in the rounding of the stream (measured: Bloom's
# ratio 0.69, DeBERTa's 0.63 at 2^-4; 0.99 and 0.95 at 2^-2).
LOW_PRECISION_PROBE_ALPHA = 2.0 ** -2


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
    """What :func:`scale_residual_branches` did; ``remove()`` undoes it. ``measured``: block -> its
    contribution's ratio (scaled / unscaled) over the probe's alpha, 1 being exact (empty if not verified)."""

    model: nn.Module = field(repr=False)
    branches: tuple[str, ...]
    alpha: float
    depth: int | None
    blocks: tuple[str, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)
    probe_alpha: float | None = None

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
    example_input=None,
    verify: bool = True,
) -> ResidualScaling:
    """Scale every residual branch of ``model`` by ``alpha``, in place, and prove it on a probe input.

    ``alpha`` defaults to ``residual_alpha(depth, mode, k_base, beta)``, where ``depth`` defaults to the
    number of residual blocks found. ``branches`` names the branch modules (glob patterns over module
    names, or the modules themselves) instead of finding them; then ``depth`` or ``alpha`` must be given,
    since only you know what K counts. A branch already scaled gets the new alpha (alpha is set, never
    multiplied). ``example_input`` (a tensor, a tuple of arguments or a dict of keyword arguments) is the
    probe input when the model's cannot be derived (see ``moga.depth.probe``). The probe (module
    docstring) raises if any block's contribution does not shrink by alpha; ``verify=False`` skips it.
    """
    if branches is not None and alpha is None and depth is None:
        raise ValueError("with explicit branches, give depth=K (for a transformer, K counts blocks, not "
                         "attention and MLP sub-blocks; see moga.depth) or alpha")
    if alpha is not None:
        _check_positive("alpha", alpha)
    if not verify:
        if branches is None:
            blocks = _declared_blocks(model)
            if not blocks:
                raise ValueError(f"verify=False finds branches only from residual_branches() methods, and "
                                 f"{type(model).__name__} has none: name them with branches=")
            targets = [name for names in blocks.values() for name in names]
            depth = len(blocks) if depth is None else depth
        else:
            blocks, targets = {}, _resolve(model, branches)
        alpha = residual_alpha(depth, mode, k_base, beta) if alpha is None else float(alpha)
        return ResidualScaling(model, tuple(_attach(model, targets, alpha)), alpha, depth, tuple(blocks))

    with _probe_mode(model):
        args, kwargs = example_call(model, example_input)
        found, unscaled, problems = _find(model, args, kwargs)
        if branches is None:
            blocks = {b: names for b, names in found.items() if names}
            if not blocks:
                raise ValueError(_none_found(model, problems))
            targets = [name for names in blocks.values() for name in names]
            depth = len(blocks) if depth is None else depth
        else:
            targets = _resolve(model, branches)
            blocks = _blocks_of(model, targets, found)
        alpha = residual_alpha(depth, mode, k_base, beta) if alpha is None else float(alpha)
        probe = _probe_alpha(model, alpha)
        before = set(residual_scales(model))
        scaled = _attach(model, targets, probe)
        try:
            measured = _verify(model, args, kwargs, blocks, scaled, unscaled, probe)
        except Exception:  # leave the model as it was: new scales go, old ones get their alpha back on exit
            for name in scaled:
                if name not in before:
                    _detach(model.get_submodule(name))
            raise
    for name in scaled:
        getattr(model.get_submodule(name), SCALE_NAME).alpha = alpha
    return ResidualScaling(model, tuple(scaled), alpha, depth, tuple(blocks), measured, probe)


def remove_residual_scaling(model: nn.Module) -> list[str]:
    """Remove every residual scale from ``model`` (and from copies of it); returns the branch names."""
    names = list(residual_scales(model))
    for name in names:
        _detach(model.get_submodule(name))
    return names


def residual_scales(model: nn.Module) -> dict[str, float]:
    """Branch name -> alpha, for every scaled branch of ``model``."""
    return {
        name: getattr(m, SCALE_NAME).alpha
        for name, m in model.named_modules() if isinstance(getattr(m, SCALE_NAME, None), ResidualScale)
    }


def residual_blocks(model: nn.Module, example_input=None, declared: bool = True) -> dict[str, list[str]]:
    """Block name -> names of its branch modules, found from one probe forward of ``model`` (see
    ``moga.depth.trace``); blocks with a ``residual_branches()`` method name their own unless
    ``declared=False``."""
    with _probe_mode(model):
        found, _, _ = _find(model, *example_call(model, example_input), declared)
    return {b: names for b, names in found.items() if names}


# --- finding and proving ----------------------------------------------------------------------------


class _probe_mode:
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


def _declared_blocks(model: nn.Module) -> dict[str, list[str]]:
    modules = {id(m): name for name, m in model.named_modules()}
    blocks: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if _inside(name, blocks) or not callable(getattr(module, "residual_branches", None)):
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


def _find(model: nn.Module, args: tuple, kwargs: dict, use_declared: bool = True):
    """Blocks -> their branches (declared or found), each block's recorded call, and the problems met."""
    candidates = _candidates(model)
    trace = Trace(model, set(candidates))
    _run(model, trace, args, kwargs, "the unscaled probe forward")
    declared = _declared_blocks(model) if use_declared else {}
    found: dict[str, list[str]] = {}
    problems: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        if name not in candidates or _inside(name, found):
            continue
        costs = trace.costs(name)
        if name in declared:
            found[name] = declared[name]
        elif costs is not None and residual_adds(costs.call, costs):
            found[name], problems[name] = trace.branches(name)
        elif len(trace.calls.get(name, [])) > 1:
            problems[name] = [f"it ran {len(trace.calls[name])} times in one forward (shared weights?), and a block "
                              "must run once for its scale to be checked"]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    found = {b: sorted(names, key=order.__getitem__) for b, names in found.items()}
    calls = {c: (trace.calls[c][0].args, trace.calls[c][0].kwargs, trace.calls[c][0].output.tensor)
             for c in candidates if trace.ran_once(c)}  # tensors only: the recorded graph can go
    return found, calls, problems


def _none_found(model: nn.Module, problems: dict[str, list[str]]) -> str:
    why = "".join(f" In {b}, {'; '.join(p)}." for b, p in list(problems.items())[:3] if p)
    sample = [n for n, _ in model.named_modules()][1:9]
    return (f"found no residual branches in {type(model).__name__}: no element of a ModuleList or Sequential "
            f"adds the output of one of its submodules to its own input in the probe forward.{why} Name the "
            "modules whose output is added to the residual stream, e.g. scale_residual_branches(model, depth=K, "
            f"branches=[...]) with module names such as {sample}, or give the block class a residual_branches() "
            "method that returns them")


def _blocks_of(model: nn.Module, targets: list[str], found: dict[str, list[str]]) -> dict[str, list[str]]:
    """The blocks named branches belong to: the blocks found, each needing at least one named branch."""
    blocks: dict[str, list[str]] = {}
    for target in targets:
        owner = next((b for b in found if _inside(target, {b: 0})), None)
        if owner is None:  # no block found around it: verify on its enclosing container element or parent
            owner = _enclosing(model, target)
        blocks.setdefault(owner, []).append(target)
    missed = [b for b in found if found[b] and b not in blocks]
    if missed:
        raise ValueError(
            f"branches= names no module in block(s) {missed[:4]}{' ...' if len(missed) > 4 else ''}, which add "
            f"branches to the residual stream too (found: {found[missed[0]]}); depth scaling scales every block")
    return blocks


def _enclosing(model: nn.Module, name: str) -> str:
    candidates = set(_candidates(model))
    parts = name.split(".")
    for k in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:k]) in candidates:
            return ".".join(parts[:k])
    return ".".join(parts[:-1])


def _run(model: nn.Module, trace: Trace | None, args: tuple, kwargs: dict, what: str):
    try:
        return trace.run(lambda: model(*args, **kwargs)) if trace is not None else model(*args, **kwargs)
    except Exception as error:
        raise ValueError(f"{what} of {type(model).__name__} failed ({type(error).__name__}: {error}). The probe "
                         "input is derived from the model (see moga.depth.probe); pass example_input= with inputs "
                         "its forward accepts") from error


def _verify(model, args, kwargs, blocks: dict[str, list[str]], scaled: list[str], unscaled: dict,
            alpha: float) -> dict[str, float]:
    missing = [b for b in blocks if b not in unscaled]
    if missing:
        raise ValueError(f"cannot verify block {missing[0]}: it did not run exactly once in the probe forward, "
                         "with a tensor input and output")
    inputs = {b: _clone(unscaled[b][:2]) for b in blocks}
    y1 = {b: unscaled[b][2] for b in blocks}

    trace = Trace(model, set(blocks), inputs)
    _run(model, trace, args, kwargs, "the scaled probe forward")
    ya = {b: trace.outputs[b] for b in blocks}
    tags = {f"{name}.{SCALE_NAME}" for name in scaled}  # this call's scales; earlier ones are at 1
    for block in blocks:
        _check_structure(trace, block, blocks[block], tags)
    if any(t.is_meta for t in y1.values()):
        return {}  # meta tensors have shapes, no values: the structure is all there is to check

    zero = Trace(model, set(blocks), {b: _clone(unscaled[b][:2]) for b in blocks}, record=False)
    scales = [getattr(model.get_submodule(name), SCALE_NAME) for name in scaled]
    for s in scales:
        s.alpha = 0.0  # set directly: ResidualScale refuses 0 from users
    try:
        _run(model, zero, args, kwargs, "the probe forward with branches at 0")
    finally:
        for s in scales:
            s.alpha = alpha
    measured, allowed = {}, tolerance(alpha)
    for block in blocks:
        y0 = zero.outputs[block]
        full = float((y1[block] - y0).double().norm())
        if not full > 1e-7 * float(y1[block].double().norm()) + 1e-30:
            raise ValueError(f"block {block} contributes nothing measurable on the probe input (its output is the "
                             "same with its branches at 0 and at 1: zero-initialized branches?), so the probe "
                             "cannot check its scaling; pass example_input= where it does, or verify=False")
        ratio = float((ya[block] - y0).double().norm()) / full / alpha
        measured[block] = ratio
        if not 1 / allowed <= ratio <= allowed:
            raise ValueError(
                f"block {block}: with branches {blocks[block]} scaled by alpha = {alpha:g}, its contribution "
                f"(output minus its output with the branches at 0) is {ratio * alpha:.4g} times the unscaled one, "
                f"not about alpha (allowed: a factor {allowed:g}). The scaled modules do not end where the "
                "block adds its branches to the residual stream")
    return measured


def tolerance(probe_alpha: float) -> float:
    """The factor a block's contribution ratio may differ from 1: the geometric midpoint between a right
    scale (1) and a scale that does nothing (1/alpha) or acts twice (alpha)."""
    return probe_alpha ** -0.5


def _probe_alpha(model: nn.Module, alpha: float) -> float:
    if any(p.is_floating_point() and torch.finfo(p.dtype).bits <= 16 for p in model.parameters()):
        return LOW_PRECISION_PROBE_ALPHA
    return alpha if PROBE_RANGE[0] <= alpha <= PROBE_RANGE[1] else PROBE_ALPHA


def _check_structure(trace: Trace, block: str, names: list[str], tags: set[str]) -> None:
    costs = trace.costs(block)
    if costs is None:
        raise ValueError(f"cannot verify block {block}: it did not run once with a tensor output in the scaled probe")
    for node, branch in spine(costs.call, costs):
        on_spine = [m for m in node.modules if m in tags]
        if on_spine:
            raise ValueError(
                f"block {block}: {on_spine[0][:-len(SCALE_NAME) - 1]} returns the residual stream itself (it adds "
                "the residual inside, or normalizes the sum), so scaling it scales the stream, not a branch. Scale "
                f"the modules whose outputs it adds instead{_hint(trace, block)}")
        if branch is None:
            continue
        sources, stuck = branch_sources(branch, costs, lambda n: any(m in tags for m in n.modules))
        if stuck is not None or not sources:
            raise ValueError(
                f"block {block}: a residual add takes {trace.describe(stuck or branch, block)}, which is not "
                f"a linear function of the scaled modules {names}, so it is not scaled by alpha (a norm or another "
                f"nonlinear op sits between, or a branch is not named){_hint(trace, block)}")


def _hint(trace: Trace, block: str) -> str:
    names = trace.branch_hint(block)
    return f"; the modules whose outputs its residual adds take are {names}" if names else ""


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _attach(model: nn.Module, targets: list[str], alpha: float) -> list[str]:
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
        if name not in scaled:
            scaled.append(name)
    return scaled


# --- helpers -------------------------------------------------------------------------------------------


def _inside(name: str, blocks) -> bool:
    return any(b == "" or name.startswith(b + ".") for b in blocks)


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
