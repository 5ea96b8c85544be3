"""``moga reproduce tune`` (kind ``tune``): does the rate ``moga tune`` picks on small proxies serve targets no proxy
equals?

For each target of the claim (a model section at the target's size, on the claim's shared training setup):
``moga tune`` runs on the given proxies (``OUT/<target>/tune``), then the target itself trains at the suggested
rate and one grid step either side (``OUT/<target>/check``, a sweep on the store: seeds as an axis, ``min_seeds``
first, ``max_seeds`` when the interval straddles the goal; the grid grows one step past an optimum on its edge).
The number: the regret of the suggested rate against the target's own best, f(suggested) / f* - 1 read off the
target's fitted curve (:mod:`moga.sweep.report.decision`), with the decision's seed bootstrap for its 95% interval.
**held** when every target's upper end is within ``goal`` (2%), **failed** when one's lower end is beyond it,
**undecided** when a target's optimum stays on its grid's edge, **inconclusive** otherwise. Every check cell's
loss is stored, so :func:`target_fields` recomputes the verdict from ``outcome.json`` alone.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np

from moga.experiments.reproduce.cost import tune_estimate
from moga.experiments.reproduce.kinds import ClaimKind, RunArgs
from moga.experiments.reproduce.reproduction import ReproduceError, Reproduction, merge, tune_settings
from moga.experiments.tune import TuneError, tune
from moga.sweep.executor import run_sweep
from moga.sweep.report.curves import build_curve, make_grid
from moga.sweep.report.decision import fit, resample_means
from moga.sweep.report.schema import parse_records
from moga.sweep.results import records
from moga.sweep.spec import Sweep
from moga.sweep.store import SweepStore
from moga.train.config import read_config_file
from moga.verdicts import UNDECIDED, within_goal, worst_state

LEVEL, RESAMPLES, MAX_GROWTH = 0.95, 1000, 3


def run_claim(rep: Reproduction, out: Path, args: RunArgs) -> dict:
    s = tune_settings(rep, args.scale)
    workers, executor, ray_address, progress = args.workers, args.executor, args.ray_address, args.progress
    min_seeds, max_seeds = args.min_seeds, args.max_seeds
    log = (lambda line: print(line, flush=True)) if progress else (lambda line: None)
    targets = {}
    for name, target in s["targets"].items():
        base = merge(copy.deepcopy(s["base"]), {"model": target["model"]})
        log(f"== target {name}: moga tune on proxies {target.get('proxies')}")
        try:
            res = tune(base, out=out / name / "tune", budget_flops=s.get("budget_flops"), lrs=s.get("lrs"),
                       proxies=[tuple(p) for p in target["proxies"]] if target.get("proxies") else None,
                       regime=s.get("regime", "auto"), workers=workers, executor=executor, ray_address=ray_address,
                       min_seeds=min_seeds, max_seeds=max_seeds, progress=progress, log=log)
        except TuneError as e:
            raise ReproduceError(f"target {name}: {e}") from None
        entry = {"tune": {k: res.get(k) for k in ("rate", "justified", "why", "next", "flops", "prediction",
                                                  "decision")},
                 "proxies": [{k: p[k] for k in ("label", "params", "steps", "optimum_lr", "seeds", "curve")}
                             for p in res["proxies"]],
                 "target": res["target"], "grid_step_log2": _step(res["lr_grid"])}
        if res.get("rate") is not None:
            log(f"== target {name}: training the target at {res['rate']:.4g} and one grid step either side")
            entry["cells"] = check_target(out / name / "check", out / name / "tune" / "target.yaml", res["rate"],
                                          entry["grid_step_log2"], s.get("goal", 0.02), workers, executor,
                                          ray_address, progress, min_seeds, max_seeds)
        targets[name] = entry
    return {**target_fields(targets, s.get("goal", 0.02)), "targets": targets, "kind": "tune",
            "goal": s.get("goal", 0.02), "data": s["base"].get("data", {}).get("name"),
            "report": str(out / "outcome.json")}


def _step(grid: list[float]) -> float:
    return float(np.median(np.diff(np.log2(sorted(grid)))))


def check_target(out: Path, config: Path, rate: float, h: float, goal: float, workers: int, executor: str,
                 ray_address: str | None, progress: bool, min_seeds: int, max_seeds: int) -> list[dict]:
    base = read_config_file(config)
    base["optim"].pop("lr", None)
    lrs = [rate * 2 ** (-h), rate, rate * 2**h]
    seeds = max(min_seeds, 2)
    for _ in range(MAX_GROWTH + 2):
        spec = {"name": "tune-check", "base": base, "axes": {"optim.lr": lrs, "seed": list(range(seeds))},
                "scale_key": "seed"}
        run_sweep(Sweep.from_dict(spec), out, workers=workers, executor=executor, ray_address=ray_address,
                  progress=progress, retry_failed=True)
        cells = [{"lr": r["optim.lr"], "seed": r["seed"], "status": r["status"], "train_loss": r["train_loss"]}
                 for r in records(SweepStore(out))]
        v = regret_of(cells, rate)
        if v["edge"] and len(lrs) < 3 + MAX_GROWTH:
            lrs = sorted(lrs + [min(lrs) * 2 ** (-h) if v["edge"] == "lower" else max(lrs) * 2**h])
        elif v["interval"] is not None and v["interval"][0] <= goal < v["interval"][1] and seeds < max_seeds:
            seeds = max_seeds
        else:
            return cells
    return cells


def regret_of(cells: list[dict], rate: float) -> dict:
    """The regret of ``rate`` on the target's curve (its cells), with a 95% seed-bootstrap interval."""
    rows = parse_records([{**c, "optimizer": "target", "scale": 1} for c in cells], None)
    curve = build_curve(1.0, rows, "train_loss", make_grid([r.lr for r in rows]))
    out = {"best_lr": curve.best_lr, "edge": curve.edge, "point": None, "interval": None,
           "seeds": min(curve.n_seeds)}
    if curve.status != "ok":
        return out
    x = np.log2(curve.lrs)
    f = fit(x, np.asarray(curve.loss)[None, :])
    where = math.log2(rate)
    out["point"] = float(max(0.0, f.at(np.array(where))[0] / f.minimum[0] - 1))
    boots = resample_means(curve.seed_matrix, RESAMPLES, np.random.default_rng(0), LEVEL)
    if boots is not None:
        bf = fit(x, boots)
        r = np.maximum(bf.at(np.full(RESAMPLES, where)) / bf.minimum - 1, 0.0)
        r = np.where(np.isnan(r), np.inf, r)
        tail = (1 - LEVEL) / 2
        out["interval"] = (float(np.quantile(r, tail)), float(np.quantile(r, 1 - tail)))
    return out


def target_fields(targets: dict, goal: float) -> dict:
    """outcome, key and details, recomputed from each target's stored cells."""
    states, parts, details = [], [], []
    for name, t in targets.items():
        rate = t["tune"]["rate"]
        saved = t["tune"]["flops"]["saved"]
        if rate is None or not t.get("cells"):
            states.append(UNDECIDED)
            details.append(f"[undecided] {name}: moga tune gave no rate ({'; '.join(t['tune']['why'])})")
            continue
        v = regret_of(t["cells"], rate)
        t["regret"] = v
        label = t["target"]["label"]
        if v["point"] is None:
            state, text = UNDECIDED, f"the target's own optimum stays on its grid's {v['edge']} edge"
        else:
            lo, hi = v["interval"] or (0.0, math.inf)
            state = within_goal(lo, hi, goal)
            text = (f"regret {100 * v['point']:.2f}% [{100 * lo:.2f}%, {100 * hi:.2f}%] at lr {rate:.4g} "
                    f"(the target's best {v['best_lr']:.4g}, {v['seeds']}+ seeds), tuning FLOPs saved {100 * saved:.0f}%")
        states.append(state)
        parts.append(f"{name} {label}: {text}")
        details.append(f"[{state}] {name} {label} from proxies "
                       f"{', '.join(p['label'] for p in t['proxies'])}: {text}")
    return {"outcome": worst_state(states), "key": "; ".join(parts), "details": details}


def _rejudge(outcome: dict, expect: list[dict]) -> dict:
    return {**outcome, **target_fields(outcome["targets"], outcome["goal"])}


TUNE = ClaimKind("tune", run_claim, _rejudge, stores=lambda outcome: outcome.get("kind") == "tune",
                 estimate=tune_estimate)
