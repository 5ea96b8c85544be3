"""The result types of a sweep's transfer analysis: one :class:`PanelSummary` per panel, with its
:class:`Drift` and :class:`Regret` values. :mod:`moga.sweep.report.metrics` fills them in and
:mod:`moga.sweep.report.verdict` reads them; both import them from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from moga.sweep.report.bootstrap import Bootstrap
from moga.sweep.report.curves import Curve, Grid
from moga.sweep.report.decision import Decision
from moga.sweep.report.schema import scaling_label


@dataclass
class Drift:
    scales: list[float]  # the scales with a trustworthy optimum, which the drift is measured over
    steps: int | None  # grid-argmin drift in grid steps (None: fewer than 2 scales, or irregular grid)
    log2_grid: float | None  # the same in log2 units
    log2_refined: float | None  # refined optima: largest minus smallest log2 lr
    slope_per_doubling: float | None  # d log2(refined lr) / d log2(scale), least squares
    steps_at_least: float | None  # smallest drift consistent with all curves, edges included
    log2_at_least: float | None


@dataclass
class Regret:
    scale: float
    lr: float  # the reused rate: the smallest scale's grid optimum
    loss: float | None  # L(lr) at this scale; inf when it diverges, None when not run
    best_loss: float | None
    absolute: float | None
    relative: float | None  # absolute / best_loss (None when best_loss <= 0)
    status: str  # "reference", "ok", "diverges", "not run", "no optimum"
    lower_bound: bool  # this scale's optimum is at the grid edge: its best loss may be lower still


@dataclass
class PanelSummary:
    panel: dict[str, Any]  # group key -> value, e.g. {"optimizer": "moga", "scaling": "inverse_depth"}
    metric: str
    scale_key: str
    grid: Grid
    curves: list[Curve]
    drift: Drift
    reference_scale: float | None
    reference_lr: float | None
    regrets: list[Regret]
    worst_regret: Regret | None  # largest relative (or absolute) regret over the other scales
    bootstrap: Bootstrap | None
    decision: Decision | None  # drift and regret with seed intervals (None: fewer than 2 scales, or an edge)
    verdict: str  # "transfers", "does not transfer", "inconclusive" or "no verdict" (extend the grid)
    verdict_line: str
    criterion: str
    notes: list[str]

    @property
    def title(self) -> str:
        return ", ".join(scaling_label(str(v)) if k == "scaling" else _named(k, v) for k, v in self.panel.items()
                         if v not in ("", None))

    def to_dict(self) -> dict:
        """JSON-safe: non-finite numbers become null (a null loss on a curve is a diverged point)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("curves", "grid")}
        out = {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in out.items()}
        out["regrets"] = [asdict(r) for r in self.regrets]
        out["title"] = self.title
        out["grid"] = asdict(self.grid)
        out["curves"] = [{f.name: getattr(c, f.name) for f in fields(c) if f.name != "seed_matrix"}
                         for c in self.curves]
        for c in out["curves"]:
            c["seed_best_lrs"] = [{"seed": s, "lr": lr} for s, lr in c["seed_best_lrs"].items()]
        if self.bootstrap is not None:
            b = out["bootstrap"]
            b["seeds"] = [{"scale": s, "seeds": n} for s, n in b["seeds"].items()]
            b["refined_log2_lr"] = [{"scale": s, "interval": iv} for s, iv in b["refined_log2_lr"].items()]
        return json_safe(out)


def _named(key: str, value) -> str:
    """A panel value; numbers say which key they are (``p=1.5``), names speak for themselves."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{key.rsplit('.', 1)[-1]}={value:g}"
    return str(value)


def json_safe(value):
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.generic,)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
