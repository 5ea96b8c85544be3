"""The fused steps over lists of tensors: :func:`fused_lmo_step_` for tensors that hold their rows or
columns whole, :func:`fused_split_step_` for CPU shards whose rows or columns are split over ranks, and
:func:`all_finite`, the non-finite check."""

from __future__ import annotations

import torch

from moga.geometry import Geometry
from moga.kernels import ops
from moga.kernels.build import load_extension
from moga.kernels.coverage import fits, plan
from moga.layout import Layout
from moga.numerics import Reduce, direction, math_dtype, phi


def _planned(geometry: Geometry, layouts: list, params: list[torch.Tensor], grads: list[torch.Tensor],
             bufs: list[torch.Tensor] | None, lr: float, split: bool):
    """The tensors one kernel call takes (work), with their (B, K, N) views, step factors ``-lr * factor`` and
    one p; the rest (indices) go to the plain path. A split step plans empty shards too (every rank must make
    the same reductions) and cannot take p = 1; a local one skips empty tensors (nothing to update)."""
    device = params[0].device
    work, rest, shapes, scales, p_common = [], [], [], [], None
    for k, (w, g) in enumerate(zip(params, grads)):
        if (w.device.type != "cpu" if split else w.device != device) or not fits(w, g, bufs[k] if bufs else None):
            rest.append(k)
            continue
        if w.numel() == 0 and not split:
            continue
        planned = geometry.kernel_plan(w.shape, layouts[k]) if split else plan(geometry, layouts[k], w.shape)
        if planned is None or (split and planned.p == 1) or (p_common is not None and planned.p != p_common):
            rest.append(k)
            continue
        shape, p_common, factor = planned
        work.append(k)
        shapes.extend(shape)
        scales.append(-lr * factor)
    return work, rest, shapes, scales, p_common


def fused_lmo_step_(
    geometry: Geometry, layouts: list[Layout | None], params: list[torch.Tensor], grads: list[torch.Tensor],
    bufs: list[torch.Tensor] | None, lr: float, momentum: float, nesterov: bool, weight_decay: float,
    found_inf: torch.Tensor | None = None,
) -> list[int]:
    """One fused step (momentum EMA, Nesterov, decoupled decay, LMO) for the parameters the kernel
    covers, all on ``params[0]``'s device; returns the indices of those it left to the plain path."""
    work, rest, shapes, scales, p = _planned(geometry, layouts, params, grads, bufs, lr, split=False)
    if work:
        _op("lmo_step", params[0].device)(
            [params[k] for k in work], [grads[k] for k in work], [bufs[k] for k in work] if bufs else [],
            found_inf, shapes, scales, p, momentum if bufs else 0.0, nesterov, 1 - lr * weight_decay,
        )
    return rest


def fused_split_step_(
    geometry: Geometry, layouts: list[Layout], params: list[torch.Tensor], grads: list[torch.Tensor],
    bufs: list[torch.Tensor] | None, lr: float, momentum: float, nesterov: bool, weight_decay: float,
    reduce: Reduce, found_inf: torch.Tensor | None = None,
) -> list[int]:
    """The fused step for CPU shards whose normalized axis is split over ranks (col on a row-sharded
    matrix): the C++ kernel updates m and sums ``|d|^p`` and ``max |d|`` per row or column, ``reduce(x, op)``
    combines them over the ranks (one sum and one max for all the tensors), and the kernel updates W. Rows
    or columns whose combined sums are out of range take an exact step here, with one more sum. Every rank
    must pass the same tensors, empty shards included. Returns the indices left to the plain path."""
    work, rest, shapes, scales, p_common = _planned(geometry, layouts, params, grads, bufs, lr, split=True)
    if not work:
        return rest
    lib = load_extension()
    ws, gs = [params[k] for k in work], [grads[k] for k in work]
    ms = [bufs[k] for k in work] if bufs else []
    beta = momentum if bufs else 0.0
    parts = lib.lmo_partials(gs, ms, found_inf, shapes, p_common, beta, nesterov)
    sums, tops = (torch.cat([x[i].reshape(-1) for x in parts]) for i in (0, 1))  # float64 if dtypes mix
    reduce(sums, "sum")
    reduce(tops, "max")
    sizes = [x[0].numel() for x in parts]
    combined = [torch.stack([s, t]).to(x.dtype).view_as(x)
                for s, t, x in zip(sums.split(sizes), tops.split(sizes), parts)]
    flags = lib.lmo_apply(ws, gs, ms, found_inf, shapes, scales, combined, p_common, beta, nesterov,
                          1 - lr * weight_decay)
    for i, k in enumerate(work):  # rare; the flags come from combined sums, so every rank agrees
        if bool(flags[i].any()):
            _exact_split_(ws[i], gs[i], ms[i] if ms else None, shapes[3 * i: 3 * i + 3], p_common, scales[i],
                          1 - lr * weight_decay, beta, nesterov, combined[i][1], flags[i], reduce)
    return rest


def _exact_split_(w, g, m, shape, p, c, decay, momentum, nesterov, tops, flags, reduce: Reduce) -> None:
    """The flagged rows or columns of a split step: ``direction`` and ``phi_p`` of :mod:`moga.numerics` (exact
    at any magnitude) in float64 on the (B, K, N) view, its sums combined over the ranks. Their maxima are the
    kernel's combined ones, so only the sum crosses the ranks."""
    compute = math_dtype(w.dtype)
    b, k, n = shape
    d = direction(g.to(compute), None if m is None else m.to(compute), momentum, nesterov)
    peak = tops.double().view(b, 1, n)
    lmo = phi(d.double().view(b, k, n), p, (1,), lambda x, op: peak if op == "max" else reduce(x, op))
    wv = w.view(b, k, n)
    new = (wv.to(compute) * decay).double() + c * lmo
    wv.copy_(torch.where(flags.view(b, 1, n), new.to(w.dtype), wv))


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool on the CPU: no element of the (CPU) tensors is NaN or inf. One exact read-only pass."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    return _op("found_nonfinite", tensors[0].device)(tensors) == 0


_PUBLIC_OPS = {"lmo_step": "lmo_step_op", "found_nonfinite": "found_nonfinite"}  # library op -> custom op


def _op(name: str, device: torch.device):
    """The public custom op (``torch.ops.moga``) where torch.compile must see it; in eager on the CPU the
    library's own op, which skips the custom op's Python layers (about 0.1 ms a call)."""
    if device.type == "cpu" and not torch.compiler.is_compiling():
        return getattr(load_extension(), name)
    return getattr(ops, _PUBLIC_OPS[name])
