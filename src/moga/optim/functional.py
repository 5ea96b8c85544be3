"""What ``opt.step()`` does to a weight, in plain torch: the core of MOGA, Muon and rescaled AdamW.

A param group's ``update="lmo"`` step is steepest descent in its geometry (docs/math.md §3.1)::

    m <- lerp(m, g, 1 - beta)                 the momentum EMA (beta = momentum; no m at 0)
    d <- direction(g, m, beta, nesterov)      lerp(g, m, beta) with Nesterov, else m (g without momentum)
    W <- (1 - lr*wd) W + lr * lmo(d)          the geometry's LMO (moga.geometry, docs/math.md §2)

where, with ``n_in`` and ``n_out`` the fan_in and fan_out of the weight's layout, ``lmo(d)`` is
``-n_in^(-1/p) phi_p(d_r)`` on each row r in ``row(p)``, ``-(n_out^(1/q)/n_in) phi_{q*}(d_c)`` on each column c
in ``col(q)`` (``embedding``: no ``1/n_in``), ``-sign(d)/n_in`` in ``sign``, ``-sqrt(n_out/n_in) U V^T`` in
``spectral`` (Muon), ``-sign(d)`` for vectors;
``phi_p(d) = sign(d) |d|^(p-1) / ||d||_p^(p-1)`` (:func:`moga.numerics.phi`). ``update="adam"`` puts Adam's
``m_hat / (sqrt(v_hat) + eps)`` in place of ``sign(d)`` in a sign geometry, as torch.optim.AdamW with
``lr * c`` (``c`` the geometry's factor).

:func:`lmo_step_` and :func:`adam_step_` are those lines for one tensor, and the code the optimizer's plain
path runs: :class:`~moga.optim.base.GeometryOptimizer` makes a param group's EMA and decay at once
(:func:`average_`, foreach calls gated on the device) and then calls :func:`lmo_step_` on each local tensor
(``averaged=True``); whole-matrix steps (batched, or split among ranks) are :mod:`moga.optim.whole`'s. Every fast
path (the fused C++ kernel, the compiled kernel, FSDP2 shards) is tested against these functions.
"""

from __future__ import annotations

import math

import torch

from moga.geometry import Geometry
from moga.layout import Layout
from moga.numerics import Reduce, Scalar, direction, phi
from moga.optim.nonfinite import ema_, finite, gate
from moga.optim.precision import in_compute_dtype, write_back
from moga.workspace import Workspace, scratch

__all__ = ["adam_step_", "adam_steps_", "average_", "direction", "gated_direction", "lmo_step_", "phi"]


def lmo_step_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None, *, geometry: Geometry,
              layout: Layout | str | None, lr: Scalar, momentum: float, nesterov: bool, weight_decay: float = 0.0,
              averaged: bool = False, ok: torch.Tensor | None = None, workspace: Workspace | None = None,
              reduce: Reduce | None = None, moment: torch.Tensor | None = None) -> None:
    """One steepest-descent step of ``w`` in ``geometry``; ``m`` is its momentum buffer (None: no momentum),
    ``moment`` a stateful geometry's state (NorMuon's row second moment), updated in place (left as it was on
    a skipped step).
    ``averaged``: ``m`` already holds this step's EMA and ``w`` its decay (:func:`average_` made them for the
    whole param group). ``ok`` (a 0-d bool, False on a skipped step; ``lr`` is then 0) zeroes the direction
    that could hold the gradient's NaN; ``reduce`` combines a shard's partial sums (:mod:`moga.optim.sharded`)."""
    if not averaged:
        if m is not None:
            m.lerp_(g, 1 - momentum)
        w.mul_(1 - lr * weight_decay)
    d = gated_direction(g, m, momentum, nesterov, ok, scratch(workspace, g, 2))
    if moment is None:
        geometry.apply_lmo_(w, d, lr, layout, workspace, reduce)
    else:  # the state's EMA weight, 0 on a skipped step
        geometry.apply_lmo_(w, d, lr, layout, workspace, reduce, moment=moment,
                            moment_weight=gate(ok, 1 - geometry.beta2, 0.0))


def gated_direction(g, m, momentum, nesterov, ok, out=None) -> torch.Tensor:
    """:func:`direction`, zeroed on a skipped step where it could hold the gradient's NaN (which would pass
    through the zero step size); the EMA ``m`` itself was left untouched there."""
    if m is None:
        return g if ok is None else torch.where(ok, g, g.new_zeros(()), out=out)
    return finite(direction(g, m, momentum, nesterov, out=out), ok) if nesterov else m


def average_(targets: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor] | None, *,
             lr: float, momentum: float, weight_decay: float, ok: torch.Tensor | None) -> list | None:
    """The first and last lines' elementwise parts for a param group, as foreach calls gated on ``ok``:
    ``m <- lerp(m, g, 1 - momentum)`` on the buffers ``bufs`` (None without momentum) and ``W <- (1 - lr*wd) W``
    on ``targets``. Returns the EMAs in the compute dtype (float32 copies of bfloat16 state, stored back)."""
    ms = None
    if bufs is not None:
        ms = in_compute_dtype(bufs)
        ema_(ms, grads, 1 - momentum, ok)
        write_back(bufs, ms)
    if weight_decay:
        torch._foreach_mul_(targets, gate(ok, 1 - lr * weight_decay, 1.0))
    return ms


def adam_step_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *, scale: float,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One Adam step of ``w`` in a sign geometry of factor ``scale``; ``step`` counts this one (1 first)."""
    beta1, beta2 = betas
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    w.mul_(1 - lr * weight_decay)
    denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
    w.sub_(m.div(denom).mul_(lr * scale / (1 - beta1**step)))


def adam_steps_(targets: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], scales: list[float], *, lr: float,
                betas: tuple[float, float], eps: float, weight_decay: float, ok: torch.Tensor | None) -> None:
    """:func:`adam_step_` on ``targets`` with sign factors ``scales``, in float32 on float32 copies of the
    moments, gated on ``ok``; ``steps`` (0-d tensors) already count this step. The same expressions as
    torch.optim.AdamW with ``lr * c``."""
    beta1, beta2 = betas
    ms, vs = in_compute_dtype(exp_avgs), in_compute_dtype(exp_avg_sqs)
    w1, b2 = gate(ok, 1 - beta1, 0.0), gate(ok, beta2, 1.0)
    for m, v, g in zip(ms, vs, grads):
        m.lerp_(g, w1 if ok is None else w1.to(m.dtype))
        v.mul_(b2).addcmul_(g, g, value=1 - beta2)
    write_back(exp_avgs, ms)
    write_back(exp_avg_sqs, vs)
    if weight_decay:
        torch._foreach_mul_(targets, gate(ok, 1 - lr * weight_decay, 1.0))
    for t, c, m, v, step in zip(targets, scales, ms, vs, steps):
        step = step.double()  # bias corrections in float64, as torch.optim.AdamW and the fused kernel
        step_size = gate(ok, lr * c, 0.0) / (1 - beta1**step)
        denom = torch.sqrt(v).div_(torch.sqrt(1 - beta2**step)).add_(eps)
        t.sub_(m.div(denom).mul_(step_size))
