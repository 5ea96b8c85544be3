"""Proving a scaling on the probe input: structure (every residual add takes its branch linearly from a
scaled output) and size (each block's contribution shrinks by alpha); see ``moga.depth``."""

from __future__ import annotations

import torch
from torch import nn

from moga.depth.find import run_forward
from moga.depth.scale import SCALE_NAME
from moga.depth.trace import Trace, branch_sources, outer_residual_add, spine

PROBE_RANGE = (2.0 ** -8, 2.0 ** -4)  # alphas the probe uses as given; others are probed at PROBE_ALPHA
PROBE_ALPHA = 2.0 ** -4
# In bfloat16/float16 a branch scaled by 2^-4 drowns in the rounding of the stream (measured: Bloom's
# ratio 0.69, DeBERTa's 0.63 at 2^-4; 0.99 and 0.95 at 2^-2).
LOW_PRECISION_PROBE_ALPHA = 2.0 ** -2


def prove(model, args, kwargs, blocks: dict[str, list[str]], scaled: list[str], unscaled: dict,
            alpha: float) -> dict[str, float]:
    missing = [b for b in blocks if b not in unscaled]
    if missing:
        raise ValueError(f"cannot verify block {missing[0]}: it did not run exactly once in the probe forward, "
                         "with a tensor input and output. Name branches that lie in blocks which do (each "
                         "element of a ModuleList or Sequential that runs once, or the element itself when the "
                         "forward that calls it adds its output to its input), pass example_input= if the probe "
                         "took another path, or verify=False to scale without the proof")
    inputs = {b: clone(unscaled[b][:2]) for b in blocks}
    y1 = {b: unscaled[b][2] for b in blocks}

    trace = Trace(model, set(blocks), inputs)
    run_forward(model, trace, args, kwargs, "the scaled probe forward")
    ya = {b: trace.outputs[b] for b in blocks}
    tags = {f"{name}.{SCALE_NAME}" for name in scaled}  # this call's scales; earlier ones are at 1
    for block in blocks:
        _check_structure(trace, block, blocks[block], tags)
    if any(t.is_meta for t in y1.values()):
        return {}  # meta tensors have shapes, no values: the structure is all there is to check

    zero = Trace(model, set(blocks), {b: clone(unscaled[b][:2]) for b in blocks}, record=False)
    scales = [getattr(model.get_submodule(name), SCALE_NAME) for name in scaled]
    for s in scales:
        s.alpha = 0.0  # set directly: ResidualScale refuses 0 from users
    try:
        run_forward(model, zero, args, kwargs, "the probe forward with branches at 0")
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


def probe_alpha(model: nn.Module, alpha: float) -> float:
    if any(p.is_floating_point() and torch.finfo(p.dtype).bits <= 16 for p in model.parameters()):
        return LOW_PRECISION_PROBE_ALPHA
    return alpha if PROBE_RANGE[0] <= alpha <= PROBE_RANGE[1] else PROBE_ALPHA


def _check_structure(trace: Trace, block: str, names: list[str], tags: set[str]) -> None:
    costs = trace.costs(block)
    if costs is None:
        raise ValueError(f"cannot verify block {block}: it did not run once with a tensor output in the scaled probe")
    if names == [block]:  # its own branch: the residual add is in the forward that calls it
        scaled = lambda n: n is costs.call.output and any(m in tags for m in n.modules)  # noqa: E731
        if outer_residual_add(trace.recorder, costs.call, scaled) is None:
            raise ValueError(
                f"block {block}: its scaled output is not added to its own input by the forward that calls it "
                f"(as in h = h + block(h)): a nonlinear op sits between, or it is no residual branch. Move the ops "
                f"between into the branch module, name the modules whose outputs a residual add takes"
                f"{_hint(trace, block) and ' (' + _hint(trace, block)[2:] + ')'}, or pass verify=False")
        return
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


def clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(clone(v) for v in value)
    if isinstance(value, list):
        return [clone(v) for v in value]
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value

