"""The rate for the target and the regret it will cost there, from the proxies' trend.

The model (stated in every report): the refined optimum x* = log2(lr*) of each proxy (the parabola vertex of
:mod:`moga.sweep.report.decision`) moves linearly in s = log2(parameters), x*(s) = a + b s, and near its optimum
the target's loss is the parabola f*(1 + c (x - x*)^2), with c the largest proxy's relative curvature (its
parabola's a / f*, per log2 unit squared). The predicted regret of a rate x at the target is then
c (x - x*_T)^2 with x*_T = a + b s_T. The rate: when the slope's 95% interval holds 0 (no trend the seeds can
tell from noise), the proxies' mean optimum; otherwise the trend's extrapolation x*_T.

Intervals come from the decision's own bootstrap (:func:`moga.sweep.report.decision.resample_means`: seeds drawn
as whole curves, Student-widened): every resample refits every proxy's curve, the line and the curvature, and
gives a regret of the chosen rate; the interval is their 2.5% and 97.5% quantiles. With three proxies the middle
one's distance from the line through the outer two is resampled too: an interval that excludes 0 says the
optimum bends, and the straight line may not be extrapolated. What the model cannot see: a bend beyond the
largest proxy, and a curvature that changes with size (the target's own sweep, ``moga reproduce tune``, tests it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from moga.sweep.report.curves import Curve
from moga.sweep.report.decision import fit, resample_means

MAX_EXTRAPOLATION = 2.0  # target beyond the largest proxy, in units of the proxies' own span of log2 size


@dataclass
class Prediction:
    log2_lr: float
    lr: float
    rule: str  # "mean" (no trend) or "trend"
    slope: float  # log2 lr per doubling of parameters
    slope_interval: tuple[float, float] | None
    target_optimum_log2: float
    target_optimum_interval: tuple[float, float] | None
    curvature: float | None  # relative, per log2 unit squared
    regret: float | None  # point (the fitted line and curvature)
    regret_interval: tuple[float, float] | None
    bend: float | None  # three proxies: the middle optimum's distance from the outer two's line (log2)
    bend_interval: tuple[float, float] | None
    extrapolation: float  # (s_T - s_largest) / (s_largest - s_smallest)
    resamples: int

    def to_dict(self) -> dict:
        return asdict(self)


def _quantiles(values: np.ndarray, level: float) -> tuple[float, float] | None:
    values = values[np.isfinite(values)]
    if values.size < 20:
        return None
    tail = (1 - level) / 2
    return float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))


def _line(s: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares slope and intercept of every row of ``x`` (rows x proxies) against ``s``."""
    sc = s - s.mean()
    slope = (x - x.mean(axis=1, keepdims=True)) @ sc / (sc @ sc)
    return slope, x.mean(axis=1) - slope * s.mean()


def predict(curves: list[Curve], log2_params: list[float], target_log2_params: float, resamples: int = 1000,
            level: float = 0.95, seed: int = 0) -> Prediction:
    """``curves``: the proxies' loss-vs-lr curves (ascending size, each optimum inside its grid)."""
    s = np.asarray(log2_params, dtype=float)
    fits = [fit(np.log2(c.lrs), np.asarray(c.loss)[None, :]) for c in curves]
    x = np.array([[f.optimum[0] for f in fits]])
    slope, intercept = _line(s, x)
    rng = np.random.default_rng(seed)
    boots = [resample_means(c.seed_matrix, resamples, rng, level) for c in curves]
    noisy = all(b is not None for b in boots)
    if noisy:
        bfits = [fit(np.log2(c.lrs), b) for c, b in zip(curves, boots)]
        bx = np.stack([f.optimum for f in bfits], axis=1)
        bslope, bintercept = _line(s, bx)
        last = bfits[-1]
        bcurv = last.curvature / last.minimum
    slope_iv = _quantiles(bslope, level) if noisy else None
    trend = slope_iv is not None and (slope_iv[0] > 0 or slope_iv[1] < 0)
    x_target = float(intercept[0] + slope[0] * target_log2_params)
    chosen = x_target if trend else float(x.mean())
    last = fits[-1]
    curv = float(last.curvature[0] / last.minimum[0]) if np.isfinite(last.curvature[0]) else None
    regret = None if curv is None else curv * (chosen - x_target) ** 2
    regret_iv = target_iv = None
    if noisy:
        bt = bintercept + bslope * target_log2_params
        target_iv = _quantiles(bt, level)
        regret_iv = _quantiles(bcurv * (chosen - bt) ** 2, level)
    bend = bend_iv = None
    if len(curves) == 3:
        def middle(v):
            return v[:, 1] - (v[:, 0] + (v[:, 2] - v[:, 0]) * (s[1] - s[0]) / (s[2] - s[0]))
        bend = float(middle(x)[0])
        bend_iv = _quantiles(middle(bx), level) if noisy else None
    span = s[-1] - s[0]
    return Prediction(
        log2_lr=chosen, lr=float(2.0**chosen), rule="trend" if trend else "mean", slope=float(slope[0]),
        slope_interval=slope_iv, target_optimum_log2=x_target, target_optimum_interval=target_iv, curvature=curv,
        regret=regret, regret_interval=regret_iv, bend=bend, bend_interval=bend_iv,
        extrapolation=float((target_log2_params - s[-1]) / span) if span > 0 else math.inf,
        resamples=resamples if noisy else 0)
