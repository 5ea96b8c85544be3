"""Seed statistics of tuned final losses, shared by the judges that compare optimizers (quality, the ablation,
the gap): each lr's losses by seed, the lr of lowest seed mean, and a seed-bootstrap interval of a relative change."""

from __future__ import annotations

import math
import random

LEVEL = 0.95
RESAMPLES = 2000


def seed_losses(rows: list[dict], where: dict, lr_key: str, seed_key: str, metric: str) -> dict[float, dict]:
    """{lr: {seed: loss}} of the rows matching every key of ``where`` (a diverged cell's loss is inf)."""
    out: dict[float, dict] = {}
    for r in rows:
        if all(_same(r.get(k), v) for k, v in where.items()):
            out.setdefault(float(r[lr_key]), {})[r.get(seed_key, 0)] = float(r.get(metric, math.inf))
    return out


def best_lr(by_lr: dict[float, dict], seeds: int | None = None) -> float | None:
    """The lr of lowest seed mean, over the lrs that have every seed (``seeds``: how many; default the most any
    lr has); None when none has a finite mean. Any ordered key serves as the lr (the race's (lr, weight decay))."""
    if not by_lr:
        return None
    seeds = seeds or max(len(s) for s in by_lr.values())
    means = {lr: _mean(s.values()) for lr, s in by_lr.items() if len(s) >= seeds}
    finite = {lr: m for lr, m in means.items() if math.isfinite(m)}
    return min(finite, key=lambda lr: (finite[lr], lr)) if finite else None


def relative_interval(subject: list[float], baseline: list[float], *, level: float = LEVEL,
                      resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high) of ``mean(subject) / mean(baseline) - 1``; the interval resamples the seeds of each
    side independently (a percentile bootstrap). A diverged seed (inf) makes the resamples that draw it inf."""
    point = _relative_change(subject, baseline)
    rng = random.Random(seed)
    draws = sorted(_relative_change(rng.choices(subject, k=len(subject)), rng.choices(baseline, k=len(baseline)))
                   for _ in range(resamples))
    tail = (1 - level) / 2
    low = draws[max(0, math.floor(tail * resamples))]
    high = draws[min(resamples - 1, math.ceil((1 - tail) * resamples) - 1)]
    return point, low, high


def _relative_change(a, b) -> float:
    ma, mb = _mean(a), _mean(b)
    if math.isinf(ma):
        return math.inf
    return ma / mb - 1 if mb > 0 else math.nan


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def _pct(x: float | None) -> str:
    """A signed relative change, "+1.2%"; "n/a" for NaN or None (how a stored outcome keeps NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return "inf" if math.isinf(x) else f"{100 * x:+.1f}%"


def _finite(value):
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
