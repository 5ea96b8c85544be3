"""What ``opt.step()`` does to a weight, in plain torch: the core of MOGA, Muon and rescaled AdamW.

A param group's ``update="lmo"`` step is steepest descent in its geometry (docs/math.md §3.1)::

    m <- lerp(m, g, 1 - beta)                 the momentum EMA (beta = momentum; no m at 0)
    d <- direction(g, m, beta, nesterov)      lerp(g, m, beta) with Nesterov, else m (g without momentum)
    W <- (1 - lr*wd) W + lr * lmo(d)          the geometry's LMO (moga.geometry, docs/math.md §2)

where, for the fan_in ``n`` and fan_out ``m`` of the weight's layout, ``lmo(d)`` is ``-n^(-1/p) phi_p(d_r)``
on each row r in ``row(p)``, ``-(m^(1/q)/n) phi_{q*}(d_c)`` on each column c in ``col(q)`` (``embedding``:
no ``1/n``), ``-sign(d)/n`` in ``sign``, ``-sqrt(m/n) U V^T`` in ``spectral`` (Muon), ``-sign(d)`` for vectors;
``phi_p(d) = sign(d) |d|^(p-1) / ||d||_p^(p-1)`` (:func:`moga.numerics.phi`). ``update="adam"`` puts Adam's
``m_hat / (sqrt(v_hat) + eps)`` in place of ``sign(d)`` in a sign geometry, as torch.optim.AdamW with
``lr * c`` (``c`` the geometry's factor).

:func:`lmo_step_` and :func:`adam_step_` are those lines for one tensor: the reference that every fast path
(the fused C++ kernel, the compiled kernel, FSDP2 shards, the optimizer's own foreach path) is tested
against. :func:`lmo_steps_` is the same step over a param group's tensors as the optimizer runs it when no
fused kernel takes them: foreach calls, a skipped step gated on the device (``ok``), scratch memory, and
whole-matrix steps left for :mod:`moga.optim.sharded` to split among ranks.
"""

from __future__ import annotations

import math

import torch

from moga.geometry import Geometry
from moga.layout import Layout
from moga.numerics import direction, phi

__all__ = ["adam_step_", "direction", "lmo_step_", "phi"]


def lmo_step_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None, *, geometry: Geometry,
              layout: Layout | str | None, lr: float, momentum: float, nesterov: bool,
              weight_decay: float) -> None:
    """One steepest-descent step of ``w`` in ``geometry``; ``m`` is its momentum buffer (None: no momentum)."""
    if m is not None:
        m.lerp_(g, 1 - momentum)
    w.mul_(1 - lr * weight_decay)
    geometry.apply_lmo_(w, direction(g, m, momentum, nesterov), lr, layout)


def adam_step_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *, scale: float,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One Adam step of ``w`` in a sign geometry of factor ``scale``; ``step`` counts this one (1 first)."""
    beta1, beta2 = betas
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    w.mul_(1 - lr * weight_decay)
    denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
    w.sub_(m.div(denom).mul_(lr * scale / (1 - beta1**step)))
