"""Precision: which dtype each tensor of a step lives and computes in.

The math runs in float32 for 16-bit parameters (float64 for float64 ones); momentum and Adam moments are
kept in the optimizer's ``state_dtype`` (float32, or bfloat16 to halve their memory); with master weights
a 16-bit parameter's float32 copy takes the step and is rounded into it afterwards.
"""

from __future__ import annotations

import torch

from moga.numerics import math_dtype
from moga.optim.sharded import local

LOW_PRECISION = (torch.float16, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def state_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The ``state_dtype`` option as a dtype (a name such as "bfloat16" too)."""
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if resolved not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {dtype!r}")
    return resolved


def low_precision(p: torch.Tensor) -> bool:
    return p.dtype in LOW_PRECISION


def in_compute_dtype(state: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 copies of bfloat16 state (the same tensors otherwise); :func:`write_back` stores them."""
    return [s.float() if s.dtype in LOW_PRECISION else s for s in state]


def write_back(state: list[torch.Tensor], work: list[torch.Tensor]) -> None:
    for s, w in zip(state, work):
        if w is not s:
            s.copy_(w)


def master_targets(state, params: list[torch.Tensor], master_weights: bool) -> list[torch.Tensor]:
    """What the step updates: the float32 master copy of a 16-bit parameter (made in ``state[p]`` on first
    use), or the parameter."""
    if not master_weights:
        return params
    out = []
    for p in params:
        if low_precision(p):
            if "master" not in state[p]:
                state[p]["master"] = p.detach().to(torch.float32, memory_format=torch.preserve_format)
            out.append(state[p]["master"])
        else:
            out.append(p)
    return out


def round_into(params: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Master copies rounded into their 16-bit parameters (a skipped step rounds the same copy again)."""
    for p, t in zip(params, targets):
        if t is not p:
            p.copy_(t)


def compute_grads(params, ok: torch.Tensor | None, sanitize: bool = False) -> list[torch.Tensor]:
    """The gradients (local shards) in the compute dtype: float32 copies of 16-bit ones, with a skipped
    step's non-finite values zeroed on the way (``sanitize`` zeroes them in float32 gradients too)."""
    out = []
    for p in params:
        g = local(p.grad)
        compute = math_dtype(p.dtype)
        if g.dtype != compute:
            g = g.to(compute) if ok is None else torch.where(ok, g, 0.0).to(compute)
        elif sanitize and ok is not None:
            g = torch.where(ok, g, 0.0)
        out.append(g)
    return out


def unscale_(grads: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """Gradients times 1/grad_scale in place, that factor rounded as GradScaler rounds it; one foreach
    call per device and dtype."""
    inv = grad_scale.double().reciprocal().float()
    by_kind: dict = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), gs in by_kind.items():
        torch._foreach_mul_(gs, inv.to(device, non_blocking=True))


def dense(t: torch.Tensor) -> bool:
    """No gaps and no overlaps in memory: its elements fill one block, in some order of the dims."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_memory_order(*lists: list[torch.Tensor]) -> bool:
    """torch's fused kernels walk every tensor's memory as one flat array and ignore strides: they step
    element i of one tensor with element i of the others only when all are dense with the same strides
    (a transposed parameter, or a gradient assigned with other strides, would scramble the state)."""
    for tensors in zip(*lists):
        first = tensors[0]
        order = [s for s, n in zip(first.stride(), first.shape) if n > 1]
        if not dense(first) or any(
                t.shape != first.shape or [s for s, n in zip(t.stride(), t.shape) if n > 1] != order
                for t in tensors[1:]):
            return False
    return True
