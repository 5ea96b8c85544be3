"""Transfer metrics of a sweep, one :class:`PanelSummary` per panel (optimizer x scaling mode).

- Drift of the optimum across scales: among the curves with a trustworthy optimum, the largest
  minus the smallest grid optimum, in grid steps of the panel's grid and in log2 units, and the same
  for the refined optima; ``slope_per_doubling`` is the least-squares slope of the refined log2
  optimum against log2(scale), i.e. how many log2 units the optimum moves per doubling of depth/width.
- Curves at the grid edge only bound where their optimum is (below the lower edge, above the upper
  one). ``steps_at_least`` / ``log2_at_least`` is the smallest drift consistent with every curve,
  edges included: max over curves of the lowest possible position minus min of the highest.
- Regret of transfer at a scale (the grid table): L(lr_ref) - min L at that scale, where lr_ref is the grid
  optimum of the smallest scale and L the seed-mean curve; relative = absolute / min L. ``inf``
  ("diverges") when lr_ref diverges there. A lower bound when that scale's own optimum is at the grid edge.
- The verdict reads the refined optima and the regret off fitted curves, with seed intervals
  (:mod:`moga.sweep.report.decision`); :mod:`moga.sweep.report.verdict` states it.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from moga.sweep.report.bootstrap import bootstrap
from moga.sweep.report.curves import Curve, Grid, build_curve, make_grid
from moga.sweep.report.decision import decide_transfer
from moga.sweep.report.schema import SweepRecord, parse_records, scale_label
from moga.sweep.report.summary import Drift, PanelSummary, Regret
from moga.sweep.report.verdict import MAX_REGRET, criterion_text, decide

GROUP_KEYS = ("optimizer", "scaling")


def analyze(records: Iterable[SweepRecord | Mapping], scale_key: str | None = None, metric: str = "train_loss",
            group_keys: Sequence[str] = GROUP_KEYS, max_drift_steps: int = 1, max_drift_log2: float = 1.0,
            max_regret: float = MAX_REGRET,
            resamples: int = 1000, level: float = 0.95, seed: int = 0) -> list[PanelSummary]:
    """One summary per panel, in the order panels first appear in ``records``.

    ``scale_key`` selects the records of one sweep axis (depth or width); it may be omitted when all
    records share one. Each panel has its own lr grid. Raises ValueError on two records for the same
    (panel, scale, lr, seed): an axis that is not in ``group_keys`` would otherwise be averaged away.
    """
    records = select_scale(parse_records(records, scale_key), scale_key)
    panels: dict[str, tuple[tuple, list[SweepRecord]]] = {}  # by the values' JSON: a mapping (optim.overrides)
    for r in records:                                          # is a panel value too, and no dict key
        key = tuple(r.get(k) for k in group_keys)
        panels.setdefault(json.dumps(key, sort_keys=True, default=str), (key, []))[1].append(r)
    out = []
    for key, rows in panels.values():
        _check_unique(rows, dict(zip(group_keys, key)))
        grid = make_grid([r.lr for r in rows])
        by_scale: dict[float, list[SweepRecord]] = {}
        for r in sorted(rows, key=lambda r: r.scale):
            by_scale.setdefault(r.scale, []).append(r)
        curves = [c for s, rs in by_scale.items() if (c := build_curve(s, rs, metric, grid)) is not None]
        if not curves:
            continue
        criterion = max_drift_steps if grid.regular else max_drift_log2
        drift = measure_drift(curves, grid)
        regrets = transfer_regrets(curves)
        summary = PanelSummary(
            panel=dict(zip(group_keys, key)), metric=metric, scale_key=rows[0].scale_key, grid=grid, curves=curves,
            drift=drift, reference_scale=curves[0].scale, reference_lr=curves[0].best_lr, regrets=regrets,
            worst_regret=worst(regrets), bootstrap=bootstrap(curves, grid, criterion, resamples, level, seed),
            decision=(decide_transfer(curves, grid.step_log2 if grid.regular else None, criterion, max_regret,
                                      resamples, level, seed, label=lambda v: scale_label(rows[0].scale_key, v))
                      if len(curves) >= 2 and all(c.trusted for c in curves) else None),
            verdict="", verdict_line="", notes=[],
            criterion=criterion_text(grid, max_drift_steps, max_drift_log2, max_regret),
        )
        summary.verdict, summary.verdict_line, summary.notes = decide(
            summary, max_drift_steps, max_drift_log2, max_regret)
        out.append(summary)
    return out


def select_scale(records: list[SweepRecord], scale_key: str | None) -> list[SweepRecord]:
    keys = list(dict.fromkeys(r.scale_key for r in records))
    if scale_key is None:
        if len(keys) > 1:
            raise ValueError(f"the records sweep several scale keys ({', '.join(keys)}): pass scale_key")
        return records
    chosen = [r for r in records if r.scale_key == scale_key]
    if records and not chosen:
        raise ValueError(f"no record has scale_key {scale_key!r} (found: {', '.join(keys)})")
    return chosen


def _check_unique(rows: list[SweepRecord], panel: dict) -> None:
    seen: dict[tuple, SweepRecord] = {}
    for r in rows:
        key = (r.scale, r.lr, r.seed)
        if key in seen:
            raise ValueError(
                f"two records for panel {panel}, scale {r.scale:g}, lr {r.lr:g}, seed {r.seed}; add the axis that "
                f"tells them apart to group_keys (they differ in: {_differences(seen[key], r) or 'nothing'})")
        seen[key] = r


def _differences(a: SweepRecord, b: SweepRecord) -> str:
    da, db = a.model_dump(), b.model_dump()
    return ", ".join(k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k))


def measure_drift(curves: Sequence[Curve], grid: Grid) -> Drift:
    trusted = [c for c in curves if c.trusted]
    drift = Drift([c.scale for c in trusted], None, None, None, None, None, None)
    if len(trusted) >= 2:
        steps = [c.best_step for c in trusted]
        grid_log2 = np.log2([c.best_lr for c in trusted])
        refined = np.array([c.refined_log2_lr for c in trusted])
        drift.steps = max(steps) - min(steps) if grid.regular else None
        drift.log2_grid = float(grid_log2.max() - grid_log2.min())
        drift.log2_refined = float(refined.max() - refined.min())
        drift.slope_per_doubling = float(np.polyfit(np.log2(drift.scales), refined, 1)[0])
    if len(curves) >= 2:
        steps_iv = [_bounds(c, c.best_step, grid.index(c.lrs[0])) for c in curves]
        log2_iv = [_bounds(c, c.best_lr and math.log2(c.best_lr), math.log2(c.lrs[0])) for c in curves]
        drift.steps_at_least = _least_range(steps_iv) if grid.regular else None
        drift.log2_at_least = _least_range(log2_iv)
    return drift


def _bounds(c: Curve, position: float | None, lowest: float) -> tuple[float, float]:
    """Where the curve's true optimum can be, in the units of ``position``."""
    if c.status == "all diverged":
        return -math.inf, lowest  # below every rate tried
    lo = -math.inf if c.edge in ("lower", "both") else position
    hi = math.inf if c.edge in ("upper", "both") else position
    return lo, hi


def _least_range(intervals: list[tuple[float, float]]) -> float:
    return float(max(0.0, max(lo for lo, _ in intervals) - min(hi for _, hi in intervals)))


def transfer_regrets(curves: Sequence[Curve]) -> list[Regret]:
    """What reusing the smallest scale's best rate costs at every scale (empty if it has none)."""
    ref = curves[0]
    if ref.best_lr is None:
        return []
    out = []
    for c in curves:
        edge = c.status == "edge"
        if c.best_loss is None:
            out.append(Regret(c.scale, ref.best_lr, None, None, None, None, "no optimum", False))
            continue
        if ref.best_lr not in c.lrs:
            out.append(Regret(c.scale, ref.best_lr, None, c.best_loss, None, None, "not run", edge))
            continue
        loss = c.loss[c.lrs.index(ref.best_lr)]
        absolute = loss - c.best_loss
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            relative = absolute / c.best_loss if c.best_loss > 0 else None
        status = "reference" if c is ref else ("diverges" if math.isinf(loss) else "ok")
        out.append(Regret(c.scale, ref.best_lr, loss, c.best_loss, absolute, relative, status, edge))
    return out


def worst(regrets: Sequence[Regret]) -> Regret | None:
    """The costliest reuse: a divergence first, then the largest relative (else absolute) regret."""
    candidates = [r for r in regrets if r.status in ("ok", "diverges")]
    if not candidates:
        return None
    return max(candidates, key=lambda r: (r.relative if r.relative is not None else -math.inf, r.absolute))
