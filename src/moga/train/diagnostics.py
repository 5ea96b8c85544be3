"""Measurements around the optimizer step: per-layer diagnostics and the depth paper's step rule.

Both look at the step a run actually takes, in the norms of the optimizer's geometry (:mod:`moga.smoothness`;
optimizers without one, AdamW, SGD and adaptive GD, are measured in MOGA's default geometry), and take their
gradients on one fixed probe batch: the first ``micro_batch`` samples of the training split, without
augmentation, with the model in ``eval()`` mode. So neither changes what a run computes: no RNG is drawn, no
BatchNorm statistic moves and ``.grad`` is left alone (a test checks the trajectory bit for bit).

- ``logging.diagnostics_every = N``: at step 1 and every N steps, one ``"diagnostics"`` record in
  metrics.jsonl with, per layer (:func:`moga.smoothness.layer_diagnostics`): the update's norm in the
  layer's geometry with weight decay taken out (``lr`` for an LMO step: ``update_over_lr`` = 1), the dual
  norm of the probe gradient and of the step's own gradient, ``||W||`` and the trajectory smoothness
  ``||grad(W_{t+1}) - grad(W_t)||_* / ||W_{t+1} - W_t||``; and the same for the whole block, with the
  Frobenius norm of all its weights (the convergence paper's ``||W_t||``). Plot with
  ``moga smoothness diagnostics RUN_DIR`` (:func:`moga.experiments.smoothness.plots.plot_diagnostics`).
- ``logging.alignment_every = N``: every N steps, one ``"alignment"`` record: per hidden matrix, the
  momentum's Gram dominance, row coherence and the cosine between its row-normalized and orthogonalized
  directions (:mod:`moga.smoothness.alignment`). It reads the optimizer's state only: no probe, no RNG.
- ``optim.step_rule = "depth_paper"``: ``lr_t = min(schedule lr, ||G_t||_block,* / L_t)`` with ``G_t`` the
  step's gradient (docs/math.md §5.5: ``eta* = ||grad||_* / L``): the schedule's lr (``optim.lr``
  times its factor) is a cap. ``L_t`` is ``optim.smoothness`` when it is a number, else a running estimate of
  the block trajectory smoothness, measured every ``optim.smoothness_every`` steps: ``"max"``, the largest
  seen, or ``"ema"``, an exponential average (beta 0.9). Before the first step it is the smoothness along the
  first direction, from a trial step of block norm ``TRIAL_STEP`` that is then undone. Every param group's lr
  is scaled by the same factor, so their ratios stay as the optimizer set them.

  Why ``"max"`` by default: the trajectory smoothness is the curvature along the step taken, a lower bound on
  the smoothness, and it falls as training goes on (on Fashion-MNIST, from ~200 to ~10 over two epochs,
  while the HVP estimate at initialization is ~330). The average follows it down, the lr rises, and in
  ``moga smoothness steprule`` the run hit the cap and broke; the running maximum cannot fall.
"""

from __future__ import annotations

import math

import torch

from moga.optim.adaptive import global_norm
from moga.optim.multipliers import base_lr
from moga.smoothness import BlockGeometry, RunningSmoothness, layer_diagnostics, probe, trajectory_smoothness
from moga.smoothness.alignment import hidden_alignment

TRIAL_STEP = 1e-3  # block norm of the first, undone, step that gives L_0 (the weights are O(1) in these norms)
EMA_BETA = 0.9


def alignment_record(optimizer, step: int, epoch: float) -> dict:
    """``logging.alignment_every``: row normalization against orthogonalization on the hidden matrices'
    momentum (:func:`moga.smoothness.alignment.hidden_alignment`); empty for optimizers without roles."""
    return {"type": "alignment", "step": step, "epoch": epoch, **hidden_alignment(optimizer)}


class StepInstruments:
    """``lr_scale`` and ``before_step`` (after backward and clipping), ``after_step`` (after ``optimizer.step()``)."""

    def __init__(self, cfg, model, optimizer, task, device):
        self.every = cfg.logging.diagnostics_every
        self.rule = cfg.optim.step_rule == "depth_paper"
        running = cfg.optim.smoothness if isinstance(cfg.optim.smoothness, str) else None
        self.fixed_L = None if running else float(cfg.optim.smoothness)
        self.L_every = cfg.optim.smoothness_every
        self.running = RunningSmoothness(running or "max", EMA_BETA)
        self.model, self.optimizer, self.task, self.device = model, optimizer, task, device
        self.info: dict[str, float] = {}
        self._batch = self._before = None
        self._diagnose = self._measure = False
        self.active = bool(self.every) or self.rule
        if self.active:
            self.block = self._block()

    def _block(self) -> BlockGeometry:
        try:
            return BlockGeometry.from_optimizer(self.optimizer)
        except ValueError:  # torch's optimizers and adaptive GD have no geometry of their own
            return BlockGeometry.from_model(self.model)

    # --- the probe batch -----------------------------------------------------------------------------

    def _loss(self, model, batch) -> torch.Tensor:
        return self.task.loss(model, *batch)[0]

    def _probe(self):
        if self._batch is None:
            x, y = next(iter(self.task.eval_batches("train", self.task.micro_batch, 1)))
            self._batch = (x.to(self.device), y.to(self.device))
        training = self.model.training
        self.model.eval()
        try:
            return probe(self.model, self._loss, self._batch, self.block.params)
        finally:
            self.model.train(training)

    # --- around the step -------------------------------------------------------------------------------

    def lr_scale(self, step: int, lr: float) -> float:
        """The step rule's factor on this step's schedule ``lr`` (1 without a rule): ``min(1, ||G||_*/(L lr))``,
        so that ``lr x factor = min(lr, ||G||_*/L)``. The engine folds it into the schedule's factor and writes
        every group's lr once."""
        if not self.rule:
            return 1.0
        if self.fixed_L is None and self.running.value is None:
            self.running.update(self._trial_smoothness())
        dual = self.block.dual_norm(self.block.grads())
        L = self.fixed_L if self.fixed_L is not None else self.running.value
        self.info = {"grad_dual_norm": dual, "smoothness_L": L if L is not None else math.nan}
        if L and lr > 0 and math.isfinite(dual):
            return min(1.0, dual / L / lr)
        return 1.0

    def before_step(self, step: int) -> None:
        """``step`` is the number of steps taken so far; call it after the lrs of this step are set."""
        if not self.active:
            return
        self._diagnose = bool(self.every) and ((step + 1) % self.every == 0 or step == 0)
        self._measure = self.rule and self.fixed_L is None and step % self.L_every == 0
        self._before = self._probe() if self._diagnose or self._measure else None
        if self._diagnose:
            self._train_duals = self.block.dual_norms(self.block.grads())

    @torch.no_grad()
    def _trial_smoothness(self) -> float:
        """The smoothness along the first LMO direction of the probe gradient, from a small step then undone."""
        start = self._probe()
        direction = self.block.lmo(start.grads)
        size = self.block.norm(direction)
        if not size > 0:
            return math.nan
        for p, d in zip(self.block.params, direction):
            p.add_(d, alpha=TRIAL_STEP / size)
        moved = self._probe()
        for p, w in zip(self.block.params, start.params):
            p.copy_(w)  # bit for bit back where it was
        return trajectory_smoothness(start.grads, moved.grads, start.params, moved.params, self.block)

    def after_step(self, step: int, epoch: float) -> dict | None:
        """``step`` counts the step just taken; returns the diagnostics record when one is due."""
        if self._before is None:
            return None
        before, self._before = self._before, None
        after = self._probe()
        L = trajectory_smoothness(before.grads, after.grads, before.params, after.params, self.block)
        if self._measure:
            self.running.update(L)
        if not self._diagnose:
            return None
        rows = self._layers(before, after)
        for row, dual in zip(rows, self._train_duals):
            row["train_grad_dual_norm"] = dual
        lr = float(base_lr(self.optimizer.param_groups[0]))
        return {"type": "diagnostics", "step": step, "epoch": epoch, "lr": lr,
                "probe_loss": before.loss, "probe_loss_after": after.loss,
                "lipschitz": sum(r["grad_dual_norm"] for r in rows),
                "trajectory_smoothness": L,
                "update_norm": max(r["update_norm"] for r in rows),
                "weight_norm": max(r["weight_norm"] for r in rows),
                "weight_frobenius": global_norm(after.params),  # the convergence paper's ||W||
                "layers": rows}

    def _layers(self, before, after) -> list[dict]:
        if all(e.group is not None for e in self.block):
            return layer_diagnostics(self.optimizer, before.params, after.params, before.grads,
                                     grads_after=after.grads)
        # A block from the model: each entry gets the lr and weight decay of the group that holds it.
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        eta = getattr(self.optimizer, "last", {}).get("eta")  # adaptive GD's actual step size
        rows = []
        for k, e in enumerate(self.block):
            group = groups.get(id(e.param), {})
            lr = eta if eta is not None else group.get("lr")
            one = BlockGeometry([e])
            rows += layer_diagnostics(one, [before.params[k]], [after.params[k]], [before.grads[k]],
                                      lr=None if lr is None else float(lr),
                                      weight_decay=group.get("weight_decay", 0.0), grads_after=[after.grads[k]])
        return rows

    # --- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"value": self.running.value, "count": self.running.count}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.running.value, self.running.count = state["value"], state["count"]
