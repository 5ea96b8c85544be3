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
from moga.layout import Layout, as_layout
from moga.numerics import direction, phi
from moga.optim.nonfinite import ema_, finite, gate
from moga.optim.precision import in_compute_dtype, write_back
from moga.optim.sharded import WholeJob, check_stateful_split, is_dtensor, needs_whole, reducer
from moga.workspace import Workspace, scratch

__all__ = ["adam_step_", "adam_steps_", "direction", "lmo_step_", "lmo_steps_", "phi"]


def lmo_step_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None, *, geometry: Geometry,
              layout: Layout | str | None, lr: float, momentum: float, nesterov: bool,
              weight_decay: float, moment: torch.Tensor | None = None) -> None:
    """One steepest-descent step of ``w`` in ``geometry``; ``m`` is its momentum buffer (None: no momentum),
    ``moment`` a stateful geometry's state (NorMuon's row second moment), updated in place."""
    if m is not None:
        m.lerp_(g, 1 - momentum)
    w.mul_(1 - lr * weight_decay)
    state = {} if moment is None else {"moment": moment}
    geometry.apply_lmo_(w, direction(g, m, momentum, nesterov), lr, layout, **state)


def adam_step_(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *, scale: float,
               lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One Adam step of ``w`` in a sign geometry of factor ``scale``; ``step`` counts this one (1 first)."""
    beta1, beta2 = betas
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    w.mul_(1 - lr * weight_decay)
    denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
    w.sub_(m.div(denom).mul_(lr * scale / (1 - beta1**step)))


# --- the same steps over a param group's tensors, as the optimizer runs them -----------------------------


def lmo_steps_(geometry: Geometry, layouts: list, params: list[torch.Tensor], targets: list[torch.Tensor],
               grads: list[torch.Tensor], bufs: list[torch.Tensor] | None, *, lr: float, momentum: float,
               nesterov: bool, weight_decay: float, ok: torch.Tensor | None, workspace: Workspace | None = None,
               split_replicated: bool = False, moments: list[torch.Tensor] | None = None) -> list[WholeJob]:
    """:func:`lmo_step_` on ``targets`` (the parameters' local shards or master copies) with the gradients
    ``grads`` in the compute dtype and momentum buffers ``bufs`` (None without momentum), gated on ``ok``.
    ``moments``: a stateful geometry's state per parameter (NorMuon's row second moment), left as it was on a
    skipped step. Returns the steps that need whole matrices from other ranks (spectral on shards, or on replicas
    when ``split_replicated``), for :func:`moga.optim.sharded.step_whole`."""
    check_stateful_split(geometry, split_replicated)  # before anything changes
    alpha = gate(ok, lr, 0.0)  # 0 on a skipped step: every geometry maps a finite direction to a no-op
    directions = grads
    if bufs is not None:
        directions = in_compute_dtype(bufs)
        ema_(directions, grads, 1 - momentum, ok)  # m <- lerp(m, g, 1 - momentum)
        write_back(bufs, directions)
    if weight_decay:
        torch._foreach_mul_(targets, gate(ok, 1 - lr * weight_decay, 1.0))
    if moments is not None:
        _stateful_steps_(geometry, layouts, targets, grads, directions if bufs is not None else None, moments,
                         momentum, nesterov, alpha, ok)
        return []
    if (len(params) > 1 and needs_whole(geometry, layouts[0]) and geometry.batched
            and not split_replicated
            and not any(is_dtensor(p) for p in params)):
        _batched_whole_steps_(geometry, layouts, targets, grads, directions, momentum, nesterov, alpha, ok, workspace)
        return []
    whole = []
    for t, p, g, d, layout in zip(targets, params, grads, directions, layouts):
        defer = needs_whole(geometry, layout) and (is_dtensor(p) or split_replicated)
        out = None if defer else scratch(workspace, g, 2)  # deferred directions need their own memory
        d = _gated_direction(g, d if bufs is not None else None, momentum, nesterov, ok, out)
        if defer:
            whole.append(WholeJob(p, t, d, geometry, layout, alpha))
        else:
            geometry.apply_lmo_(t, d, alpha, layout, workspace, reducer(p, geometry, layout))
    return whole


def _stateful_steps_(geometry, layouts, targets, grads, directions, moments, momentum, nesterov, alpha, ok) -> None:
    """One matrix at a time, each with its state (these groups never take the fused kernel)."""
    weight = gate(ok, 1 - geometry.beta2, 0.0)  # the state's EMA weight, 0 on a skipped step
    for k, (t, g, v, layout) in enumerate(zip(targets, grads, moments, layouts)):
        d = _gated_direction(g, None if directions is None else directions[k], momentum, nesterov, ok)
        geometry.apply_lmo_(t, d, alpha, layout, moment=v, moment_weight=weight)


def _gated_direction(g, m, momentum, nesterov, ok, out=None) -> torch.Tensor:
    """:func:`direction`, zeroed on a skipped step where it could hold the gradient's NaN (which would pass
    through the zero step size); the EMA ``m`` itself was left untouched there."""
    if m is None:
        return g if ok is None else torch.where(ok, g, g.new_zeros(()), out=out)
    return finite(direction(g, m, momentum, nesterov, out=out), ok) if nesterov else m


def _batched_whole_steps_(geometry, layouts, targets, grads, directions, momentum, nesterov, alpha, ok, workspace):
    """Same-shape matrices go through one batched Newton-Schulz (bmm) call: a transformer's identical
    matrices cost one call, not one each. The stack is a batch axis ``b`` of the layout."""
    batches: dict[tuple, list[int]] = {}
    for k, (t, layout) in enumerate(zip(targets, layouts)):
        batches.setdefault((t.shape, t.dtype, t.device, layout), []).append(k)
    for (_, _, _, layout), ks in batches.items():
        stack = [_gated_direction(grads[k], directions[k] if momentum > 0 else None, momentum, nesterov, ok)
                 for k in ks]
        weights = torch.stack([targets[k] for k in ks])
        geometry.apply_lmo_(weights, torch.stack(stack), alpha, as_layout("b" + layout.spec), workspace)
        torch._foreach_copy_([targets[k] for k in ks], list(weights.unbind(0)))


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
