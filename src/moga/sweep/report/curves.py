"""One loss-vs-lr curve per scale: seed aggregation, the grid argmin and its parabola refinement.

Definitions (the report's "Definitions" section repeats them):

- A curve's point at one lr is the mean of the metric over the seeds that ran there. If any seed
  diverged the point is diverged (``inf``): a rate that diverges for some seeds cannot be reused
  safely, and averaging only the survivors would hide that. Missing runs (failed, pending) are left
  out of the mean; a point with no run at all is not on the curve.
- The grid optimum is the argmin of the curve; ties go to the smaller lr (the safer one).
- The refined optimum is the vertex of the parabola, in log2(lr), through the grid optimum and its two
  neighbours on the curve. There is none when the optimum is at an end of the curve (grid edge), when
  a neighbour diverged, when the curve has fewer than 3 finite points, or when the three points are
  flat; the refined optimum is then the grid optimum, and ``refinement`` says why.
- A curve whose optimum is at an end of its own lr list is at the grid edge: its true optimum may lie
  beyond, so it has no trustworthy optimum (``status`` "edge"); "all diverged" when no point is finite.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moga.sweep.report.schema import SweepRecord

IRREGULAR_TOLERANCE = 0.15  # relative spread of log2 spacings still called log-spaced (1-3-10 grids pass)


@dataclass
class Grid:
    """A panel's lr grid: the sorted lrs of all its cells. Grid steps count positions in it."""

    lrs: list[float]
    regular: bool  # log-spaced: every log2 gap within IRREGULAR_TOLERANCE of the median gap
    step_log2: float | None  # the median log2 gap (None for a one-point grid)

    def index(self, lr: float) -> int:
        return self.lrs.index(lr)


def make_grid(lrs: Sequence[float], tolerance: float = IRREGULAR_TOLERANCE) -> Grid:
    lrs = sorted(set(lrs))
    gaps = np.diff(np.log2(lrs))
    if len(gaps) == 0:
        return Grid(lrs, True, None)
    step = float(np.median(gaps))
    return Grid(lrs, bool(np.all(np.abs(gaps - step) <= tolerance * step)), step)


@dataclass
class Curve:
    scale: float
    lrs: list[float]  # the lrs with at least one run (finished or diverged), ascending
    loss: list[float]  # mean over seeds; inf when any seed diverged
    loss_min: list[float | None]  # finite seeds' min and max: the band drawn around the curve
    loss_max: list[float | None]
    n_seeds: list[int]
    n_diverged: list[int]
    status: str  # "ok", "edge" or "all diverged"
    edge: str | None  # "lower", "upper" or "both" (a one-point curve) when status is "edge"
    best_lr: float | None
    best_loss: float | None
    best_step: int | None  # position of best_lr in the panel's grid
    refined_lr: float | None
    refined_log2_lr: float | None
    refinement: str  # "parabola", or why there is none
    seed_best_lrs: dict[int, float | None]  # each seed's own grid optimum (None: all diverged)
    seed_matrix: np.ndarray = field(repr=False)  # seeds x lrs: the data the bootstrap resamples

    @property
    def trusted(self) -> bool:
        return self.status == "ok"


def parabola_vertex(x0, x1, x2, y0, y1, y2):
    """Vertex of the parabola through three points (any spacing, x0 < x1 < x2), clipped to [x0, x2];
    nan where it opens downwards or is flat. Works elementwise on arrays."""
    x0, x1, x2, y0, y1, y2 = (np.asarray(v, dtype=float) for v in (x0, x1, x2, y0, y1, y2))
    with np.errstate(divide="ignore", invalid="ignore"):
        f01 = (y1 - y0) / (x1 - x0)
        f12 = (y2 - y1) / (x2 - x1)
        curvature = (f12 - f01) / (x2 - x0)
        vertex = (x0 + x1) / 2 - f01 / (2 * curvature)
    return np.where(curvature > 0, np.clip(vertex, x0, x2), np.nan)


def locate(log2_lrs: np.ndarray, loss: np.ndarray):
    """Grid argmin and refined log2 optimum of each row of ``loss`` (rows x lrs; inf diverged, nan
    missing). Returns (index, refined log2 lr, refined?) arrays; index -1 and nan when no point is finite."""
    y = np.where(np.isnan(loss), np.inf, loss)
    n = y.shape[1]
    has_finite = np.isfinite(y).any(axis=1)
    i = np.argmin(y, axis=1)  # first minimum: ties go to the smaller lr
    left, right = np.clip(i - 1, 0, n - 1), np.clip(i + 1, 0, n - 1)
    rows = np.arange(len(y))
    yl, yc, yr = y[rows, left], y[rows, i], y[rows, right]
    fit = has_finite & (i > 0) & (i < n - 1) & np.isfinite(yl) & np.isfinite(yr)
    with np.errstate(invalid="ignore"):
        vertex = parabola_vertex(log2_lrs[left], log2_lrs[i], log2_lrs[right],
                                 np.where(fit, yl, 0.0), np.where(fit, yc, 0.0), np.where(fit, yr, 0.0))
    fit &= np.isfinite(vertex)
    refined = np.where(fit, vertex, log2_lrs[i])
    return np.where(has_finite, i, -1), np.where(has_finite, refined, np.nan), fit


def seed_means(matrix: np.ndarray) -> np.ndarray:
    """Mean over axis -2 (seeds) ignoring missing (nan); inf as soon as one seed diverged."""
    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # all-missing columns are nan, as intended
        return np.nanmean(matrix, axis=-2)


def build_curve(scale: float, records: Sequence[SweepRecord], metric: str, grid: Grid) -> Curve | None:
    """The curve of one scale from its records (one panel); None when no run has a value."""
    cells = {(r.lr, r.seed): r.loss(metric) for r in records}
    cells = {k: v for k, v in cells.items() if v is not None}
    if not cells:
        return None
    lrs = sorted({lr for lr, _ in cells})
    seeds = sorted({s for _, s in cells})
    matrix = np.full((len(seeds), len(lrs)), np.nan)
    for (lr, seed), value in cells.items():
        matrix[seeds.index(seed), lrs.index(lr)] = value
    mean = seed_means(matrix)
    finite = np.where(np.isfinite(matrix), matrix, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, hi = np.nanmin(finite, axis=0), np.nanmax(finite, axis=0)

    log2_lrs = np.log2(lrs)
    index, refined, fitted = (a[0] for a in locate(log2_lrs, mean[None, :]))
    seed_index = locate(log2_lrs, matrix)[0]
    curve = Curve(
        scale=scale, lrs=lrs, loss=mean.tolist(),
        loss_min=[None if math.isnan(v) else float(v) for v in lo],
        loss_max=[None if math.isnan(v) else float(v) for v in hi],
        n_seeds=(~np.isnan(matrix)).sum(axis=0).tolist(), n_diverged=np.isinf(matrix).sum(axis=0).tolist(),
        status="ok", edge=None, best_lr=None, best_loss=None, best_step=None,
        refined_lr=None, refined_log2_lr=None, refinement="parabola",
        seed_best_lrs={s: (lrs[j] if j >= 0 else None) for s, j in zip(seeds, seed_index.tolist())},
        seed_matrix=matrix,
    )
    if index < 0:
        curve.status, curve.refinement = "all diverged", "no finite point"
        return curve
    curve.best_lr, curve.best_loss, curve.best_step = lrs[index], float(mean[index]), grid.index(lrs[index])
    curve.refined_log2_lr = float(refined)
    curve.refined_lr = float(2.0**refined)
    if len(lrs) == 1:
        curve.status, curve.edge = "edge", "both"
    elif index == 0 or index == len(lrs) - 1:
        curve.status, curve.edge = "edge", "lower" if index == 0 else "upper"
    if not fitted:
        curve.refinement = _why_not_refined(curve, index)
    return curve


def _why_not_refined(curve: Curve, index: int) -> str:
    if sum(math.isfinite(v) for v in curve.loss) < 3:
        return "fewer than 3 finite points: not refined"
    if curve.status == "edge":
        return "optimum at the grid edge: not refined"
    if not (math.isfinite(curve.loss[index - 1]) and math.isfinite(curve.loss[index + 1])):
        return "a neighbour of the optimum diverged: not refined"
    return "flat around the optimum: not refined"
