"""The race, read at the end of training: how many tokens (and how much time) each contender needs to END a run
at the loss its rival ends at.

Every budget (the sweep's ``train.steps`` axis: 1x, 2x, 4x and 8x the Chinchilla-optimal 20 tokens per parameter
at CPU scale) is a run of its own under a warmup-stable-decay schedule (:mod:`moga.train.schedule`), so each
budget's loss is an end-of-run loss, after its own cooldown; the stable phase is shared across budgets step for
step, so a short budget's run is the long one's branched at its decay start (``train.branch_from``,
:mod:`moga.train.branch`, gives it bit for bit), and the sweep runs it so (:mod:`moga.sweep.branch`): one stable
run per setting, and a cooldown from its checkpoint for each shorter budget, 9.4/15 of the cost of running
budgets 1x, 2x, 4x and 8x each from step 0 with a 20% decay. Comparing intermediate points of runs
with different schedules misleads (Wen et al. 2025, arXiv 2509.02046); end-of-run losses do not.

A contender is an arm: an optimizer and its preset ("moga (default preset)", "moga (paper preset)", "moga (muoneq
preset)", "muon (published)"; :func:`moga.sweep.spec.arm_label`). At each budget it is tuned over its lr grid and
the weight decay axis (lowest seed-mean final training loss), then ``min_seeds`` seeds run at that setting. For a
subject's budget ``B`` with end-of-run loss ``L``, the rival's end-of-run loss against log tokens, interpolated
linearly between its budgets, gives the tokens ``T`` at which the rival would end at ``L``: the token ratio is
``B/T`` (below 1: the subject needs fewer tokens). The time ratio is the token ratio times the ratio of the two
arms' step times, timed side by side once the runs are done (:mod:`moga.train.step_cost`: the arms take turns, the
median of per-round ratios; on one CPU thread, process CPU time), since every budget's steps are the same steps: the
cells' own run times, made at different times beside different jobs, compare loosely. A loss outside the rival's
range has no ratio (it is beyond the budgets run), which is said. The 95% intervals resample each arm's seeds at
each budget, and for time also the timing's rounds.

A subject's budget is **held** when both ratios' upper bounds are below 1, **failed** when either lower bound is
above 1, **inconclusive** otherwise (or out of range), and **undecided** when a best rate lies on its grid's edge."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from moga.experiments.reproduce.cost import best_rate_seeds, cell_cost
from moga.experiments.reproduce.kinds import ClaimKind, RunArgs, judged_sweep
from moga.experiments.reproduce.reproduction import CONFIGS, read_reproduction
from moga.experiments.reproduce.stats import best_lr
from moga.files import write_json
from moga.sweep.report.decision import bracketed
from moga.sweep.report.summary import json_safe
from moga.sweep.seeds import stored_include
from moga.sweep.spec import arm_label
from moga.sweep.store import SweepStore
from moga.sweep.worker import load_sweep
from moga.verdicts import FAILED, HELD, INCONCLUSIVE, UNDECIDED, worst_state

RESAMPLES = 1000
STEP_COST = "step-cost.json"
_TWO_PLACES = "{:.2f}".format  # the ratios' intervals


def _budget_key(sweep) -> str:
    return "train.steps" if "train.steps" in sweep.spec.axes else ""


def cell_arms(store, sweep) -> dict[str, str]:
    """{cell id: its arm's label}, building one config per distinct (optimizer, preset)."""
    labels = {}
    for c in store.cells():
        key = (c["params"].get("optim.name"), c["params"].get("optim.preset"))
        labels.setdefault(key, c["params"])
    labels = {key: arm_label(sweep.config(params).optim) for key, params in labels.items()}
    return {c["id"]: labels[(c["params"].get("optim.name"), c["params"].get("optim.preset"))] for c in store.cells()}


def best_settings(store, sweep, contenders, seeded: bool = True) -> dict[tuple, dict]:
    """(arm, budget) -> the setting of lowest seed-mean end-of-run loss: {lr, weight_decay, loss, edge (the lr on
    its grid's edge), cells: {seed: cell id}, losses: {seed: loss}, lower: the settings of fewer seeds that ended
    lower, (lr, weight decay, mean, seeds)}. ``seeded``: over the settings with the most seeds, through
    :func:`moga.experiments.reproduce.stats.best_lr` (a one-seed setting's luck is no tuning); the race's
    loop asks over all, adding seeds wherever the lowest mean is until that is a seeded setting too."""
    budget_key = _budget_key(sweep)
    base_seed = sweep.base.get("seed", 0)
    arms = cell_arms(store, sweep)
    runs: dict[tuple, dict[tuple, dict]] = {}
    for c in store.cells():
        p, arm = c["params"], arms[c["id"]]
        if arm not in contenders or c["status"] not in ("finished", "diverged"):
            continue
        result = c["result"] or {}
        loss = result.get("final_train_loss")
        loss = loss if c["status"] == "finished" and loss is not None and math.isfinite(loss) else math.inf
        budget = p.get(budget_key, sweep.base["train"]["steps"])
        wd = p.get("optim.weight_decay", sweep.base.get("optim", {}).get("weight_decay", 0.0))
        seed = p.get("seed", base_seed)
        setting = runs.setdefault((arm, budget), {}).setdefault((p["optim.lr"], wd), {"cells": {}, "losses": {}})
        setting["cells"][seed], setting["losses"][seed] = c["id"], loss
    best = {}
    for key, settings in runs.items():
        mean = {s: float(np.mean(list(v["losses"].values()))) for s, v in settings.items()}
        most = max(len(v["losses"]) for v in settings.values()) if seeded else 1
        # None where every seeded setting diverged: the race still names one, so that its line says so
        lr, wd = (best_lr({s: v["losses"] for s, v in settings.items()}, most)
                  or min(s for s, v in settings.items() if len(v["losses"]) >= most))
        lrs = sorted(r for r, w in settings if w == wd)
        lower = [(r, w, mean[(r, w)], len(v["losses"])) for (r, w), v in sorted(settings.items())
                 if mean[(r, w)] < mean[(lr, wd)]]
        best[key] = {"lr": lr, "weight_decay": wd, "loss": mean[(lr, wd)], "grid": lrs, "lower": lower,
                     "edge": lr in (lrs[0], lrs[-1]), **settings[(lr, wd)]}  # one rate is no tuning
    return best


def race_seeds(store, sweep, contenders, min_seeds: int) -> list[dict]:
    """Seeds to add at each contender's best setting at each budget."""
    out = []
    params = {c["id"]: c["params"] for c in store.cells()}
    for b in best_settings(store, sweep, contenders, seeded=False).values():
        if not math.isfinite(b["loss"]):
            continue
        base = {k: v for k, v in params[next(iter(b["cells"].values()))].items() if k != "seed"}
        for seed in range(min_seeds):
            if seed not in b["cells"]:
                out.append({**base, "seed": seed})
    return out


def tokens_to_loss(budgets, losses, target: float) -> float:
    """The budget at which end-of-run loss ``losses`` (per budget) reaches ``target``, linear in log2(budget)
    between budgets (the first crossing); inf when every budget ends above ``target`` (more than the largest is
    needed), 0 when every one ends below it (less than the smallest would do): no extrapolation."""
    x, y = np.log2(np.asarray(budgets, dtype=float)), np.asarray(losses, dtype=float)
    for k in range(len(x) - 1):
        lo, hi = sorted((y[k], y[k + 1]))
        if lo <= target <= hi:
            t = 0.0 if y[k] == y[k + 1] else (y[k] - target) / (y[k] - y[k + 1])
            return float(2 ** (x[k] + t * (x[k + 1] - x[k])))
    if np.all(y > target) or not np.all(np.isfinite(y)) and np.nanmin(y) > target:
        return math.inf
    return 0.0 if np.all(y < target) else float(budgets[0])


def race_ratios(subject: dict, rival: dict, step_ratios: list[float], level: float = 0.95, seed: int = 0) -> dict:
    """Per subject budget: the token and time ratios at equal end-of-run loss, with intervals.
    ``subject``/``rival``: {budget: [end-of-run loss per seed]}; ``step_ratios``: the subject's step time over
    the rival's, one per timing round (the time ratio is the token ratio times their median)."""
    budgets = sorted(rival)

    def tokens_ratio(s_budget, s_losses, rival_losses):
        at = tokens_to_loss(budgets, [float(np.mean(v)) for v in rival_losses], float(np.mean(s_losses)))
        # beyond the budgets run: 0 (the rival needs more than its largest), or inf
        return math.inf if at == 0 else 0.0 if math.isinf(at) else s_budget / at

    rng = np.random.default_rng(seed)
    step = float(np.median(step_ratios))
    out = {}
    for b, s in sorted(subject.items()):
        r_losses = [rival[x] for x in budgets]
        tokens = tokens_ratio(b, s, r_losses)
        draws = []
        if min(len(s), *(len(v) for v in r_losses)) >= 2:
            for _ in range(RESAMPLES):
                t = tokens_ratio(b, rng.choice(s, len(s)), [rng.choice(v, len(v)) for v in r_losses])
                draws.append((t, t * float(np.median(rng.choice(step_ratios, len(step_ratios))))))
        tail = (1 - level) / 2

        def interval(k):  # a resample beyond the budgets run gives an open end (0 or inf)
            values = [d[k] for d in draws]
            return tuple(float(np.quantile(values, q, method=m)) for q, m in ((tail, "lower"), (1 - tail, "higher"))
                         ) if values else None

        out[b] = {"loss": float(np.mean(s)), "tokens_ratio": tokens, "time_ratio": tokens * step,
                  "step_ratio": step, "tokens_interval": interval(0), "time_interval": interval(1), "seeds": len(s)}
    return out


def budget_state(r: dict) -> str:
    ivs = (r["tokens_interval"], r["time_interval"])
    if any(iv is None for iv in ivs):
        return INCONCLUSIVE
    if all(iv[1] < 1 for iv in ivs):
        return HELD
    if any(iv[0] > 1 for iv in ivs):
        return FAILED
    return INCONCLUSIVE


def token_trend(ratios: dict) -> str:
    """How the token ratio moves from the smallest budget to the largest with a ratio in range (a loss the rival
    does not reach, or beats at every budget, has none), said only where the intervals part."""
    inside = [b for b in sorted(ratios) if 0 < ratios[b]["tokens_ratio"] < math.inf]
    if len(inside) < 2:
        return "trend across budgets: fewer than two budgets with a ratio in range"
    a, b = ratios[inside[0]]["tokens_interval"], ratios[inside[-1]]["tokens_interval"]
    if a is None or b is None:
        return "trend across budgets: no intervals"
    if b[1] < a[0]:
        return "the token ratio falls with budget"
    if b[0] > a[1]:
        return "the token ratio rises with budget"
    return "no trend across budgets: the token intervals overlap"


def judge_race(contenders: list[str], sweep, out) -> dict:
    """Each subject arm against the rival (the last of ``contenders``) at every budget; the claim's outcome is the
    first subject's (the claim's), the others' lines are reported beside it. The step times are ``out``'s
    :data:`STEP_COST` (:func:`time_steps`)."""
    params_per_model = cell_cost(sweep.config(sweep.cells[0]))["params"]  # one model for every arm and budget
    store = SweepStore(out)
    timing = json.loads((Path(out) / STEP_COST).read_text())
    subjects, rival = contenders[:-1], contenders[-1]
    best = best_settings(store, sweep, contenders)
    budgets = sorted({b for _, b in best})
    tokens_per_step = sweep.base["train"]["batch_size"] * sweep.base["data"].get("block_size", 1)

    def head(budget):
        tokens = budget * tokens_per_step
        per_param = f", {tokens / params_per_model:.0f} tokens per parameter" if params_per_model else ""
        return f"budget {budget} steps ({tokens / 1e6:.2f}M tokens{per_param})"

    lines, results, states = [], {}, []
    data = {arm: {b: list(v["losses"].values()) for (a, b), v in best.items() if a == arm and math.isfinite(v["loss"])}
            for arm in contenders}
    lines += [f"{arm} at {head(budget)}: {_end_of_run(best.get((arm, budget)))}"  # every arm at every budget
              for arm in contenders for budget in budgets]
    for subject in subjects:
        if len(data[rival]) < 2 or not data[subject]:
            states.append(UNDECIDED)
            lines.append(f"[undecided] {subject} vs {rival}: too few finished budgets to interpolate")
            continue
        seconds = timing["seconds"]
        ratios = race_ratios(data[subject], data[rival], [s / r for s, r in zip(seconds[subject], seconds[rival])])
        mine = {}
        for budget, r in ratios.items():
            # the subject's tuning at this budget, and the rival's at every budget the interpolation reads
            edges = ([subject] if best[(subject, budget)]["edge"] else []) + \
                ([rival] if any(best.get((rival, x), {}).get("edge") for x in budgets) else [])
            state = UNDECIDED if edges else budget_state(r)
            mine[budget] = {**r, "state": state}
            lines.append(f"[{state}] {subject} at {head(budget)} ends at {r['loss']:.4f}; to end there it needs "
                         f"{_key_ratios(r, budget, budgets, rival)}"
                         + (f"; a best lr on the grid's edge ({', '.join(edges)}): extend it" if edges else ""))
        results[subject] = mine
        if subject == subjects[0]:
            states += [m["state"] for m in mine.values()]
    outcome = worst_state(states)
    claim = results.get(subjects[0], {})
    key = "; ".join(f"{b} steps: {subjects[0]} {_key_ratios(r, b, budgets, rival)}" for b, r in claim.items())
    if len(claim) >= 2:
        key += f" ({token_trend(claim)})"
    table = {arm: {str(b): {k: best[(arm, b)][k] for k in ("lr", "weight_decay", "loss", "edge", "losses")}
                   for b in budgets if (arm, b) in best} for arm in contenders}
    steps = {arm: float(np.median(v)) for arm, v in timing["seconds"].items()}
    lines.append(f"step times, side by side ({timing['rounds']} rounds of {timing['steps']} steps, median, "
                 f"{timing['clock']} clock, {timing['threads']} thread(s), {timing['device']}): "
                 + ", ".join(f"{arm} {1e3 * v:.2f} ms" for arm, v in steps.items()))
    return {"outcome": outcome, "key": key or "no ratio", "details": lines,
            "race": {"end_of_run": table, "ratios": {s: {str(b): r for b, r in v.items()} for s, v in results.items()},
                     "step_cost": timing}}


def _end_of_run(b: dict | None) -> str:
    """An arm's tuned end-of-run loss at one budget, and any setting of fewer seeds that ended lower: seeds there
    would say whether it is better or lucky."""
    if b is None:
        return "no finished run"
    lower = "; ".join(f"lr {lr:g}, weight decay {wd:g}: {loss:.4f} over {n} seed{'s' * (n > 1)}"
                      for lr, wd, loss, n in b["lower"])
    seeds = len(b["losses"])
    if not math.isfinite(b["loss"]):  # every setting of the most seeds diverged on one at least
        return (f"diverged at every setting of {seeds} seed{'s' * (seeds > 1)} (the first: lr {b['lr']:g}, "
                f"weight decay {b['weight_decay']:g})" + (f"; fewer seeds finished ({lower})" if lower else ""))
    return (f"end-of-run loss {b['loss']:.4f} (lr {b['lr']:g}, weight decay {b['weight_decay']:g}, "
            f"{seeds} seeds{'; best lr on the grid edge' if b['edge'] else ''})"
            + (f"; fewer seeds ended lower ({lower}): seeds there would decide" if lower else ""))


def _ratio_text(v: float, budget: int, budgets: list) -> str:
    """A token ratio; 0 and inf are the open ends (the rival ends above the subject's loss at every budget, or
    below it at every one), said as the bound they give: under ``budget / largest`` or over ``budget / smallest``."""
    if v == 0:
        return f"under {budget / max(budgets):.2f}x the rival's tokens"
    if math.isinf(v):
        return f"over {budget / min(budgets):.2f}x the rival's tokens"
    return f"{v:.2f}x"


def _key_ratios(r: dict, budget: int, budgets: list, rival: str) -> str:
    """One budget's ratios for the outcome's key line; a loss outside the rival's range has no interval (its time
    ratio is open exactly when its token ratio is: both come from the same crossing)."""
    tokens = _ratio_text(r["tokens_ratio"], budget, budgets)
    if r["tokens_ratio"] == 0 or math.isinf(r["tokens_ratio"]):
        return f"{tokens}: {rival}'s loss at every budget is {'above' if r['tokens_ratio'] == 0 else 'below'} its own"
    return (f"{tokens}{bracketed(r['tokens_interval'], _TWO_PLACES)} {rival}'s tokens, "
            f"{r['time_ratio']:.2f}x{bracketed(r['time_interval'], _TWO_PLACES)} its time")


def contender_arms(rep) -> list[str]:
    """The arms the reproduction races, subjects first and the rival last (``contenders`` in its YAML)."""
    return list(rep.raw.get("contenders", ["moga (paper preset)", "muon (published)"]))


def _race_runs(rep, out: Path, args: RunArgs):
    """The grid, then ``min_seeds`` seeds at each contender's best setting per budget, as they settle."""
    make = lambda include: args.sweep(rep, include)  # noqa: E731
    include = stored_include(out, make)
    sweep = make(include)
    counts = args.run(sweep, out)  # failed cells (a missing data set, say) run again: a re-run completes it
    while args.max_seeds > 1 and (extra := race_seeds(SweepStore(out), sweep, contender_arms(rep), args.min_seeds)):
        include += extra
        sweep = make(include)
        counts = args.run(sweep, out)
    time_steps(contender_arms(rep), timing_settings(rep, args.scale), sweep, out)
    return sweep, counts


def timing_settings(rep, scale: str) -> dict:
    """``timing`` in the YAML, the scale's over the reproduction's: {rounds, steps} of the side-by-side timing."""
    return {**rep.raw.get("timing", {}), **rep.scale(scale).get("timing", {})}


def time_steps(arms: list[str], settings: dict, sweep, out: Path) -> dict:
    """Every arm's training step timed side by side (:func:`moga.train.step_cost.step_seconds`, the sweep's
    threads per cell, ``settings``: rounds and steps), once the runs are done, so nothing else of the race runs
    beside it; kept in ``out``'s :data:`STEP_COST` and read again while its arms and settings are the same."""
    from moga.train.step_cost import step_seconds  # builds trainers: not for --list, which loads this module

    path = Path(out) / STEP_COST
    if path.is_file():
        kept = json.loads(path.read_text())
        if list(kept["seconds"]) == arms and all(kept.get(k) == v for k, v in settings.items()):
            return kept
    store = SweepStore(out)
    labels, configs = cell_arms(store, sweep), {}
    for c in store.cells():  # one cell per arm: a step costs the same at any rate and budget
        configs.setdefault(labels[c["id"]], sweep.config(c["params"]))
    missing = [arm for arm in arms if arm not in configs]
    if missing:
        raise ValueError(f"no cell of {', '.join(missing)} in {out} to time")
    timing = step_seconds({arm: configs[arm] for arm in arms}, threads=sweep.spec.threads, **settings)
    write_json(path, timing)
    return timing


def _judge_race(rep, sweep, out: Path, max_regret: float) -> dict:
    result = judge_race(contender_arms(rep), sweep, out)
    (out / "report").mkdir(parents=True, exist_ok=True)
    write_json(out / "report" / "race.json", json_safe(result["race"]))
    return {**result, "report": str(out / "report" / "race.json")}


RACE = ClaimKind("race", judged_sweep(_race_runs, _judge_race), seeds_added=best_rate_seeds)


def store_race(out: Path, rival: str, timing: dict | None = None) -> dict:
    """A research sweep's store (``configs/research/race_64.yaml``: a ``train.steps`` axis under warmup-stable-decay)
    judged as the race: every other arm in it against ``rival`` (an arm's label, as the race's lines print it),
    its step times timed side by side first (``timing``: {rounds, steps}, by default the race reproduction's), as
    :data:`RACE` judges its own store."""
    timing = timing or read_reproduction(CONFIGS / "race.yaml").raw["timing"]
    store = SweepStore(out)
    sweep = load_sweep(store)
    arms = sorted(set(cell_arms(store, sweep).values()))
    if rival not in arms:
        raise SystemExit(f"{out}: no arm {rival!r}; its arms: {', '.join(arms)}")
    contenders = [a for a in arms if a != rival] + [rival]
    time_steps(contenders, timing, sweep, Path(out))
    return judge_race(contenders, sweep, out)


USAGE = ('usage: python -m moga.experiments.reproduce.race judge RUN_DIR --rival ARM (an arm\'s label, as the '
         'lines print it: "muon (published)")')

if __name__ == "__main__":
    import sys

    if len(sys.argv) != 5 or sys.argv[1] != "judge" or sys.argv[3] != "--rival":
        raise SystemExit(USAGE)
    result = store_race(Path(sys.argv[2]), sys.argv[4])
    print(f"{result['outcome']}: {result['key']}", *result["details"], sep="\n")
