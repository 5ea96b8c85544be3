"""The one-pass step in plain torch: the readable reference of ``lmo_step.cpp``, and the CUDA kernel
when compiled with ``torch.compile``. It runs on any device.

A tensor is viewed as (B, K, N) and normalized along K (docs/math.md §1.1, phi_p), for each of its
B x N rows or columns:

    m <- lerp(m, g, 1 - momentum)                      (the EMA; skipped without momentum)
    d <- lerp(g, m, momentum) if nesterov else m       (or g without momentum)
    W <- decay * W + c * phi_p(d)                      (decay = 1 - lr*wd, c = -lr * geometry factor)

with ``phi_p(d) = sign(d) |d|^(p-1) / ||d||_p^(p-1)`` (0 for a zero row; ``sign(d)`` for p = 1): ``phi`` and
``direction`` are :mod:`moga.numerics`' own, the ones the plain path and :mod:`moga.optim.functional` use. Math
is in float32 for float32 and bfloat16 tensors, float64 for float64. ``found_inf`` (a 0-dim tensor)
leaves everything as it was when nonzero, without a host sync.
"""

from __future__ import annotations

import torch

from moga.numerics import direction, math_dtype, phi


def tensor_step_(
    param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, found_inf: torch.Tensor | None,
    shape: tuple[int, int, int], c: float, p: float, momentum: float, nesterov: bool, decay: float,
) -> None:
    compute = math_dtype(param.dtype)
    g = grad.reshape(shape).to(compute)
    m = None if buf is None else buf.reshape(shape).to(compute).lerp(g, 1 - momentum)  # out of place: found_inf
    w = param.reshape(shape).to(compute) * decay + c * phi(direction(g, m, momentum, nesterov), p, (1,))
    if found_inf is not None:  # keep the old values where the step is skipped
        keep = found_inf.to(param.device) != 0
        w = torch.where(keep, param.reshape(shape).to(compute), w)
        if buf is not None:
            m = torch.where(keep, buf.reshape(shape).to(compute), m)
    if buf is None:
        param.copy_(w.reshape(param.shape))
    else:  # one foreach copy: inductor's C++ backend fails on two copies of the row layout (KeyError 'bufN')
        torch._foreach_copy_([param, buf], [w.reshape(param.shape), m.reshape(buf.shape)])


def tensor_steps_(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay, step=tensor_step_) -> None:
    """The list form of the op (same arguments as ``torch.ops.moga.lmo_step_``)."""
    for k, (w, g) in enumerate(zip(params, grads)):
        if w.numel() == 0:
            continue
        buf = bufs[k] if bufs else None
        step(w, g, buf, found_inf, tuple(shapes[3 * k: 3 * k + 3]), scales[k], p, momentum, nesterov, decay)
