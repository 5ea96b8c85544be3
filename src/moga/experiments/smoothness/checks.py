"""The convergence paper's three claims judged over seeds, from per-seed numbers alone.

Nothing here trains: the experiment (:mod:`.convergence`) measures the numbers, these functions decide, and a
stored outcome that keeps the numbers is rechecked by calling them again
(:func:`moga.experiments.reproduce.run.rejudge`). Each check is held, failed or inconclusive (or not measured):

- **adaptive vs constant** (:func:`paired_gain`): best constant - adaptive final loss per paired seed, the 95%
  Student t interval of its mean. Held above 0, failed below, inconclusive when it straddles 0.
- **deeper converges slower** (:func:`depth_order`): the Spearman rank correlation of final training loss with
  depth over ``L >= 3``, of the seed-mean losses, with a 95% seed-bootstrap interval (every resample of the
  seeds with replacement, weighted exactly, for up to 8 seeds). Held when the lower bound is at least 0.8 (at
  most one adjacent pair of four out of order), failed when the upper bound is below 0.8, inconclusive
  otherwise. Fewer than 3 seeds always is inconclusive: a bootstrap over 2 seeds has no tail.
- **||W_t|| still growing at L = 2** (:func:`growth_check`): per seed, the growth of ``||W||`` over the long
  run's second half; the 95% Student t interval of its mean. Held when the lower bound exceeds 1% and ``||W||``
  still rose over the last quarter on every seed, failed when the upper bound is below 1%, inconclusive
  otherwise (always with one seed). A finite run cannot show "without bound", only "still rising at the end".
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from moga.experiments.smoothness.report import spearman
from moga.verdicts import FAILED, HELD, INCONCLUSIVE, NOT_MEASURED

GROWTH_THRESHOLD = 0.01  # ||W|| must grow by more than 1% over the long run's second half
RHO_THRESHOLD = 0.8  # over 4 depths: at most one adjacent pair out of order
MIN_BOOTSTRAP_SEEDS = 3
EXACT_BOOTSTRAP_SEEDS = 8  # up to here every resample is enumerated (6435 multisets at 8 seeds)


def stored_loss(x) -> float:
    """A stored loss: None (JSON's inf) or non-finite is a diverged run."""
    return math.inf if x is None or not math.isfinite(x) else float(x)


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student t interval of the mean (n - 1 degrees of freedom; unbounded for one value).
    With a non-finite value, the range of the values: decided only when every seed agrees."""
    n, point = len(values), sum(values) / len(values)
    if not all(math.isfinite(v) for v in values):
        return point, min(values), max(values)
    if n < 2:
        return point, -math.inf, math.inf
    from scipy import stats  # here: scipy.stats costs every command that imports this module half a second

    half = stats.t.ppf(0.5 + level / 2, n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)
    return point, point - half, point + half


def paired_gain(adaptive: list[float], constants: dict[float, list[float]], level: float = 0.95) -> dict:
    """(best constant - adaptive) final loss over paired seeds, the best constant the rate of lowest seed mean:
    the mean per-seed difference with its Student t interval (n - 1 degrees of freedom; none with one seed).
    When a seed diverged (an infinite difference), the interval is the seeds' range: decided only when every
    seed agrees. Verdict: held above 0, failed below, inconclusive otherwise."""
    adaptive = [stored_loss(x) for x in adaptive]
    constants = {lr: [stored_loss(x) for x in v] for lr, v in constants.items()}
    means = {lr: sum(v) / len(v) for lr, v in constants.items()}
    best = min(means, key=lambda lr: (means[lr], lr))
    diffs = [c - a for c, a in zip(constants[best], adaptive, strict=True)]  # inf - inf is nan: no agreement
    point, low, high = t_interval(diffs, level)
    verdict = HELD if low > 0 else FAILED if high < 0 else INCONCLUSIVE
    return {"best_constant_lr": best, "difference": point, "low": low, "high": high, "seeds": len(diffs),
            "level": level, "verdict": verdict}


def gain_text(g: dict) -> str:
    """The paired comparison in words: the mean difference, its interval and the number of seeds."""
    seeds = f"{g['seeds']} paired seed{'s' if g['seeds'] != 1 else ''}"
    if g["seeds"] < 2 and math.isfinite(g["difference"]):
        return f"best constant - adaptive {g['difference']:+.4g} ({seeds}: no interval)"
    return (f"best constant - adaptive {g['difference']:+.4g} ({100 * g['level']:.0f}% interval "
            f"[{g['low']:+.4g}, {g['high']:+.4g}], Student t over {seeds})")


def _resamples(n: int):
    """(seed indices, probability) of every bootstrap resample of ``n`` seeds, as multisets with their
    multinomial weights; beyond ``EXACT_BOOTSTRAP_SEEDS``, 4000 draws of a fixed generator."""
    if n <= EXACT_BOOTSTRAP_SEEDS:
        for pick in itertools.combinations_with_replacement(range(n), n):
            counts = np.bincount(pick, minlength=n)
            yield pick, math.factorial(n) / math.prod(math.factorial(c) for c in counts) / n**n
    else:
        rng = np.random.default_rng(0)
        for _ in range(4000):
            yield tuple(rng.integers(0, n, n)), 1 / 4000


def _weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(np.asarray(weights)[order])
    return float(np.asarray(values)[order][min(np.searchsorted(cum, q * cum[-1] - 1e-12), len(values) - 1)])


def depth_order(depths: list[int], losses: list[list[float]], level: float = 0.95,
                threshold: float = RHO_THRESHOLD) -> dict:
    """Deeper converges slower, over seeds: ``losses[s][i]`` is seed s's final loss at ``depths[i]``. The
    Spearman rho of the seed-mean losses over ``L >= 3``, its seed-bootstrap interval and each seed's own rho."""
    deep = [i for i, L in enumerate(depths) if L >= 3]
    xs = [depths[i] for i in deep]
    rows = [[stored_loss(row[i]) for i in deep] for row in losses]
    n = len(rows)

    def rho_of(pick) -> float:
        means = [sum(rows[s][j] for s in pick) / len(pick) for j in range(len(xs))]
        r = spearman(xs, means)
        return -1.0 if r is None else r  # too few finite depths: no evidence of the order

    per_seed = [spearman(xs, row) for row in rows]
    point = spearman(xs, [sum(r[j] for r in rows) / n for j in range(len(xs))]) if n else None
    out = {"depths": xs, "spearman": point, "per_seed": per_seed, "seeds": n, "threshold": threshold,
           "level": level, "low": None, "high": None,
           "agreeing": sum(r is not None and r >= threshold for r in per_seed)}
    if point is None:
        return {**out, "verdict": NOT_MEASURED}
    picks = list(_resamples(n))
    values = [rho_of(p) for p, _ in picks]
    weights = [w for _, w in picks]
    out["low"] = _weighted_quantile(values, weights, (1 - level) / 2)
    out["high"] = _weighted_quantile(values, weights, (1 + level) / 2)
    decided = n >= MIN_BOOTSTRAP_SEEDS
    out["verdict"] = (HELD if decided and out["low"] >= threshold else FAILED if decided and out["high"] < threshold
                      else INCONCLUSIVE)
    return out


def depth_text(d: dict) -> str:
    if d["spearman"] is None:
        return "depth vs loss: too few depths"
    seeds = ", ".join("-" if r is None else f"{r:.2f}" for r in d["per_seed"])
    text = (f"depth vs seed-mean loss Spearman {d['spearman']:.2f} ({100 * d['level']:.0f}% seed-bootstrap interval "
            f"[{d['low']:.2f}, {d['high']:.2f}]; per seed {seeds}: {d['agreeing']} of {d['seeds']} >= "
            f"{d['threshold']:g})")
    if d["verdict"] == INCONCLUSIVE:
        text += (f"; needs {MIN_BOOTSTRAP_SEEDS}+ seeds" if d["seeds"] < MIN_BOOTSTRAP_SEEDS else
                 f"; the interval straddles {d['threshold']:g}: more seeds would decide it")
    return text


def growth_check(growth: list[float | None], rose: list[bool | None], level: float = 0.95,
                 threshold: float = GROWTH_THRESHOLD) -> dict:
    """||W_t|| still growing, over seeds: each seed's relative growth over the second half and whether it rose
    over the last quarter."""
    out = {"growth": growth, "rose_last_quarter": rose, "seeds": len(growth), "threshold": threshold,
           "level": level}
    if not growth or any(g is None or r is None for g, r in zip(growth, rose, strict=True)):
        return {**out, "mean": None, "low": None, "high": None, "verdict": NOT_MEASURED}
    mean, low, high = t_interval([float(g) for g in growth], level)
    verdict = HELD if low > threshold and all(rose) else FAILED if high < threshold else INCONCLUSIVE
    return {**out, "mean": mean, "low": low, "high": high, "verdict": verdict}


def growth_text(g: dict) -> str:
    if g["verdict"] == NOT_MEASURED:
        return "too few ||W|| records"
    seeds = ", ".join(f"{100 * x:+.1f}%" for x in g["growth"])
    interval = ("no interval" if g["seeds"] < 2 else
                f"{100 * g['level']:.0f}% interval [{100 * g['low']:+.1f}%, {100 * g['high']:+.1f}%], Student t")
    text = (f"{100 * g['mean']:+.1f}% over the second half ({interval} over {g['seeds']} seed"
            f"{'s' if g['seeds'] != 1 else ''}; per seed {seeds}; still rising over the last quarter on "
            f"{sum(bool(r) for r in g['rose_last_quarter'])} of {g['seeds']})")
    if g["verdict"] == INCONCLUSIVE:
        text += ("; needs 2+ seeds" if g["seeds"] < 2 else "; ||W|| fell over the last quarter on a seed"
                 if g["low"] > g["threshold"] else f"; the interval straddles {100 * g['threshold']:g}%: more seeds "
                 "would decide it")
    return text


def judge_checks(numbers: dict) -> list[dict]:
    """Every check of the claim (claim, state, text) from the per-seed numbers an outcome stores:
    ``adaptive_vs_constant`` (per data set: adaptive and each constant rate's losses per seed),
    ``deeper_slower`` (per lr kind: depths and each seed's losses) and ``w_growth`` (per lr kind: each seed's
    growth over the second half and whether it rose over the last quarter)."""
    checks = []
    for e in numbers.get("adaptive_vs_constant", []):
        g = paired_gain(e["adaptive"], {c["lr"]: c["losses"] for c in e["constant"]})
        adaptive = float(np.mean([stored_loss(x) for x in e["adaptive"]]))
        best = float(np.mean([stored_loss(x) for c in e["constant"] if c["lr"] == g["best_constant_lr"]
                              for x in c["losses"]]))
        checks.append({"claim": f"adaptive beats every constant rate on {e['data']}", "state": g["verdict"],
                       "text": f"adaptive {adaptive:.4g} vs best constant {best:.4g} ({e['data']}; {gain_text(g)})"})
    for kind, d in numbers.get("deeper_slower", {}).items():
        r = depth_order(d["depths"], d["losses"])
        checks.append({"claim": f"deeper converges slower ({kind} lr)", "state": r["verdict"], "text": depth_text(r)})
    for kind, d in numbers.get("w_growth", {}).items():
        g = growth_check(d["growth"], d["rose_last_quarter"])
        checks.append({"claim": f"||W_t|| still growing at L = 2 ({kind} lr)", "state": g["verdict"],
                       "text": growth_text(g)})
    return checks
