"""The learning-rate range test (Smith 2017) the convergence paper used to pick its constant rates.

``mode="sweep"`` (Smith's, one run): the lr grows exponentially from ``lr_min`` to ``lr_max`` over
``steps`` steps; the loss is smoothed with a bias-corrected EMA and the test stops once the smoothed
loss exceeds ``diverge_factor`` x its minimum. ``mode="restart"`` (the paper's appendix D): each of
``num_lrs`` exponentially spaced rates trains the same initial model for ``steps_per_lr`` steps
(default one epoch) and reports its mean loss. Either way the suggested lr is where the loss falls
fastest against log(lr) (the "steepest" point); ``lr_at_min / 10`` is reported beside it. The curve
is saved as ``lr_range.png`` and ``lr_range.json``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch

from moga.files import save_figure, write_json
from moga.optim.multipliers import base_lr

from .build import build_optimizer, model_from_config
from .config import RunConfig, as_config
from .tasks import build_task

# Deferred on purpose, imported where used: matplotlib (about 0.5 s to import), only for the plot.


def _train_steps(task, model, optimizer, batches, lrs, accum, diverge_factor=None, smooth=0.0):
    """One step per lr in ``lrs``; returns raw losses (stops early on divergence)."""
    base = [g["lr"] for g in optimizer.param_groups]
    ref = base_lr(optimizer.param_groups[0]) or 1.0  # the swept lr is the base rate; role multipliers scale it
    losses, avg, best = [], 0.0, math.inf
    model.train()
    for i, lr in enumerate(lrs):
        for g, b in zip(optimizer.param_groups, base):
            g["lr"] = lr * (b / ref if ref else 1.0)
        total = 0.0
        for _ in range(accum):
            x, y = next(batches)
            loss, _, _ = task.loss(model, x, y, accuracy=False)
            (loss / accum).backward()
            total += float(loss.detach()) / accum
        if not math.isfinite(total):
            losses.append(math.inf)
            break
        if getattr(optimizer, "needs_loss", False):
            optimizer.step(loss=total)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if diverge_factor is not None:
            avg = smooth * avg + (1 - smooth) * total
            smoothed = avg / (1 - smooth ** (i + 1))
            best = min(best, smoothed)
            if smoothed > diverge_factor * best:
                break
    return losses


def smooth_losses(losses: list[float], beta: float = 0.98) -> list[float]:
    """fastai's bias-corrected exponential moving average."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            out.append(math.inf)
            continue
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def suggest_lr(lrs: list[float], losses: list[float], skip_start: int = 0) -> dict[str, float | None]:
    """'steepest': the lr where d loss / d log(lr) is most negative, before the minimum; 'min_div10'."""
    lrs_a, loss_a = np.asarray(lrs, dtype=float), np.asarray(losses, dtype=float)
    finite = np.isfinite(loss_a)
    if finite.sum() < 3:
        return {"steepest": None, "min_div10": None, "lr_at_min": None}
    lrs_a, loss_a = lrs_a[finite], loss_a[finite]
    i_min = int(np.argmin(loss_a))
    slope = np.gradient(loss_a, np.log(lrs_a))
    lo = min(skip_start, max(i_min - 1, 0))
    i_steep = lo + int(np.argmin(slope[lo:i_min + 1])) if i_min > lo else i_min
    return {"steepest": float(lrs_a[i_steep]), "min_div10": float(lrs_a[i_min] / 10), "lr_at_min": float(lrs_a[i_min])}


def lr_range_test(config: RunConfig | dict | str | Path, out_dir: str | Path, *, lr_min: float = 1e-5,
                  lr_max: float = 10.0, steps: int = 100, mode: str = "sweep", num_lrs: int = 8,
                  steps_per_lr: int | None = None, smooth: float = 0.98, diverge_factor: float = 4.0,
                  plot: bool = True) -> dict:
    """Run the test for the model, data and optimizer of ``config`` (one process); see the module doc."""
    if not 0 < lr_min < lr_max:
        raise ValueError(f"need 0 < lr_min < lr_max, got {lr_min}, {lr_max}")
    if mode not in ("sweep", "restart"):
        raise ValueError(f"mode must be 'sweep' or 'restart', got {mode!r}")
    cfg = as_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = build_task(cfg)
    torch.manual_seed(cfg.seed)
    model = model_from_config(cfg, task.model_inputs)
    optimizer = build_optimizer(cfg, model)
    accum = cfg.train.grad_accum
    if mode == "sweep":
        lrs = np.geomspace(lr_min, lr_max, steps).tolist()
        losses = _train_steps(task, model, optimizer, task.train_batches(), lrs, accum, diverge_factor, smooth)
        lrs = lrs[:len(losses)]
        curve = smooth_losses(losses, smooth)
        result = {"mode": mode, "lrs": lrs, "losses": losses, "smoothed": curve,
                  "suggestion": suggest_lr(lrs, curve, skip_start=min(10, len(lrs) // 10))}
    else:
        per_lr = steps_per_lr or task.steps_per_epoch
        lrs = np.geomspace(lr_min, lr_max, num_lrs).tolist()
        start_model, start_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        curve = []
        for lr in lrs:
            model.load_state_dict(start_model)
            optimizer.load_state_dict(copy.deepcopy(start_opt))
            losses = _train_steps(task, model, optimizer, task.train_batches(), [lr] * per_lr, accum)
            mean = sum(losses) / len(losses) if len(losses) == per_lr and all(map(math.isfinite, losses)) else math.inf
            curve.append(mean)
        result = {"mode": mode, "lrs": lrs, "losses": curve, "steps_per_lr": per_lr,
                  "suggestion": suggest_lr(lrs, curve)}
    result["suggested_lr"] = result["suggestion"]["steepest"]
    result["optimizer"] = cfg.optim.name
    write_json(out / "lr_range.json", result)
    if plot:
        result["plot"] = str(plot_lr_range(result, out / "lr_range.png"))
    return result


def plot_lr_range(result: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lrs = result["lrs"]
    if result["mode"] == "sweep":
        ax.plot(lrs, result["losses"], color="0.8", lw=1, label="loss")
        ax.plot(lrs, result["smoothed"], color="C0", lw=2, label="smoothed")
    else:
        ax.plot(lrs, result["losses"], "o-", color="C0", label=f"mean loss over {result['steps_per_lr']} steps")
    for key, color in (("steepest", "C3"), ("min_div10", "C2")):
        lr = result["suggestion"][key]
        if lr is not None:
            ax.axvline(lr, color=color, ls="--", lw=1, label=f"{key}: {lr:.2e}")
    curve = [v for v in (result.get("smoothed") or result["losses"]) if math.isfinite(v)]
    if curve:
        lo = min(v for v in curve + result["losses"] if math.isfinite(v))
        hi = min(max(curve), max(4 * min(curve), curve[0] * 1.1))
        if hi > lo:
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(f"lr range test ({result['optimizer']}, {result['mode']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return Path(path)
