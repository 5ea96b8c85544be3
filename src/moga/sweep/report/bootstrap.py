"""Seed spread of the optima and of their drift: a percentile bootstrap over seeds.

Each resample redraws, for every scale on its own (runs of different scales are independent), as
many seeds as that scale has, with replacement; rebuilds the seed-mean curves the same way as the
point estimate (a diverged seed makes its point diverged); and recomputes the grid and refined optima,
the drift and the slope. The intervals are percentiles of those resamples. Only curves with a
trustworthy optimum enter, the same ones as the point estimate. Resampling is seeded: the same
records give the same intervals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moga.sweep.report.curves import Curve, Grid, locate, seed_means


@dataclass
class Bootstrap:
    resamples: int
    level: float  # e.g. 0.95 for a 2.5%..97.5% percentile interval
    seeds: dict[float, int]  # scale -> number of seeds (the most at any of its lrs)
    refined_log2_lr: dict[float, tuple[float, float]]  # scale -> interval of its refined log2 optimum
    drift_log2_refined: tuple[float, float] | None
    slope_per_doubling: tuple[float, float] | None
    drift_steps: tuple[float, float] | None  # None on an irregular grid
    share_within_criterion: float | None  # resamples whose grid-argmin drift meets the criterion


def bootstrap(curves: Sequence[Curve], grid: Grid, criterion: float, resamples: int = 1000,
              level: float = 0.95, seed: int = 0) -> Bootstrap | None:
    """None when no curve has two seeds at any lr (nothing to resample), or ``resamples`` is 0."""
    curves = [c for c in curves if c.trusted]
    seeds = {c.scale: int(max(c.n_seeds)) for c in curves}
    if not curves or max(seeds.values()) < 2 or resamples <= 0:
        return None
    rng = np.random.default_rng(seed)
    refined, steps, grid_log2 = [], [], []
    for c in curves:
        m = c.seed_matrix
        draw = rng.integers(0, m.shape[0], size=(resamples, m.shape[0]))
        index, log2_opt, _ = locate(np.log2(c.lrs), seed_means(m[draw]))
        to_grid = np.array([grid.index(lr) for lr in c.lrs] + [np.nan])  # index -1 -> nan
        steps.append(to_grid[index])
        grid_log2.append(np.append(np.log2(c.lrs), np.nan)[index])
        refined.append(log2_opt)
    refined, steps, grid_log2 = (np.stack(a, axis=1) for a in (refined, steps, grid_log2))

    tail = 100 * (1 - level) / 2
    interval = lambda a: _interval(a, tail)  # noqa: E731
    out = Bootstrap(resamples, level, seeds, {c.scale: interval(refined[:, j]) for j, c in enumerate(curves)},
                    None, None, None, None)
    if len(curves) < 2:
        return out
    out.drift_log2_refined = interval(np.nanmax(refined, 1) - np.nanmin(refined, 1))
    x = np.log2([c.scale for c in curves])
    xc = x - x.mean()
    complete = np.isfinite(refined).all(axis=1)
    slopes = (refined[complete] - refined[complete].mean(1, keepdims=True)) @ xc / (xc @ xc)
    out.slope_per_doubling = interval(slopes)
    drift_steps = np.nanmax(steps, 1) - np.nanmin(steps, 1)
    if grid.regular:
        out.drift_steps = interval(drift_steps)
        out.share_within_criterion = float(np.mean(drift_steps <= criterion))
    else:
        out.share_within_criterion = float(np.mean(np.nanmax(grid_log2, 1) - np.nanmin(grid_log2, 1) <= criterion))
    return out


def _interval(values: np.ndarray, tail: float) -> tuple[float, float] | None:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return None
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)
