"""Measurements along the actual updates of a training run, and the depth paper's step rule.

Everything here takes tensors the trainer already has (parameters before and after a step, gradients),
as lists in the order of ``block.entries``, and costs no HVP: norms, dual norms, and at most one extra
gradient on a probe batch (:func:`moga.smoothness.hessian.probe`). A typical interval check::

    block = BlockGeometry.from_optimizer(opt)
    before = probe(model, loss_fn, probe_batch, block.params)
    opt.step()
    after = probe(model, loss_fn, probe_batch, block.params)
    layers = layer_diagnostics(opt, before.params, after.params, before.grads, grads_after=after.grads)
    L = trajectory_smoothness(before.grads, after.grads, before.params, after.params, block)
    lemma = descent_residual(before.loss, after.loss, before.grads, before.params, after.params, block, L)

With training-batch gradients instead of a fixed probe batch, the gradient difference also holds the
change of batch, and the trajectory smoothness is an upper estimate polluted by gradient noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from moga.smoothness.block import BlockGeometry, difference, inner

Tensors = Sequence[torch.Tensor]


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return math.nan if num == 0 else math.inf


def trajectory_smoothness(grad_before: Tensors, grad_after: Tensors, params_before: Tensors,
                          params_after: Tensors, block) -> float:
    """``||grad(W_{t+1}) - grad(W_t)||_block,* / ||W_{t+1} - W_t||_block``: the smoothness seen along the
    step actually taken (a lower bound on the smoothness over the segment, by the mean value theorem).
    NaN when the step and the gradient change are both zero."""
    block = BlockGeometry.of(block)
    return _ratio(block.dual_norm(difference(grad_after, grad_before)),
                  block.norm(difference(params_after, params_before)))


@dataclass
class DescentResidual:
    """The descent lemma along ``Delta = W_{t+1} - W_t``: ``residual = f(W + Delta) - f(W) - <grad, Delta>``.

    An L-smooth loss has ``residual <= (L/2) ||Delta||^2`` (``bound``, when L is given); ``curvature``
    ``= 2 residual / ||Delta||^2`` is the smallest L for which this step satisfies it.
    """

    residual: float
    linear: float  # <grad, Delta>, the first-order change of the loss
    change: float  # f(W + Delta) - f(W)
    step_norm: float  # ||Delta||_block
    curvature: float
    bound: float | None = None
    holds: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def descent_residual(loss_before: float, loss_after: float, grad_before: Tensors, params_before: Tensors,
                     params_after: Tensors, block, L: float | None = None) -> DescentResidual:
    """:class:`DescentResidual` of one step, from the losses and gradient at ``W_t`` on the same batch."""
    block = BlockGeometry.of(block)
    delta = difference(params_after, params_before)
    linear = inner(grad_before, delta)
    change = float(loss_after) - float(loss_before)
    residual = change - linear
    size = block.norm(delta)
    curvature = _ratio(2 * residual, size**2)
    bound = None if L is None else 0.5 * L * size**2
    return DescentResidual(residual, linear, change, size, curvature, bound,
                           None if bound is None else residual <= bound)


def depth_paper_step(grad_dual_norm: float, L: float) -> float:
    """The depth paper's step ``eta* = ||grad||_* / L``: the lr that minimises the descent lemma's upper bound
    ``f - eta ||grad||_* + (L/2) eta^2`` for a unit LMO step, from a measured or running L."""
    if not L > 0:
        raise ValueError(f"the smoothness L must be > 0, got {L}")
    if grad_dual_norm < 0:
        raise ValueError(f"a dual norm is >= 0, got {grad_dual_norm}")
    return grad_dual_norm / L


class RunningSmoothness:
    """A running L from trajectory measurements: ``"max"`` (the largest seen, the conservative one) or
    ``"ema"`` (exponential average with ``beta``). NaN and inf measurements are skipped."""

    def __init__(self, mode: str = "ema", beta: float = 0.9):
        if mode not in ("ema", "max"):
            raise ValueError(f"mode must be 'ema' or 'max', got {mode!r}")
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.mode, self.beta = mode, beta
        self.value: float | None = None
        self.count = 0

    def update(self, measured: float) -> float | None:
        if math.isfinite(measured):
            self.count += 1
            if self.value is None:
                self.value = measured
            elif self.mode == "max":
                self.value = max(self.value, measured)
            else:
                self.value = self.beta * self.value + (1 - self.beta) * measured
        return self.value

    def step(self, grad_dual_norm: float) -> float | None:
        """``eta* = ||grad||_* / L`` with the running L; None before the first measurement."""
        return None if not self.value else depth_paper_step(grad_dual_norm, self.value)


def layer_diagnostics(source, params_before: Tensors, params_after: Tensors, grads: Tensors,
                      lr: float | None = None, weight_decay: float | None = None,
                      grads_after: Tensors | None = None) -> list[dict]:
    """Per layer (block entry), one dict:

    - ``update_norm``: ``||W_after - (1 - lr*wd) W_before||_k``, the step without its weight decay, in the
      layer's own geometry; ``lr`` exactly (``update_over_lr`` = 1) for an LMO step with an exact LMO,
      about ``lr`` for Newton-Schulz, anything for Adam's direction;
    - ``step_norm``: ``||W_after - W_before||_k``, weight decay included;
    - ``grad_dual_norm``: ``||grads_k||_k*`` (the layer's share of the block Lipschitz constant);
    - ``weight_norm``: ``||W_after||_k``;
    - ``trajectory_smoothness``: ``||grads_after_k - grads_k||_k* / step_norm`` when ``grads_after`` is given.

    ``source`` is a moga optimizer (its groups give each layer's lr and weight decay, so call this before
    the scheduler changes them), a role plan or a :class:`BlockGeometry`; ``lr`` and ``weight_decay``
    override the optimizer's (without an optimizer, weight decay is taken as 0 and ``update_over_lr`` needs
    ``lr``). ``grads`` are the gradients at ``W_before``.
    """
    optimizer = source if isinstance(source, torch.optim.Optimizer) else None
    block = BlockGeometry.of(source)
    for tensors in (params_before, params_after, grads, *([grads_after] if grads_after is not None else [])):
        block.check(tensors)
    rows = []
    for k, e in enumerate(block.entries):
        group = optimizer.param_groups[e.group] if optimizer is not None and e.group is not None else {}
        step_lr = lr if lr is not None else group.get("lr")
        step_lr = None if step_lr is None else float(step_lr)  # torch allows tensor learning rates
        wd = float(weight_decay if weight_decay is not None else group.get("weight_decay", 0.0))
        before, after = params_before[k].detach(), params_after[k].detach()
        decayed = before * (1 - step_lr * wd) if wd and step_lr is not None else before
        update = e.norm(after - decayed)
        step = e.norm(after - before)
        row = {
            "name": e.name, "role": e.role, "geometry": str(e.geometry), "update": e.update,
            "lr": step_lr, "update_norm": update,
            "update_over_lr": _ratio(update, step_lr) if step_lr is not None else None,
            "step_norm": step, "grad_dual_norm": e.dual_norm(grads[k]), "weight_norm": e.norm(after),
        }
        if grads_after is not None:
            row["trajectory_smoothness"] = _ratio(e.dual_norm(grads_after[k] - grads[k]), step)
        rows.append(row)
    return rows
