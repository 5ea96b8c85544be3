"""The race: tokens and wall-clock time each contender needs to reach the loss both reach, per token budget.

Every budget (the sweep's ``train.steps`` axis, about 1x and 8x the Chinchilla-optimal 20 tokens per
parameter at CPU scale) tunes each contender's lr on its own grid (lowest seed-mean final training loss),
then runs ``min_seeds`` seeds at that rate. On the seed-mean training curves (a trailing mean of 5 logs, so
one lucky batch does not count) the common target is the lowest loss every contender reaches; the subject's
tokens and time to it, divided by the rival's, are the ratios. Their 95% intervals come from resampling
each contender's seeds with replacement and recomputing curves, target and ratios.

A budget is **held** when both ratios' upper bounds are below 1 (the subject is faster in tokens and in
time), **failed** when either lower bound is above 1, **inconclusive** otherwise, and **undecided** when a
best rate lies on its grid's edge. Time is wall-clock: runs that shared a loaded machine time it loosely.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moga.sweep.store import SweepStore
from moga.train import read_metrics

RESAMPLES = 1000


def _budget_key(sweep) -> str:
    return "train.steps" if "train.steps" in sweep.spec.axes else ""


def best_rates(store, sweep, contenders) -> dict[tuple, dict]:
    """(contender, budget) -> {lr, loss (seed mean), edge, cells: {seed: cell id}} of the best rate."""
    budget_key = _budget_key(sweep)
    base_seed = sweep.base.get("seed", 0)
    means: dict[tuple, dict[float, list]] = {}
    cells: dict[tuple, dict[float, dict]] = {}
    for c in store.cells():
        p = c["params"]
        name, budget = p.get("optim.name"), p.get(budget_key, sweep.base["train"]["steps"])
        loss = (c["result"] or {}).get("final_train_loss")
        if name not in contenders or c["status"] not in ("finished", "diverged"):
            continue
        loss = loss if c["status"] == "finished" and loss is not None and math.isfinite(loss) else math.inf
        key = (name, budget)
        means.setdefault(key, {}).setdefault(p["optim.lr"], []).append(loss)
        cells.setdefault(key, {}).setdefault(p["optim.lr"], {})[p.get("seed", base_seed)] = c["id"]
    best = {}
    for key, by_lr in means.items():
        lrs = sorted(by_lr)
        mean = {lr: float(np.mean(v)) for lr, v in by_lr.items()}
        lr = min(lrs, key=lambda r: (mean[r], r))
        best[key] = {"lr": lr, "loss": mean[lr], "edge": lr in (lrs[0], lrs[-1]),  # one rate is no tuning
                     "cells": cells[key][lr], "grid": lrs}
    return best


def race_seeds(store, sweep, contenders, min_seeds: int) -> list[dict]:
    """Seeds to add at each contender's best rate at each budget."""
    out = []
    params = {c["id"]: c["params"] for c in store.cells()}
    for b in best_rates(store, sweep, contenders).values():
        if not math.isfinite(b["loss"]):
            continue
        base = {k: v for k, v in params[next(iter(b["cells"].values()))].items() if k != "seed"}
        for seed in range(min_seeds):
            if seed not in b["cells"]:
                out.append({**base, "seed": seed})
    return out


def smooth(values, window: int = 5) -> np.ndarray:
    """Trailing mean over ``window`` logs (fewer at the start)."""
    v = np.asarray(values, dtype=float)
    c = np.cumsum(np.insert(v, 0, 0.0))
    i = np.arange(v.size)
    k = np.minimum(i + 1, window)
    return (c[i + 1] - c[i + 1 - k]) / k


def _curves(store, cell_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, seconds per seed x logs, smoothed loss per seed x logs) over the logs every seed has."""
    runs = [read_metrics(store.cell_dir(cid) / "metrics.jsonl", "train") for cid in cell_ids]
    n = min(len(r) for r in runs)
    steps = np.array([r["step"] for r in runs[0][:n]])
    times = np.array([[r["time"] for r in run[:n]] for run in runs])
    loss = np.array([smooth([r["loss"] for r in run[:n]]) for run in runs])
    return steps, times, loss


def _reach(steps, times, loss_mean, target) -> tuple[float, float]:
    hit = np.nonzero(loss_mean <= target + 1e-12)[0]
    if hit.size == 0:
        return math.inf, math.inf
    return float(steps[hit[0]]), float(times[hit[0]])


def race_budget(subject: dict, rival: dict, level: float = 0.95, seed: int = 0) -> dict:
    """Ratios (subject / rival) of tokens and time to the common loss, with seed intervals.
    ``subject``/``rival`` hold ``steps``, ``times`` and ``loss`` (seeds x logs)."""
    def ratios(s_idx, r_idx):
        ms, mr = subject["loss"][s_idx].mean(0), rival["loss"][r_idx].mean(0)
        target = max(ms.min(), mr.min())
        s = _reach(subject["steps"], subject["times"][s_idx].mean(0), ms, target)
        r = _reach(rival["steps"], rival["times"][r_idx].mean(0), mr, target)
        return target, s[0] / r[0], s[1] / r[1], s, r

    all_s, all_r = np.arange(len(subject["loss"])), np.arange(len(rival["loss"]))
    target, tokens, time_, reach_s, reach_r = ratios(all_s, all_r)
    rng = np.random.default_rng(seed)
    draws = [ratios(rng.integers(0, all_s.size, all_s.size), rng.integers(0, all_r.size, all_r.size))[1:3]
             for _ in range(RESAMPLES)] if min(all_s.size, all_r.size) >= 2 else []
    tail = (1 - level) / 2
    iv = lambda k: (tuple(float(np.quantile([d[k] for d in draws], q, method=m))  # noqa: E731
                          for q, m in ((tail, "lower"), (1 - tail, "higher"))) if draws else None)
    return {"target": float(target), "tokens_ratio": tokens, "time_ratio": time_, "tokens_interval": iv(0),
            "time_interval": iv(1), "subject_reach": {"step": reach_s[0], "seconds": reach_s[1]},
            "rival_reach": {"step": reach_r[0], "seconds": reach_r[1]},
            "seeds": [int(all_s.size), int(all_r.size)]}


def budget_state(r: dict) -> str:
    ivs = (r["tokens_interval"], r["time_interval"])
    if any(iv is None for iv in ivs):
        return "inconclusive"
    if all(iv[1] < 1 for iv in ivs):
        return "held"
    if any(iv[0] > 1 for iv in ivs):
        return "failed"
    return "inconclusive"


def token_trend(first: dict, last: dict) -> str:
    """How the token ratio moves from the smallest budget to the largest, said only where the intervals part."""
    a, b = first["tokens_interval"], last["tokens_interval"]
    if a is None or b is None:
        return "trend across budgets: no intervals"
    if b[1] < a[0]:
        return "the token ratio falls with budget"
    if b[0] > a[1]:
        return "the token ratio rises with budget"
    return "no trend across budgets: the token intervals overlap"


def judge_race(rep, sweep, out: Path, params_per_model: int | None) -> dict:
    store = SweepStore(out)
    contenders = rep.raw.get("contenders", ["moga", "muon"])
    subject, rival = contenders[0], contenders[1]
    best = best_rates(store, sweep, contenders)
    budgets = sorted({b for _, b in best})
    tokens_per_step = sweep.base["train"]["batch_size"] * sweep.base["data"].get("block_size", 1)
    lines, states, results = [], [], {}
    for budget in budgets:
        tokens = budget * tokens_per_step
        per_param = f", {tokens / params_per_model:.0f} tokens per parameter" if params_per_model else ""
        head = f"budget {budget} steps ({tokens / 1e6:.2f}M tokens{per_param})"
        picks = {n: best.get((n, budget)) for n in contenders}
        missing = [n for n, b in picks.items() if b is None or not math.isfinite(b["loss"])]
        if missing:
            states.append("undecided")
            lines.append(f"[undecided] {head}: no finished run of {', '.join(missing)}")
            continue
        edges = [n for n, b in picks.items() if b["edge"]]
        data = {}
        for n, b in picks.items():
            steps, times, loss = _curves(store, list(b["cells"].values()))
            data[n] = {"steps": steps, "times": times, "loss": loss}
        r = race_budget(data[subject], data[rival])
        state = "undecided" if edges else budget_state(r)
        states.append(state)
        results[budget] = {**r, "best": {n: {"lr": b["lr"], "loss": b["loss"], "seeds": len(b["cells"])}
                                         for n, b in picks.items()}, "state": state}
        fmt = lambda v: "never" if math.isinf(v) else f"{v:.2f}x"  # noqa: E731
        ivs = lambda iv: "" if iv is None else f" [{iv[0]:.2f}, {iv[1]:.2f}]"  # noqa: E731
        lines.append(
            f"[{state}] {head}: {subject} needs {fmt(r['tokens_ratio'])}{ivs(r['tokens_interval'])} {rival}'s tokens "
            f"and {fmt(r['time_ratio'])}{ivs(r['time_interval'])} its time to reach loss {r['target']:.3f} "
            f"(best lr {subject} {picks[subject]['lr']:g}, {rival} {picks[rival]['lr']:g}; seeds {r['seeds'][0]}, "
            f"{r['seeds'][1]})" + (f"; best lr on the grid's edge for {', '.join(edges)}: extend it" if edges else ""))
    outcome = next((s for s in ("failed", "undecided", "inconclusive", "held") if s in states), "undecided")
    iv = lambda v: "" if v is None else f" [{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
    key = "; ".join(f"{b} steps: {subject} {r['tokens_ratio']:.2f}x{iv(r['tokens_interval'])} {rival}'s tokens, "
                    f"{r['time_ratio']:.2f}x{iv(r['time_interval'])} its time" for b, r in results.items())
    if len(results) >= 2:
        first, last = results[budgets[0]], results[budgets[-1]]
        key += f" ({token_trend(first, last)})"
    return {"outcome": outcome, "key": key, "details": lines, "race": results}
