"""Transfer decisions that state their noise: fitted optima, drift and regret with seed intervals.

Each scale's seed-mean loss is read as a function of x = log2(lr) (``FittedCurve``): near the grid argmin,
the parabola through the argmin and its two neighbours (its vertex is the refined optimum ``x*``, its
minimum ``f*``, its curvature ``a``); elsewhere, straight lines between the grid points (a diverged point
makes its segments diverge). With the smallest scale as the reference:

- drift at scale s: ``x*_s - x*_ref`` in log2 units (grid steps: divided by the grid's log2 step h);
- regret at scale s: ``f_s(x*_ref) / f*_s - 1``, what reusing the reference's refined optimum costs there,
  read off s's fitted curve;
- the cost of one grid step at s: ``a_s h^2 / f*_s``.

Intervals (``level``, 95% by default) come from a bootstrap over seeds: each resample redraws, at every
scale, as many seeds as it has, with replacement, as whole curves (one draw serves all its lrs: a seed's
offset shared by all its lrs cancels between lrs), and refits every curve. A point's resampled deviation
from its mean is widened by ``sqrt(n/(n-1)) t_(n-1) / z``, so that with few seeds the interval of a mean is
Student's t interval rather than the (too narrow) plug-in one; a point with one seed moves by the drawn
seed's offset and Student-t seed-by-lr noise, both fitted on the scale's points with two or more seeds
(:func:`seed_offsets`). A scale with no point of two seeds has no noise estimate: its panel is inconclusive.

The decision, with ``L`` the drift limit and ``R`` the regret cap:

- **transfers**: at every scale, the drift interval lies within ``[-L, L]`` and the regret's upper bound
  is at most ``R``;
- **does not transfer**: at some scale the drift interval lies beyond ``L`` (either way) or the regret's
  lower bound exceeds ``R`` (reusing a rate that diverges there in most resamples counts as infinite regret);
- **inconclusive** otherwise, with about how many seeds at the decisive rates would decide it: the
  interval's half-width shrinks as ``1/sqrt(seeds)``.
- **no verdict** (undecided: extend the grid) when an optimum lies on its grid's edge, unless the edges
  already prove the rate does not transfer (see :mod:`moga.sweep.report.metrics`).

Where one grid step costs more than ``R / L^2``, the two limits contradict each other (a drift the drift
rule allows costs more than the cap); where it costs so little that a drift of ``L`` steps stays under
``R / 4``, the regret cap cannot bind (low power). Both are said in the panel's notes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moga.sweep.report.curves import Curve
from moga.verdicts import DOES_NOT_TRANSFER, INCONCLUSIVE, TRANSFERS

Z95 = 1.959963984540054
MAX_SEEDS_QUOTED = 100  # "more than 100 seeds": the point estimate sits on the limit


@dataclass
class FittedCurves:
    """Fitted curves of one scale, one row per resample (row 0 alone for the point estimate)."""

    x: np.ndarray  # log2 lrs, ascending
    y: np.ndarray  # rows x lrs: mean losses (inf diverged)
    index: np.ndarray  # grid argmin per row (-1: no finite point)
    optimum: np.ndarray  # refined log2 optimum x*
    minimum: np.ndarray  # fitted minimum f*
    curvature: np.ndarray  # a (nan where no parabola was fitted)

    def at(self, where: np.ndarray) -> np.ndarray:
        """f(where) per row: the parabola inside the argmin's neighbourhood, straight lines elsewhere,
        inf between a point and a diverged neighbour, nan outside the lr range."""
        rows = np.arange(len(self.y))
        n = self.x.size
        where = np.asarray(where, dtype=float)
        j = np.clip(np.searchsorted(self.x, where), 1, max(n - 1, 1))
        out = np.full(len(rows), np.nan)
        if n >= 2:
            x0, x1 = self.x[j - 1], self.x[j]
            y0, y1 = self.y[rows, j - 1], self.y[rows, j]
            t = (where - x0) / (x1 - x0)
            with np.errstate(invalid="ignore"):
                line = np.where(t <= 0, y0, np.where(t >= 1, y1, y0 + t * (y1 - y0)))
            line = np.where((t > 0) & (t < 1) & (np.isinf(y0) | np.isinf(y1)), np.inf, line)
            out = np.where((where >= self.x[0]) & (where <= self.x[-1]), line, np.nan)
        else:
            out = np.where(where == self.x[0], self.y[:, 0], np.nan)
        lo = self.x[np.clip(self.index - 1, 0, n - 1)]
        hi = self.x[np.clip(self.index + 1, 0, n - 1)]
        inside = np.isfinite(self.curvature) & (where >= lo) & (where <= hi)
        parabola = self.minimum + np.nan_to_num(self.curvature) * (where - self.optimum) ** 2
        return np.where(inside, parabola, out)


def fit(x: np.ndarray, y: np.ndarray) -> FittedCurves:
    """Fit every row of ``y`` (rows x lrs) at ``x`` (log2 lrs)."""
    y = np.atleast_2d(np.asarray(y, dtype=float))
    rows, n = np.arange(len(y)), x.size
    finite = np.isfinite(y)
    has = finite.any(axis=1)
    index = np.argmin(np.where(finite, y, np.inf), axis=1)  # ties: the smaller lr
    left, right = np.clip(index - 1, 0, n - 1), np.clip(index + 1, 0, n - 1)
    xl, xc, xr = x[left], x[index], x[right]
    yl, yc, yr = y[rows, left], y[rows, index], y[rows, right]
    ok = has & (index > 0) & (index < n - 1) & np.isfinite(yl) & np.isfinite(yr)
    with np.errstate(divide="ignore", invalid="ignore"):
        f01 = (yc - yl) / (xc - xl)
        f12 = (yr - yc) / (xr - xc)
        a = (f12 - f01) / (xr - xl)
        vertex = (xl + xc) / 2 - f01 / (2 * a)
    ok &= np.isfinite(a) & (a > 0)
    optimum = np.where(ok, np.clip(np.where(ok, vertex, xc), xl, xr), xc)
    a = np.where(ok, a, np.nan)
    minimum = np.where(ok, yc - np.nan_to_num(a) * (xc - optimum) ** 2, yc)
    return FittedCurves(x=x, y=y, index=np.where(has, index, -1), optimum=np.where(has, optimum, np.nan),
                        minimum=np.where(has, minimum, np.nan), curvature=np.where(ok, a, np.nan))


# --- resampling --------------------------------------------------------------------------------------------

def widening(n: int, level: float) -> float:
    """Factor on a bootstrap deviation of a mean of ``n`` seeds that turns its plug-in spread into Student's."""
    from scipy import stats  # here: scipy.stats costs every command that imports the report half a second

    z = stats.norm.ppf(0.5 + level / 2)
    return math.sqrt(n / (n - 1)) * stats.t.ppf(0.5 + level / 2, n - 1) / z


def pooled_relative_sd(matrix: np.ndarray) -> tuple[float, int] | None:
    """(sd of seed losses relative to their point's mean, degrees of freedom) over the finite points that
    have two or more seeds; None when there is none."""
    ss, dof = 0.0, 0
    for column in matrix.T:
        v = column[np.isfinite(column)]
        if v.size >= 2 and np.isfinite(column[~np.isnan(column)]).all() and v.mean() > 0:
            ss += float(((v / v.mean() - 1) ** 2).sum())
            dof += v.size - 1
    return (math.sqrt(ss / dof), dof) if dof else None


def seed_offsets(matrix: np.ndarray) -> tuple[np.ndarray, float, int] | None:
    """Each seed's shared log offset (a seed whose whole curve lies higher: its data order, its init) and the
    sd and degrees of freedom of what is left, the seed-by-lr noise, fitted as log loss = point + seed + noise
    on the finite points that have two or more seeds; None when offsets and noise cannot be told apart."""
    rows, cols = matrix.shape
    use = [j for j in range(cols) if (~np.isnan(matrix[:, j])).sum() >= 2 and np.isfinite(
        matrix[~np.isnan(matrix[:, j]), j]).all() and (matrix[~np.isnan(matrix[:, j]), j] > 0).all()]
    if not use:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(matrix[:, use])
    seen = ~np.isnan(y)
    fitted = seen.any(axis=1)
    dof = int(seen.sum()) - len(use) - (int(fitted.sum()) - 1)
    if dof <= 0:
        return None
    offset = np.zeros(rows)
    for _ in range(50):  # alternating least squares: converges fast on these small tables
        point = np.nanmean(y - offset[:, None], axis=0)
        offset = np.where(fitted, np.nanmean(np.where(seen, y - point, np.nan), axis=1), 0.0)
        offset -= offset[fitted].mean()
    residual = np.where(seen, y - np.nanmean(y - offset[:, None], axis=0) - offset[:, None], 0.0)
    return offset, math.sqrt(float((residual**2).sum()) / dof), dof


def resample_means(matrix: np.ndarray, resamples: int, rng: np.random.Generator, level: float) -> np.ndarray | None:
    """resamples x lrs mean curves of one scale (seeds x lrs ``matrix``, nan missing, inf diverged); None
    when the scale has no noise estimate.

    Seeds are resampled as whole curves: one draw of seeds serves every lr of the scale, so a seed's shared
    offset (its data order, its init) moves all its points together and cancels in the differences between
    lrs, which are all that argmins, drifts and regrets read. Drawing each lr's seeds on their own counted
    that offset as noise at every lr: in width-mlp's rescaled AdamW at width 512 one seed's curve lies 3.4%
    above the others, the seed sd (1.9%) was four times the seed-by-lr noise (0.5%), and a one-seed point at
    the grid's top edge, 4.6% above the optimum, won 3% of resamples: a drift interval reaching +2.45 steps.
    At a point that ran only some seeds, a drawn seed that did not run there is replaced by an independent
    draw among those that did (each point's own draw stays uniform, as Student's widening assumes); a one-seed
    point moves by the drawn seed's offset plus Student-t seed-by-lr noise."""
    pooled = pooled_relative_sd(matrix)
    if pooled is None:
        return None
    split = seed_offsets(matrix)
    if split is None:  # offsets cannot be told from noise: every seed sd counts as noise
        offset, (sd, dof) = np.zeros(matrix.shape[0]), pooled
    else:
        offset, sd, dof = split
    seeds = matrix.shape[0]
    draw = rng.integers(0, seeds, size=(resamples, seeds))  # slot i -> seed draw[:, i], at every lr
    out = np.empty((resamples, matrix.shape[1]))
    for j, column in enumerate(matrix.T):
        ran = np.flatnonzero(~np.isnan(column))
        v = column[ran]
        mean = v.mean() if v.size else np.nan
        if v.size >= 2:
            drawn = draw[:, ran]
            elsewhere = ~np.isin(drawn, ran)
            drawn = np.where(elsewhere, ran[rng.integers(0, v.size, size=drawn.shape)], drawn)
            means = column[drawn].mean(axis=1)
            with np.errstate(invalid="ignore"):
                widened = mean + widening(v.size, level) * (means - mean)
            out[:, j] = np.where(np.isfinite(means) & np.isfinite(mean), widened, means)
        elif v.size == 1 and np.isfinite(mean):
            shift = np.exp(offset[draw[:, ran[0]]] - offset[ran[0]])
            out[:, j] = mean * shift * (1 + sd * rng.standard_t(dof, size=resamples))
        else:
            out[:, j] = mean
    return out


# --- the decision ------------------------------------------------------------------------------------------

@dataclass
class ScaleStats:
    """Drift and regret of one scale against the reference, with intervals."""

    scale: float
    seeds: int  # fewest seeds at this scale's decisive rates (the argmin, its neighbours, the reused rate)
    seed_sd: float | None  # pooled relative seed sd of its points
    optimum_log2: float  # refined optimum x*
    optimum_interval: tuple[float, float] | None
    step_cost: float | None  # relative loss of moving one grid step off the optimum
    drift_steps: float  # (x* - x*_ref) / h
    drift_interval: tuple[float, float] | None
    regret: float | None  # relative; inf when the reused rate diverges; None when it cannot be read
    regret_interval: tuple[float, float] | None


@dataclass
class Decision:
    verdict: str  # "transfers", "does not transfer", "inconclusive"
    reason: str  # the phrase after the verdict
    seeds_to_decide: int | None  # about how many seeds would decide an inconclusive panel (None: unknown)
    scales: list[ScaleStats] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    resamples: int = 0
    level: float = 0.95


def _outer_quantiles(values: np.ndarray, level: float) -> tuple[float, float] | None:
    values = values[~np.isnan(values)]
    if values.size == 0:
        return None
    tail = (1 - level) / 2
    lo = float(np.quantile(values, tail, method="lower"))
    hi = float(np.quantile(values, 1 - tail, method="higher"))
    return lo, hi


def decisive_rates(curve: Curve, x_ref: float) -> list[float]:
    """The rates whose seeds decide a curve's part of the verdict: its argmin, the argmin's neighbours, and
    the grid rates on either side of the reference's refined optimum ``x_ref`` (where the regret is read)."""
    i = curve.lrs.index(curve.best_lr) if curve.best_lr in curve.lrs else 0
    below = [lr for lr in curve.lrs if math.log2(lr) <= x_ref]
    above = [lr for lr in curve.lrs if math.log2(lr) >= x_ref]
    return sorted(set(curve.lrs[max(0, i - 1):i + 2]) | set(below[-1:]) | set(above[:1]))


def decisive_seeds(curve: Curve, x_ref: float) -> int:
    """Fewest seeds at the curve's decisive rates."""
    near = set(decisive_rates(curve, x_ref))
    counts = [n for lr, n in zip(curve.lrs, curve.n_seeds) if lr in near]
    return int(min(counts)) if counts else 0


def _scale_stats(k: int, c: Curve, f: FittedCurves, x_ref: np.ndarray, bfits: list[FittedCurves] | None, h: float,
                 level: float) -> ScaleStats:
    """Curve ``k``'s stats against the reference (curve 0, optimum ``x_ref``): drift, and but for the reference
    itself the regret; intervals from the resampled fits ``bfits`` (None: no seed spread)."""
    noisy = bfits is not None
    pooled = pooled_relative_sd(c.seed_matrix)
    st = ScaleStats(
        scale=c.scale, seeds=decisive_seeds(c, float(x_ref[0])),
        seed_sd=pooled[0] if pooled else None, optimum_log2=float(f.optimum[0]),
        optimum_interval=_outer_quantiles(bfits[k].optimum, level) if noisy else None,
        step_cost=(float(f.curvature[0] * h * h / f.minimum[0]) if np.isfinite(f.curvature[0])
                   and f.minimum[0] > 0 else None),
        drift_steps=float((f.optimum[0] - x_ref[0]) / h), drift_interval=None,
        regret=None, regret_interval=None)
    if k == 0:
        return st
    regret = _regret(f, x_ref)[0]
    st.regret = None if np.isnan(regret) else float(regret)
    if noisy:
        d = (bfits[k].optimum - bfits[0].optimum) / h
        st.drift_interval = _outer_quantiles(d, level)
        r = _regret(bfits[k], bfits[0].optimum)
        st.regret_interval = _outer_quantiles(r, level) if np.mean(np.isnan(r)) < (1 - level) / 2 else None
    return st


def decide_transfer(curves: Sequence[Curve], step_log2: float | None, max_drift_steps: float = 1.0,
                    max_regret: float = 0.02, resamples: int = 1000, level: float = 0.95,
                    seed: int = 0, label=lambda scale: f"scale {scale:g}") -> Decision:
    """The noise-aware decision over ``curves`` (ascending scales, the first is the reference); every
    curve must have a trustworthy optimum (edges are the caller's business). ``step_log2`` is the grid's
    log2 step (None on a grid that is not log-spaced: drift is then limited to ``max_drift_steps`` log2 units)."""
    h = step_log2 or 1.0
    fits = [fit(np.log2(c.lrs), np.asarray(c.loss)[None, :]) for c in curves]
    x_ref = fits[0].optimum
    rng = np.random.default_rng(seed)
    boots = [resample_means(c.seed_matrix, resamples, rng, level) if resamples > 0 else None for c in curves]
    noisy = all(b is not None for b in boots)
    bfits = [fit(np.log2(c.lrs), b) for c, b in zip(curves, boots)] if noisy else None

    out = Decision(INCONCLUSIVE, "", None, resamples=resamples if noisy else 0, level=level)
    ok_all, against, needed_for, needed_against = True, [], [], []
    for k, (c, f) in enumerate(zip(curves, fits)):
        st = _scale_stats(k, c, f, x_ref, bfits, h, level)
        out.scales.append(st)
        if k == 0:
            continue
        drift_state, n_drift = _judge(st.drift_steps, st.drift_interval, max_drift_steps, two_sided=True,
                                      seeds=st.seeds)
        regret_state, n_regret = _judge(st.regret, st.regret_interval, max_regret, two_sided=False, seeds=st.seeds)
        for state, n, what in ((drift_state, n_drift, "drift"), (regret_state, n_regret, "regret")):
            if state == "beyond":
                against.append((st, what))
            elif state != "within":
                ok_all = False
                (needed_against if state == "leans beyond" else needed_for).append(n)
    if not noisy:
        out.reason = (f"no seed spread to judge by (every point has one seed); point estimate: "
                      f"{_point_phrase(out.scales, max_drift_steps, max_regret, label)}")
        out.seeds_to_decide = 3
    elif against:
        # the costliest reuse speaks first (a divergence above all), else the largest drift
        st, what = max(against, key=lambda a: (a[1] == "regret", a[0].regret if a[1] == "regret"
                                               else abs(a[0].drift_steps)))
        out.verdict = DOES_NOT_TRANSFER
        out.reason = _against_phrase(st, what, max_drift_steps, max_regret, level, label)
    elif ok_all:
        out.verdict = TRANSFERS
        out.reason = _within_phrase(out.scales[1:], max_drift_steps, max_regret, level, label)
    else:
        out.seeds_to_decide = (min(needed_against) if needed_against and not needed_for
                               else max(needed_for + needed_against))
        out.reason = (f"{_point_phrase(out.scales, max_drift_steps, max_regret, label, level)}; "
                      + ("more than %d seeds at the decisive rates would be needed to decide" % MAX_SEEDS_QUOTED
                         if out.seeds_to_decide > MAX_SEEDS_QUOTED else
                         f"about {out.seeds_to_decide} seeds at the decisive rates would decide it"))
    out.notes = _power_notes(out.scales[1:], max_drift_steps, max_regret, label)
    return out


def _regret(f_scale: FittedCurves, x_ref: np.ndarray) -> np.ndarray:
    value = f_scale.at(x_ref)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = value / f_scale.minimum - 1
    return np.where(np.isinf(value), np.inf, np.where(f_scale.minimum > 0, np.maximum(rel, 0.0), np.nan))


def _judge(point, interval, limit: float, two_sided: bool, seeds: int) -> tuple[str, int]:
    """'within', 'beyond' (decided), or 'leans within' / 'leans beyond' with the seeds that would decide."""
    if point is None or interval is None:
        return ("leans beyond" if point is not None and abs(point) > limit else "leans within"), MAX_SEEDS_QUOTED + 1
    lo, hi = interval
    if two_sided:
        if -limit <= lo and hi <= limit:
            return "within", 0
        if lo > limit or hi < -limit:
            return "beyond", 0
        size, low, high = abs(point), (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    else:
        if hi <= limit:
            return "within", 0
        if lo > limit:
            return "beyond", 0
        size, low, high = point, lo, hi
    if math.isinf(size):
        return "leans beyond", MAX_SEEDS_QUOTED + 1
    gap = abs(size - limit)
    half = (high - size) if size <= limit else (size - low)
    need = MAX_SEEDS_QUOTED + 1 if gap == 0 or not math.isfinite(half) else math.ceil(max(seeds, 2) * (half / gap) ** 2)
    return ("leans within" if size <= limit else "leans beyond"), max(need, seeds + 1)


def _pct_1dp(v: float) -> str:
    return "diverges" if math.isinf(v) else f"{100 * v:.1f}%"


def bracketed(interval, fmt) -> str:
    """" [low, high]" after a number, each end through ``fmt``; nothing for no interval."""
    return "" if interval is None else f" [{fmt(interval[0])}, {fmt(interval[1])}]"


def _signed_steps(v: float) -> str:
    return f"{v:+.2f}"


def _point_phrase(scales: list[ScaleStats], max_drift_steps: float, max_regret: float, label,
                  level: float = 0.95) -> str:
    parts = []
    for st in scales[1:]:
        regret = ("regret n/a" if st.regret is None
                  else f"regret {_pct_1dp(st.regret)}{bracketed(st.regret_interval, _pct_1dp)}")
        parts.append(f"{label(st.scale)}: drift {_signed_steps(st.drift_steps)} steps"
                     f"{bracketed(st.drift_interval, _signed_steps)}, {regret}")
    limits = f" (limits {max_drift_steps:g} step, {100 * max_regret:g}%; {100 * level:g}% intervals)"
    return "; ".join(parts) + limits


def _within_phrase(scales: list[ScaleStats], max_drift_steps: float, max_regret: float, level: float, label) -> str:
    worst_drift = max(scales, key=lambda s: max(abs(v) for v in s.drift_interval))
    worst_regret = max(scales, key=lambda s: s.regret_interval[1])
    d_hi = max(abs(v) for v in worst_drift.drift_interval)
    return (f"drift within {d_hi:.2f} steps (limit {max_drift_steps:g}) and regret at most "
            f"{_pct_1dp(worst_regret.regret_interval[1])} (cap {100 * max_regret:g}%) at every scale, "
            f"{100 * level:g}% upper bounds; worst at {label(worst_regret.scale)}: regret "
            f"{_pct_1dp(worst_regret.regret)}{bracketed(worst_regret.regret_interval, _pct_1dp)}")


def _against_phrase(st: ScaleStats, what: str, max_drift_steps: float, max_regret: float, level: float,
                    label) -> str:
    if what == "regret":
        if st.regret is not None and math.isinf(st.regret):
            return f"reusing the reference's optimum diverges at {label(st.scale)}"
        return (f"reusing the reference's optimum costs {_pct_1dp(st.regret)}"
                f"{bracketed(st.regret_interval, _pct_1dp)} at "
                f"{label(st.scale)}, above the {100 * max_regret:g}% cap with {100 * level:g}% confidence")
    return (f"the optimum moves {_signed_steps(st.drift_steps)} grid steps"
            f"{bracketed(st.drift_interval, _signed_steps)} at "
            f"{label(st.scale)}, beyond {max_drift_steps:g} with {100 * level:g}% confidence")


def _power_notes(scales: list[ScaleStats], max_drift_steps: float, max_regret: float, label) -> list[str]:
    notes = []
    for st in scales:
        if st.step_cost is None:
            continue
        at_limit = st.step_cost * max_drift_steps ** 2
        if at_limit > max_regret:
            notes.append(f"{label(st.scale)}: one grid step costs {100 * st.step_cost:.2f}% here, so a drift "
                         f"of {max_drift_steps:g} step (allowed) costs more than the {100 * max_regret:g}% cap: "
                         "the two limits contradict each other and the regret cap decides")
        elif at_limit < max_regret / 4:
            notes.append(f"{label(st.scale)}: low power: one grid step costs only {100 * st.step_cost:.2f}% "
                         f"here, so the {100 * max_regret:g}% regret cap cannot bind within the allowed drift")
    return notes
