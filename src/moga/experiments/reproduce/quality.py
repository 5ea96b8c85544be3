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

The ablation (:mod:`moga.experiments.reproduce.ablation`) uses the same comparison:
``python -m moga.experiments.reproduce.quality ablation RUN_DIR [RUN_DIR ...]`` (a follow-up sweep that adds a
choice is judged with the first), ``... --baseline BASELINE_RUN_DIR`` (the gap) or ``... --against KEY=VALUE``
(a named variant of the same sweep). ``... transfer RUN_DIR`` asks of a sweep over
one optimizer whether the value of its ``lr_key`` tuned at the smallest width (e.g. a role's lr multiplier,
``configs/research/multiplier_transfer.yaml``) serves every width. ``... versus RUN_DIR --baseline QUALITY_RUN_DIR``
judges a sweep of the subject under another setting against a quality run's tuned baselines.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from moga.experiments.reproduce.ablation import ablation_report
from moga.experiments.reproduce.kinds import ClaimKind, grid_once, judged_sweep
from moga.experiments.reproduce.stats import (RESAMPLES, _finite, _mean, _pct, _same, best_lr, relative_interval,
                                              seed_losses)
from moga.files import write_json, write_text
from moga.sweep.results import records
from moga.sweep.spec import optimizer_labels
from moga.sweep.compat import changed_keys
from moga.sweep.store import SweepStore
from moga.train.config_files import parse_value
from moga.verdicts import FAILED, HELD, INCONCLUSIVE, UNDECIDED, within_goal

GOAL = 0.02


def verdict(low: float, high: float, goal: float = GOAL) -> str:
    return within_goal(low, high, goal)


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


def _order(v):
    return (0, float(v)) if isinstance(v, (int, float)) else (1, str(v))


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
            against[key] = parse_value(value)  # optim.weight_decay=0.0 is the number the store holds
        args = args[:-2]
    if args[:1] == ["ablation"] and len(args) >= 2 and "--baseline" not in args and not (baselines and against):
        print(ablation_report([Path(a) for a in args[1:]], baselines or None, against or None))
    elif args[:1] == ["transfer"] and len(args) == 2 and not baselines:
        print(transfer_report(Path(args[1])))
    elif args[:1] == ["versus"] and len(args) == 2 and len(baselines) == 1:
        print(versus_report(Path(args[1]), baselines[0]))
    else:
        raise SystemExit(USAGE)
