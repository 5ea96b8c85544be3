"""Is what MOGA reaches competitive? Final losses of tuned optimizers compared with seed-bootstrap intervals.

``moga reproduce quality`` (kind ``quality``): per model, budget and width, MOGA at the lr tuned at the
smallest width (its transferred rate) against the best baseline tuned at that width (each optimizer's lr of
lowest seed-mean loss, then the optimizer of lowest mean). The number is MOGA's seed-mean loss over the
baseline's, minus 1, with a 95% interval from resampling seeds within each of the two cells (the choices of
lr and baseline stay those of the full sample; choosing the lowest of several noisy baselines biases the
baseline low, against MOGA). A cell **held** when the interval's upper end is within the goal (2%),
**failed** when its lower end is beyond it, and is **inconclusive** otherwise, or when the side it favours may
be under-tuned (a win over a baseline whose best lr is on its grid's edge, a loss at a transferred lr on the
edge). The claim held when every cell held, failed when any failed, and is undecided otherwise.

The ablation (``configs/research/ablation_*.yaml``) uses the same comparison: each value of the ablated axes at
its own tuned lr against MOGA's default (the first value of each axis), per width:
``python -m moga.experiments.reproduce.quality ablation RUN_DIR [RUN_DIR ...]`` (a follow-up sweep that adds a
choice is judged with the first), or against the best baseline tuned at each width, the gap:
``... ablation RUN_DIR --baseline BASELINE_RUN_DIR`` (``configs/research/gap_*.yaml``). ``... transfer RUN_DIR`` asks of a sweep over
one optimizer whether the value of its ``lr_key`` tuned at the smallest width (e.g. a role's lr multiplier,
``configs/research/multiplier_transfer.yaml``) serves every width. ``... versus RUN_DIR --baseline QUALITY_RUN_DIR``
judges a sweep of the subject under another setting against a quality run's tuned baselines.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

from moga.experiments.reproduce.kinds import ClaimKind, grid_once, judged_sweep
from moga.files import write_json, write_text
from moga.sweep.results import records
from moga.sweep.spec import optimizer_labels
from moga.sweep.compat import changed_keys
from moga.sweep.store import SweepStore
from moga.verdicts import FAILED, HELD, INCONCLUSIVE, UNDECIDED, within_goal

GOAL = 0.02
LEVEL = 0.95
RESAMPLES = 2000


# --- statistics ------------------------------------------------------------------------------------------

def seed_losses(rows: list[dict], where: dict, lr_key: str, seed_key: str, metric: str) -> dict[float, dict]:
    """{lr: {seed: loss}} of the rows matching every key of ``where`` (a diverged cell's loss is inf)."""
    out: dict[float, dict] = {}
    for r in rows:
        if all(_same(r.get(k), v) for k, v in where.items()):
            out.setdefault(float(r[lr_key]), {})[r.get(seed_key, 0)] = float(r.get(metric, math.inf))
    return out


def best_lr(by_lr: dict[float, dict], seeds: int | None = None) -> float | None:
    """The lr of lowest seed mean, over the lrs that have every seed (``seeds``: how many; default the most any
    lr has); None when none has a finite mean."""
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


def verdict(low: float, high: float, goal: float = GOAL) -> str:
    return within_goal(low, high, goal)


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


# --- the quality claim -----------------------------------------------------------------------------------

def compare(rows: list[dict], *, subject: str, baselines: list[str], scale_key: str, budget_key: str | None = None,
            panel_keys: tuple[str, ...] = (), lr_key: str = "optim.lr", seed_key: str = "seed",
            metric: str = "train_loss", goal: float = GOAL, resamples: int = RESAMPLES) -> list[dict]:
    """One entry per panel (e.g. model), budget and width: the subject at the lr tuned at the smallest width
    against the best baseline tuned at this width, with its interval and outcome."""
    out = []
    panels = sorted({tuple(r.get(k) for k in panel_keys) for r in rows}, key=str)
    budgets = sorted({r.get(budget_key) for r in rows}, key=_order) if budget_key else [None]
    for panel in panels:
        where_panel = dict(zip(panel_keys, panel))
        for budget in budgets:
            where = {**where_panel, **({budget_key: budget} if budget_key else {})}
            scales = sorted({r[scale_key] for r in rows if all(_same(r.get(k), v) for k, v in where.items())})
            if not scales:
                continue
            grid = seed_losses(rows, {**where, "optim.name": subject, scale_key: scales[0]}, lr_key, seed_key, metric)
            tuned = best_lr(grid)
            for scale in scales:
                cell = {**where_panel, **({"budget": budget} if budget_key else {}), "scale": scale,
                        "subject": subject, "subject_lr": tuned, "tuned_at": scales[0],
                        "subject_lr_on_edge": tuned is not None and tuned in (min(grid), max(grid))}
                mine = seed_losses(rows, {**where, "optim.name": subject, scale_key: scale}, lr_key, seed_key, metric)
                rivals = {}
                for name in baselines:
                    theirs = seed_losses(rows, {**where, "optim.name": name, scale_key: scale}, lr_key, seed_key, metric)
                    lr = best_lr(theirs)
                    if lr is not None:
                        rivals[name] = (lr, theirs[lr], lr in (min(theirs), max(theirs)))
                if tuned is None or tuned not in mine or not rivals:
                    out.append({**cell, "outcome": INCONCLUSIVE, "note": "missing cells: no tuned subject or baseline"})
                    continue
                name, (lr, losses, edge) = min(rivals.items(), key=lambda kv: _mean(kv[1][1].values()))
                a, b = list(mine[tuned].values()), list(losses.values())
                point, low, high = relative_interval(a, b, resamples=resamples)
                diverged = sum(math.isinf(x) for x in a)
                out.append({**cell, "subject_losses": a, "subject_loss": _mean(a), "baseline": name, "baseline_lr": lr,
                            "baseline_lr_on_edge": edge, "baseline_losses": b, "baseline_loss": _mean(b),
                            "others": {n: {"lr": v[0], "loss": _mean(v[1].values())} for n, v in rivals.items()},
                            "seeds": len(a), "baseline_seeds": len(b), "relative": point, "low": low, "high": high,
                            # a seed that diverges at the transferred rate: the rate does not serve this width
                            "outcome": FAILED if diverged else _tuned_verdict(verdict(low, high, goal), cell, edge),
                            **({"note": f"diverged on {diverged} of {len(a)} seeds"} if diverged else {})})
    return out


def _tuned_verdict(outcome: str, cell: dict, baseline_edge: bool) -> str:
    """A best lr on its grid's edge may not be the optimum: a win over a baseline that may be under-tuned, or a
    loss of a subject that may be, decides nothing."""
    if (outcome == HELD and baseline_edge) or (outcome == FAILED and cell["subject_lr_on_edge"]):
        return INCONCLUSIVE
    return outcome


def claim_outcome(cells: list[dict]) -> str:
    states = [c["outcome"] for c in cells]
    if not states:
        return UNDECIDED
    return FAILED if FAILED in states else HELD if all(s == HELD for s in states) else UNDECIDED


def judge_quality(rep, sweep, out: Path, max_regret: float) -> dict:
    """The ``quality`` kind for :func:`moga.experiments.reproduce.run.reproduce` (``max_regret`` is unused: the
    goal is the config's ``quality.goal``)."""
    q = rep.raw["quality"]
    goal = float(q.get("goal", GOAL))
    rows = records(SweepStore(out))
    cells = compare(rows, subject=q["subject"], baselines=list(q["baselines"]), scale_key=sweep.spec.scale_key,
                    budget_key=q.get("budget_key"), panel_keys=tuple(q.get("panel_keys", ())), goal=goal)
    labels = optimizer_labels(sweep)  # which Muon and which MOGA ran, named in every line
    for c in cells:
        c.update({f"{k}_arm": labels.get(c[k], c[k]) for k in ("subject", "baseline") if k in c})
    report = Path(out) / "report"
    report.mkdir(parents=True, exist_ok=True)
    write_json(report / "quality.json", _finite(cells))
    lines = [describe_cell(c, q.get("panel_keys", ())) for c in cells]
    write_text(report / "quality.md",
               f"# {rep.name}: {rep.claim}\n\n" + quality_table(cells, q.get("panel_keys", ())) + "\n")
    judged = [c for c in cells if "relative" in c]
    worst = max(judged, key=lambda c: c["relative"], default=None)
    key = "" if worst is None else (f"worst: {_arm(worst, 'subject')} {_pct(worst['relative'])} "
                                    f"[{_pct(worst['low'])}, {_pct(worst['high'])}] vs {_arm(worst, 'baseline')} "
                                    f"at {_where(worst, q.get('panel_keys', ()))} (goal {_pct(goal)})")
    return {"outcome": claim_outcome(cells), "key": key, "details": lines, "cells": _finite(cells),
            "report": str(report / "quality.md")}


QUALITY = ClaimKind("quality", judged_sweep(grid_once, judge_quality))  # its grid has its seeds


def describe_cell(c: dict, panel_keys=()) -> str:
    where = _where(c, panel_keys)
    if "relative" not in c:
        return f"[{c['outcome']}] {where}: {c.get('note', '')}"
    edge = [n for n, flag in (("subject", c["subject_lr_on_edge"]), ("baseline", c["baseline_lr_on_edge"])) if flag]
    return (f"[{c['outcome']}] {where}: {_arm(c, 'subject')} (lr {c['subject_lr']:g} from width {c['tuned_at']}) "
            f"{c['subject_loss']:.4f} vs {_arm(c, 'baseline')} (lr {c['baseline_lr']:g}) {c['baseline_loss']:.4f}: "
            f"{_pct(c['relative'])} [{_pct(c['low'])}, {_pct(c['high'])}], {c['seeds']} seeds"
            + (f"; {c['note']}" if c.get("note") else "")
            + (f"; best lr on the grid's edge: {', '.join(edge)}" if edge else ""))


def _arm(c: dict, side: str) -> str:
    """What ran on ``side`` ("subject" or "baseline"), e.g. "muon (published)"; the name in cells judged before."""
    return c.get(f"{side}_arm", c[side])


def quality_table(cells: list[dict], panel_keys=()) -> str:
    lines = ["| where | subject (lr) | best baseline (lr) | relative [95%] | outcome |", "|---|---|---|---|---|"]
    for c in cells:
        if "relative" not in c:
            lines.append(f"| {_where(c, panel_keys)} | | | | {c['outcome']} |")
            continue
        lines.append(f"| {_where(c, panel_keys)} | {c['subject_loss']:.4f} ({c['subject_lr']:g}) | {_arm(c, 'baseline')} "
                     f"{c['baseline_loss']:.4f} ({c['baseline_lr']:g}) | {_pct(c['relative'])} [{_pct(c['low'])}, "
                     f"{_pct(c['high'])}] | {c['outcome']} |")
    return "\n".join(lines)


def _where(c: dict, panel_keys=()) -> str:
    parts = [f"{c[k]}" for k in panel_keys if k in c]
    if "budget" in c:
        parts.append(f"budget {c['budget']}")
    parts.append(f"width {c['scale']}")
    return ", ".join(str(p).rsplit(":", 1)[-1] for p in parts)


def _pct(x: float | None) -> str:
    """A signed relative change, "+1.2%"; "n/a" for NaN or None (how a stored outcome keeps NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return "inf" if math.isinf(x) else f"{100 * x:+.1f}%"


def _order(v):
    return (0, float(v)) if isinstance(v, (int, float)) else (1, str(v))


def _finite(value):
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


# --- the ablation ----------------------------------------------------------------------------------------

def ablation(rows: list[dict], axes: dict[str, list], *, scale_key: str, lr_key: str = "optim.lr",
             seed_key: str = "seed", metric: str = "train_loss", resamples: int = RESAMPLES,
             baseline: list[dict] | None = None, against: dict | None = None) -> list[dict]:
    """Each combination of the ablated axes (every axis but scale, lr and seed) at its own tuned lr against the
    default (each axis' first value), per width: relative loss with its interval; ``moves`` when the interval
    excludes 0 (None when a side has one seed). With ``baseline`` (the rows of another sweep, e.g. AdamW's), each combination is compared with
    the baseline tuned at that width instead (the optimizer of lowest seed mean at its own best lr): the gap.
    With ``against`` ({axis: value}, e.g. ``{"optim.name": "muon"}``), with the variant of these rows that
    matches it, tuned at that width. A dependent axis with one value per value of its ``by`` axis follows that
    axis and is no choice of its own."""
    choice_keys = [k for k in axes if k not in (scale_key, lr_key, seed_key) and not _follows(axes[k])]
    follower_keys = [k for k in axes if _follows(axes[k]) and axes[k]["by"] in choice_keys]  # fixed per variant
    plain = [k for k in choice_keys if _first(axes[k]) is _NO_VALUE]
    if plain:
        raise ValueError(f"ablated axes must be lists (or dependent axes of lists) whose first value is the "
                         f"default: {', '.join(plain)}")
    default = {k: _first(axes[k]) for k in choice_keys}
    seen = {}  # each variant with what it runs besides, unique by JSON text: a mapping value is no dict key
    for r in rows:
        values = tuple(r.get(k) for k in choice_keys)
        key = json.dumps(values, sort_keys=True)
        if key not in seen:
            seen[key] = values, {k: r.get(k) for k in follower_keys}
    variants = sorted(seen.values(), key=lambda v: (dict(zip(choice_keys, v[0])) != default, str(v[0])))  # default 1st
    out = []
    for scale in sorted({r[scale_key] for r in rows}):
        if baseline is None:
            reference = {"name": "default"} if against is None else {
                "name": ", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in against.items())}
            ref_grid = seed_losses(rows, {**(default if against is None else against), scale_key: scale}, lr_key,
                                   seed_key, metric)
            ref_lr = best_lr(ref_grid)
            if against is not None and ref_lr is not None:
                reference.update(lr=ref_lr, lr_on_edge=ref_lr in (min(ref_grid), max(ref_grid)))
        else:
            reference, ref_grid, ref_lr = _tuned_baseline(baseline, scale_key, scale, lr_key, seed_key, metric)
        for values, follows in variants:
            variant = dict(zip(choice_keys, values))
            grid = seed_losses(rows, {**variant, scale_key: scale}, lr_key, seed_key, metric)
            lr = best_lr(grid)
            entry = {"scale": scale, "variant": variant, "default": variant == default, "lr": lr,
                     "follows": follows,  # what it runs besides (a preset, a weight decay): its label
                     "lr_on_edge": lr is not None and lr in (min(grid), max(grid)), "reference": reference}
            if lr is None or ref_lr is None:
                out.append({**entry, "note": "no finite tuned loss"})
                continue
            a, b = list(grid[lr].values()), list(ref_grid[ref_lr].values())
            point, low, high = relative_interval(a, b, resamples=resamples)
            out.append({**entry, "loss": _mean(a), "losses": a, "reference_loss": _mean(b), "relative": point,
                        # one seed on a side: the interval resamples only the other side's, it says nothing
                        "low": low, "high": high, "moves": not (low <= 0 <= high) if min(len(a), len(b)) > 1 else None})
    return out


_NO_VALUE = object()


def _first(axis):
    """An axis' default: a list's first value, or a dependent axis' first list's first value."""
    if isinstance(axis, list) and axis:
        return axis[0]
    lists = list(axis.get("values", {}).values()) if isinstance(axis, dict) and "by" in axis else []
    return lists[0][0] if lists and isinstance(lists[0], list) and lists[0] else _NO_VALUE


def _follows(axis) -> bool:
    """A dependent axis ({by, values}) with one value for each value of its ``by`` axis."""
    return isinstance(axis, dict) and "by" in axis and all(
        isinstance(v, list) and len(v) == 1 for v in axis.get("values", {}).values())


def _tuned_baseline(rows: list[dict], scale_key: str, scale, lr_key: str, seed_key: str, metric: str):
    """({name, lr, lr_on_edge}, its {lr: {seed: loss}}, its lr) of the optimizer of lowest seed mean at its own
    best lr at this width; the lr is None when no optimizer has a finite loss there."""
    best = None
    for name in sorted({r.get("optim.name") for r in rows if _same(r.get(scale_key), scale)}, key=str):
        grid = seed_losses(rows, {"optim.name": name, scale_key: scale}, lr_key, seed_key, metric)
        lr = best_lr(grid)
        if lr is not None and (best is None or _mean(grid[lr].values()) < _mean(best[1][best[2]].values())):
            best = ({"name": name, "lr": lr, "lr_on_edge": lr in (min(grid), max(grid))}, grid, lr)
    return best or ({"name": "baseline"}, {}, None)


def ablation_table(entries: list[dict]) -> str:
    ref = entries[0]["reference"] if entries else {"name": "default"}
    against = "default" if ref["name"] == "default" else "tuned " + ref["name"]
    lines = [f"| width | variant | tuned lr | loss (seed mean) | seeds | vs {against} [95%] | moves |",
             "|---|---|---|---|---|---|---|"]
    default = next((e["variant"] for e in entries if e["default"]), {})
    for e in entries:
        shown = e["variant"].items() if e["default"] else [(k, v) for k, v in e["variant"].items()
                                                            if k not in default or default[k] != v]
        shown = [*shown, *((k, v) for k, v in e.get("follows", {}).items() if v is not None)]  # e.g. its preset
        name = (", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in shown)  # optim.p -> p; a variant: what it changes
                + (" (default)" if e["default"] and against == "default" else ""))  # else no more than the first
        if "relative" not in e:
            lines.append(f"| {e['scale']} | {name} | | | | {e.get('note', '')} | |")
            continue
        lr = f"{e['lr']:g}" + (" (edge)" if e["lr_on_edge"] else "")
        lines.append(f"| {e['scale']} | {name} | {lr} | {e['loss']:.4f} | {len(e['losses'])} | {_pct(e['relative'])} "
                     f"[{_pct(e['low'])}, "
                     f"{_pct(e['high'])}] | {'one seed' if e['moves'] is None else 'yes' if e['moves'] else 'no'} |")
    tuned = {e["scale"]: e for e in entries if e["reference"].get("lr") is not None and "relative" in e}
    notes = [f"{e['reference']['name']} tuned at width {scale}: lr {e['reference']['lr']:g}"
             + (" (edge)" if e["reference"]["lr_on_edge"] else "") + f", loss {e['reference_loss']:.4f}"
             for scale, e in tuned.items()]
    return "\n".join(lines + ([""] + notes if notes else []))


def ablation_report(run_dirs: Path | list[Path], baseline_dir: Path | list[Path] | None = None,
                    against: dict | None = None) -> str:
    """The ablation table of one or more sweep run directories (``moga sweep configs/research/ablation_*.yaml
    --out RUN_DIR``); with ``baseline_dir`` (sweeps of baseline optimizers over the same widths, one directory
    or several, e.g. AdamW's and Muon's) each value against the best of them tuned at each width. Several
    directories are judged as one sweep (see :func:`merged_ablation`); the table's json goes to the first."""
    run_dirs = _paths(run_dirs)
    rows, spec = merged_ablation(run_dirs)
    baseline = None
    if baseline_dir is not None:
        baseline = []
        for one in _paths(baseline_dir):
            settled = records(SweepStore(one))
            if not settled:
                raise SystemExit(f"{one}: no settled cell yet")
            baseline += settled
    entries = ablation(rows, spec["axes"], scale_key=spec["scale_key"], lr_key=spec["lr_key"], baseline=baseline,
                       against=against)
    name = "ablation.json" if baseline is None and against is None else "ablation-baseline.json"
    write_json(run_dirs[0] / name, _finite(entries))
    return ablation_table(entries)


def _paths(dirs: Path | str | list[Path]) -> list[Path]:
    return [Path(dirs)] if isinstance(dirs, (str, Path)) else [Path(d) for d in dirs]


def merged_ablation(run_dirs: list[Path]) -> tuple[list[dict], dict]:
    """The rows and spec of several ablation sweeps judged as one: a follow-up sweep adds a choice without
    running the default again. Their base configs, scale and lr keys must agree, and each ablated axis must have
    the same first value (the default) wherever it appears. A row that lacks an axis ran with that axis' default
    (its config never set it), so it is filled in with it; the merged axes list every value in order seen."""
    rows, axes, first = [], {}, None
    for run_dir in run_dirs:
        definition = SweepStore(run_dir).definition()
        spec = definition["spec"]
        if first is None:
            first = (definition, run_dir)
        else:
            agree = {k: first[0]["spec"][k] == spec[k] for k in ("scale_key", "lr_key")}
            agree["base config"] = first[0]["base"] == definition["base"]
            if not all(agree.values()):
                raise SystemExit(f"{run_dir} cannot be judged with {first[1]}: their "
                                 f"{', '.join(k for k, ok in agree.items() if not ok)} differ")
        for key, values in spec["axes"].items():
            if key not in axes:
                axes[key] = values
            elif isinstance(values, list) and isinstance(axes[key], list):
                if key not in (spec["scale_key"], spec["lr_key"], "seed") and values[0] != axes[key][0]:
                    raise SystemExit(f"{run_dir}: axis {key} starts with {values[0]!r}, another directory's with "
                                     f"{axes[key][0]!r}; the first value is the default and must be the same")
                axes[key] = axes[key] + [v for v in values if v not in axes[key]]
        found = records(SweepStore(run_dir))
        if not found:
            raise SystemExit(f"{run_dir}: no settled cell yet")
        rows.extend(found)
    spec = {**first[0]["spec"], "axes": axes}
    defaults = {k: v[0] for k, v in axes.items() if isinstance(v, list)
                and k not in (spec["scale_key"], spec["lr_key"], "seed")}
    return [{**defaults, **r} for r in rows], spec


def transfer_report(run_dir: Path, goal: float = GOAL) -> str:
    """Does the value of the sweep's ``lr_key`` (an lr, or a role's lr multiplier) tuned at the smallest width
    serve every width? Per width: the loss at that value over the loss at the width's own best value, minus 1,
    with its interval (the same comparison as the quality claim, the optimizer against itself)."""
    store = SweepStore(run_dir)
    spec = store.definition()["spec"]
    rows = records(store)
    names = sorted({r["optim.name"] for r in rows})
    if len(names) != 1:
        raise SystemExit(f"{run_dir}: a transfer report needs one optimizer, the sweep has {names}")
    cells = compare(rows, subject=names[0], baselines=names, scale_key=spec["scale_key"], lr_key=spec["lr_key"],
                    goal=goal)
    write_json(Path(run_dir) / "transfer.json", _finite(cells))
    return (f"{spec['lr_key']} tuned at width {cells[0]['tuned_at']}, against each width's own best\n"
            + quality_table(cells))


def versus_report(subject_dir: Path, claim_dir: Path, goal: float = GOAL) -> str:
    """A sweep of the quality claim's subject under another setting (``configs/research/quality_default.yaml``:
    MOGA's default against the claim's pinned papers' preset) judged against a quality run's tuned baselines:
    its rows take the place of the run's subject rows, and the comparison is the claim's own (:func:`compare`).
    The two base configs must agree outside ``optim``, the one block the subject's sweep may change."""
    subject_store, claim_store = SweepStore(subject_dir), SweepStore(claim_dir)
    spec, claim = subject_store.definition(), claim_store.definition()
    mine = records(subject_store)
    names = sorted({str(r.get("optim.name")) for r in mine})
    if len(names) != 1:
        raise SystemExit(f"{subject_dir}: a versus report needs one optimizer, the sweep has {names or 'no cell'}")
    differ = sorted(k for k in changed_keys(spec["base"], claim["base"]) if k.split(".")[0] != "optim")
    if differ or spec["spec"]["scale_key"] != claim["spec"]["scale_key"]:
        raise SystemExit(f"{subject_dir} is not {claim_dir}'s experiment: their "
                         f"{', '.join(differ) or 'scale keys'} differ")
    theirs = [r for r in records(claim_store) if r.get("optim.name") != names[0]]
    if not theirs:
        raise SystemExit(f"{claim_dir}: no settled baseline cell")
    axes, scale_key = spec["spec"]["axes"], spec["spec"]["scale_key"]
    budget_key = "train.steps" if "train.steps" in axes else None
    panel_keys = tuple(k for k in axes if k not in (scale_key, spec["spec"]["lr_key"], "seed", "optim.name", budget_key))
    cells = compare(mine + theirs, subject=names[0], baselines=sorted({r["optim.name"] for r in theirs}),
                    scale_key=scale_key, budget_key=budget_key, panel_keys=panel_keys, goal=goal)
    write_json(Path(subject_dir) / "versus.json", _finite(cells))
    return quality_table(cells, panel_keys)


USAGE = ("usage: python -m moga.experiments.reproduce.quality ablation RUN_DIR [RUN_DIR ...] [--baseline RUN_DIR ...]"
         " [--against KEY=VALUE ...] | transfer RUN_DIR | versus RUN_DIR --baseline QUALITY_RUN_DIR")

if __name__ == "__main__":
    args, baselines, against = sys.argv[1:], [], {}
    if {"-h", "--help"} & set(args):  # not a run directory
        print(USAGE)
        sys.exit(0)
    while len(args) >= 2 and args[-2] in ("--baseline", "--against"):  # each --baseline DIR or --against K=V, from the end
        if args[-2] == "--baseline":
            baselines = [Path(args[-1]), *baselines]
        else:
            key, _, value = args[-1].partition("=")
            against[key] = value
        args = args[:-2]
    if args[:1] == ["ablation"] and len(args) >= 2 and "--baseline" not in args and not (baselines and against):
        print(ablation_report([Path(a) for a in args[1:]], baselines or None, against or None))
    elif args[:1] == ["transfer"] and len(args) == 2 and not baselines:
        print(transfer_report(Path(args[1])))
    elif args[:1] == ["versus"] and len(args) == 2 and len(baselines) == 1:
        print(versus_report(Path(args[1]), baselines[0]))
    else:
        raise SystemExit(USAGE)
