"""The gap's trend in width: ``moga reproduce gap-width`` (kind ``gap``).

Two contenders differ in one axis (``gap.contender_key``: the hidden matrices' geometry, row(2) against the
orthogonalized step; every other role MOGA's default), each at its own tuned lr, per model (``panel_keys``)
and width, run width by width (:mod:`moga.experiments.reproduce.gap_stages`, which also seeds a store from a
stored outcome).

How it is judged (:func:`analyze_cells`, from the stored cells alone, so a stored outcome rechecks): per model
and width the **gap** is the subject's seed-mean final training loss over the baseline's, minus 1, each at its
best rate, with a 95% bootstrap interval resampling seeds within each side (:func:`relative_interval`); the
**slope** is the least-squares slope of the gap against log2(width), its interval from the same resamples at
every width at once. A model's verdict: **closes** when the slope's interval lies below 0; **does not close**
when its lower end is above ``-margin`` (the gap shrinks by less than ``margin`` per doubling, if at all);
**inconclusive** otherwise, or when a width has fewer than two seeds on a side; **no verdict** with fewer than
three widths or a best rate on the edge of the rates run. The claim ("the gap closes") is held when every
model closes, failed when one does not close, undecided when one has no verdict, inconclusive otherwise.

``python -m moga.experiments.reproduce.gap judge OUT [--partial]`` judges a store that is still running (read
only) and prints the outcome's json: what finished, marked partial with what is missing.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

from moga.experiments.reproduce.clock import FILE, _seconds
from moga.experiments.reproduce.cost import best_rate_seeds
from moga.experiments.reproduce.kinds import ClaimKind, RunArgs, judged_sweep
from moga.experiments.reproduce.reproduction import CONFIGS, ReproduceError, read_reproduction
from moga.experiments.reproduce.stats import (LEVEL, RESAMPLES, _finite, _mean, _pct, _same, best_lr,
                                              relative_interval, seed_losses)
from moga.experiments.reproduce.gap_stages import (PRIOR, prior_alignment, prior_cells, read_prior, run_staged,
                                                   seed_store, settings)
from moga.files import shown_path, write_text
from moga.sweep.results import format_lr, records
from moga.sweep.spec import Sweep
from moga.status import Status
from moga.sweep.store import SweepStore
from moga.train import read_metrics
from moga.verdicts import CLOSES, DOES_NOT_CLOSE, FAILED, HELD, INCONCLUSIVE, NO_VERDICT, UNDECIDED, worst_state

MARGIN = 0.005  # per doubling: a gap that shrinks more slowly than half a point per doubling does not close
MIN_WIDTHS = 3
VERDICTS = {CLOSES: HELD, DOES_NOT_CLOSE: FAILED, INCONCLUSIVE: INCONCLUSIVE, NO_VERDICT: UNDECIDED}
ALIGNMENT_KEYS = ("gram_dominance", "gram_coherence", "cosine")


# --- judging ----------------------------------------------------------------------------------------------

def judge_gap(rep, sweep, out: Path, max_regret: float = 0.0, skip=()) -> dict:
    """The ``gap`` kind for :func:`moga.experiments.reproduce.run.reproduce` (``max_regret`` is unused);
    ``skip``: widths left out (a stage still running)."""
    g = settings(rep, _scale_of(sweep))
    store = SweepStore(out)
    scale_key = sweep.spec.scale_key
    rows = [r for r in records(store) if r[scale_key] not in skip]
    cells = [{**{k: r.get(k) for k in g["panel_keys"]}, "contender": r[g["contender_key"]], "scale": r[scale_key],
              "lr": float(r[sweep.spec.lr_key]), "seed": r.get("seed", 0), "status": r["status"],
              "train_loss": r["train_loss"], "cell": r["cell"]} for r in rows]
    own = {c["scale"] for c in cells}
    prior = [c for c in prior_cells(out, rep.name, _scale_of(sweep)) if c["scale"] not in own | set(skip)]
    cells = prior + cells
    keys = list(g["panel_keys"])
    expected = sorted({json.dumps({k: c.get(k) for k in keys}) for c in sweep.cells})
    analysis = {"gap": True, "subject": g["subject"], "baseline": g["baseline"], "panel_keys": keys,
                "group_keys": [*keys, "contender"], "scale_key": scale_key,
                "margin": float(g.get("margin", MARGIN)), "contender_key": g["contender_key"],
                # what the claim names: a store without all of it is partial and decides nothing
                "expected": {"panels": [json.loads(e) for e in expected],
                             "widths": sorted(sweep.spec.axes[scale_key])}}
    fields = gap_verdict_fields(cells, analysis)
    before = {c["scale"] for c in prior}
    fields["alignment"] = [a for a in prior_alignment(out) if a["scale"] in before] + alignment(
        store, [w for w in fields["widths"] if w["scale"] not in before], cells, analysis)
    source = ""
    if before:  # kept beside the verdict fields, which a recheck recomputes from the cells
        fields["prior"] = {"file": PRIOR, "source": read_prior(out).get("source"), "widths": sorted(before)}
        source = (f"Widths {', '.join(map(str, sorted(before)))}: cells of a stored outcome "
                  f"({fields['prior']['source']}, copied to {PRIOR}), not run in this store.\n\n")
    report = Path(out) / "report"
    report.mkdir(parents=True, exist_ok=True)
    write_text(report / "gap.md", f"# {rep.name}: {rep.claim}\n\n" + source + gap_table(fields) + "\n")  # never through a link
    return {**fields, "analysis": analysis, "cells": cells, "report": str(report / "gap.md")}


def _scale_of(sweep) -> str:
    name = sweep.spec.name or ""
    return next((s for s in ("quick", "cpu", "paper") if name.endswith("-" + s)), "cpu")


def analyze_cells(cells: list[dict], analysis: dict, resamples: int = RESAMPLES) -> tuple[list[dict], list[dict]]:
    """(widths, panels): per model and width the gap with its interval; per model the slope and verdict."""
    keys, margin = analysis["panel_keys"], analysis["margin"]
    widths_out, panels = [], []
    for panel in sorted({tuple(c.get(k) for k in keys) for c in cells}, key=str):
        where = dict(zip(keys, panel))
        mine = [c for c in cells if all(_same(c.get(k), v) for k, v in where.items())]
        entries = []
        for width in sorted({c["scale"] for c in mine}):
            entry = {**where, "scale": width}
            sides = {}
            for role in ("subject", "baseline"):
                grid = seed_losses(mine, {"contender": analysis[role], "scale": width}, "lr", "seed", "train_loss")
                lr = best_lr(grid)
                if lr is None:
                    break
                sides[role] = list(grid[lr].values())
                entry.update({f"{role}_lr": lr, f"{role}_lr_on_edge": lr in (min(grid), max(grid)),
                              f"{role}_rates": sorted(grid), f"{role}_losses": sides[role],
                              f"{role}_loss": _mean(sides[role])})
            if len(sides) < 2:
                entries.append({**entry, "note": "missing cells: a contender has no finite tuned loss"})
                continue
            point, low, high = relative_interval(sides["subject"], sides["baseline"], resamples=resamples)
            entries.append({**entry, "gap": point, "low": low, "high": high,
                            "seeds": min(len(sides["subject"]), len(sides["baseline"]))})
        widths_out += entries
        panels.append(_panel(where, [e for e in entries if "gap" in e], margin, resamples))
    return widths_out, panels


def _panel(where: dict, entries: list[dict], margin: float, resamples: int) -> dict:
    title = _title(where, list(where))
    panel = {"panel": where, "title": title, "widths": [e["scale"] for e in entries]}
    if len(entries) < 2:
        return {**panel, "verdict": NO_VERDICT, "line": f"{len(entries)} width(s) judged; a slope needs 2 or more"}
    x = [math.log2(e["scale"]) for e in entries]
    slope = _slope(x, [e["gap"] for e in entries])
    rng = random.Random(0)
    draws = []
    for _ in range(resamples):
        gaps = []
        for e in entries:
            a = rng.choices(e["subject_losses"], k=len(e["subject_losses"]))
            b = rng.choices(e["baseline_losses"], k=len(e["baseline_losses"]))
            gaps.append(_mean(a) / _mean(b) - 1)
        draws.append(_slope(x, gaps))
    draws.sort(key=lambda v: (math.isnan(v), v))
    tail = (1 - LEVEL) / 2
    low = draws[max(0, math.floor(tail * resamples))]
    high = draws[min(resamples - 1, math.ceil((1 - tail) * resamples) - 1)]
    panel.update(slope=slope, slope_low=low, slope_high=high)
    edge = [e["scale"] for e in entries if e["subject_lr_on_edge"] or e["baseline_lr_on_edge"]]
    few = [e["scale"] for e in entries if e["seeds"] < 2]
    if len(entries) < MIN_WIDTHS or edge:
        verdict = NO_VERDICT
        why = (f"{len(entries)} widths judged (a verdict needs {MIN_WIDTHS})" if len(entries) < MIN_WIDTHS
               else f"a best rate on the edge of the rates run at width {', '.join(map(str, edge))}")
    elif few:
        verdict, why = INCONCLUSIVE, f"one seed on a side at width {', '.join(map(str, few))}"
    elif high < 0:
        verdict, why = CLOSES, "the slope's interval lies below 0"
    elif low > -margin:
        verdict, why = DOES_NOT_CLOSE, f"the slope's lower end is above -{100 * margin:g}% per doubling"
    else:
        verdict, why = INCONCLUSIVE, "the slope's interval straddles the limits"
    first, last = entries[0], entries[-1]
    line = (f"gap {_pct(first['gap'])} at width {first['scale']} to {_pct(last['gap'])} [{_pct(last['low'])}, "
            f"{_pct(last['high'])}] at {last['scale']}; slope {_pct(slope)} per doubling [{_pct(low)}, {_pct(high)}]"
            f": {verdict} ({why})")
    return {**panel, "verdict": verdict, "line": line}


def _slope(x: list[float], y: list[float]) -> float:
    if any(math.isinf(v) or math.isnan(v) for v in y):
        return math.nan
    mx, my = _mean(x), _mean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx


def gap_verdict_fields(cells: list[dict], analysis: dict) -> dict:
    """outcome, key, details, unclaimed, panels and widths of the stored cells (what a recheck recomputes)."""
    widths, panels = analyze_cells(cells, analysis)
    states = [VERDICTS[p["verdict"]] for p in panels]
    outcome = worst_state(states)
    details = [f"[{VERDICTS[p['verdict']]}] {p['title']}: {p['line']}" for p in panels]
    details += [_width_line(w) for w in widths]
    key = "; ".join(f"{p['title']}: slope {_pct(p['slope'])}/doubling [{_pct(p['slope_low'])}, "
                    f"{_pct(p['slope_high'])}], {p['verdict']}" for p in panels if "slope" in p)
    missing = _missing(widths, analysis)
    if missing:  # the widths that ran say something; the claim, about every width it names, is not decided
        outcome = INCONCLUSIVE
        text = "; ".join(f"{t} {', '.join(map(str, ws))}" for t, ws in missing.items())
        key = f"partial (not yet run: {text})" + (f"; {key}" if key else "")
        details.insert(0, f"[partial] widths not yet run: {text}")
    return {"outcome": outcome, "key": key, "details": details, "unclaimed": [], "panels": _finite(panels),
            "widths": _finite(widths), "partial": {"missing": missing} if missing else None}


def _missing(widths: list[dict], analysis: dict) -> dict[str, list]:
    """{model: widths the claim names that have no gap yet}."""
    expected = analysis.get("expected")
    if not expected:
        return {}
    keys = analysis["panel_keys"]
    out = {}
    for panel in expected["panels"]:
        done = {w["scale"] for w in widths if "gap" in w and all(_same(w.get(k), v) for k, v in panel.items())}
        named = expected["widths"]  # every panel's, or {panel title: its widths}
        named = named.get(_title(panel, keys), []) if isinstance(named, dict) else named
        lacking = [w for w in named if w not in done]
        if lacking:
            out[_title(panel, keys)] = lacking
    return out


def _title(panel: dict, keys) -> str:
    return ", ".join(str(panel[k]).rsplit(":", 1)[-1] for k in keys)


def _width_line(w: dict) -> str:
    where = ", ".join(str(w[k]).rsplit(":", 1)[-1] for k in w if k not in _WIDTH_FIELDS)
    if "gap" not in w:
        return f"{where}, width {w['scale']}: {w.get('note', '')}"
    edge = [r for r in ("subject", "baseline") if w[f"{r}_lr_on_edge"]]
    return (f"{where}, width {w['scale']}: {w['subject_loss']:.4f} (lr {w['subject_lr']:g}) vs "
            f"{w['baseline_loss']:.4f} (lr {w['baseline_lr']:g}): gap {_pct(w['gap'])} [{_pct(w['low'])}, "
            f"{_pct(w['high'])}], {w['seeds']} seeds" + (f"; best lr on the edge: {', '.join(edge)}" if edge else ""))


_WIDTH_FIELDS = {"scale", "gap", "low", "high", "seeds", "note"} | {
    f"{r}_{k}" for r in ("subject", "baseline") for k in ("lr", "lr_on_edge", "rates", "losses", "loss")}


def rejudge_gap(outcome: dict) -> dict:
    """The verdict fields recomputed from a stored outcome's cells."""
    return {**outcome, **gap_verdict_fields(outcome["cells"], outcome["analysis"])}


def _curves(rep, scale: str, sweep: Sweep, curves: dict) -> dict:
    """--list: from ``narrow_from`` on, 3 rates per curve (a width's cells, :func:`run_staged`)."""
    narrow = settings(rep, scale).get("narrow_from", math.inf)
    key = sweep.spec.scale_key
    return {k: (min(n, 3) if json.loads(k)[key] >= narrow else n, s) for k, (n, s) in curves.items()}


def _staged(rep, out: Path, args: RunArgs):
    return run_staged(rep, args.scale, args.data, out, lambda sweep: args.run(sweep, out), args.min_seeds)


GAP = ClaimKind("gap", judged_sweep(_staged, judge_gap), lambda outcome, expect: rejudge_gap(outcome),
                stores=lambda outcome: bool((outcome.get("analysis") or {}).get("gap")),
                seeds_added=best_rate_seeds, curves=_curves)


# --- the mechanism ----------------------------------------------------------------------------------------

def alignment(store: SweepStore, widths: list[dict], cells: list[dict], analysis: dict) -> list[dict]:
    """Per model, width and contender, at each recorded step: the seed means of the hidden matrices' Gram
    dominance, row coherence and row/polar cosine (``logging.alignment_every``) at the contender's tuned rate."""
    keys = analysis["panel_keys"]
    out = []
    for w in widths:
        for role in ("subject", "baseline"):
            if f"{role}_lr" not in w:
                continue
            where = {**{k: w[k] for k in keys}, "contender": analysis[role], "scale": w["scale"],
                     "lr": w[f"{role}_lr"]}
            by_step: dict[int, list[dict]] = {}
            for c in cells:
                if all(_same(c.get(k), v) for k, v in where.items()):
                    path = store.cell_dir(c["cell"]) / "metrics.jsonl"
                    for r in read_metrics(path, "alignment") if path.is_file() else []:
                        by_step.setdefault(r["step"], []).append(r)
            for step in sorted(by_step):
                recs = by_step[step]
                out.append({**{k: w[k] for k in keys}, "scale": w["scale"], "contender": analysis[role],
                            "step": step, "seeds": len(recs),
                            **{k: _mean([r[k] for r in recs]) for k in ALIGNMENT_KEYS}})
    return _finite(out)


# --- tables -----------------------------------------------------------------------------------------------

def gap_table(fields: dict) -> str:
    names = {"row(p=2)": "row(2)", "spectral": "orthogonalized"}  # the claim's two; a cells file may name others
    subject, baseline = (names.get(fields.get("analysis", {}).get(r, d), fields.get("analysis", {}).get(r, d))
                         for r, d in (("subject", "row(p=2)"), ("baseline", "spectral")))
    lines = [f"| model | width | {subject} loss (lr) | {baseline} loss (lr) | gap [95%] | seeds |",
             "|---|---|---|---|---|---|"]
    for w in fields["widths"]:
        model = " ".join(str(v).rsplit(":", 1)[-1] for k, v in w.items() if k not in _WIDTH_FIELDS)
        if "gap" not in w:
            lines.append(f"| {model} | {w['scale']} | | | {w.get('note', '')} | |")
            continue
        edge = lambda r: " (edge)" if w[f"{r}_lr_on_edge"] else ""  # noqa: E731
        lines.append(f"| {model} | {w['scale']} | {w['subject_loss']:.4f} ({format_lr(w['subject_lr'])}{edge('subject')}) "
                     f"| {w['baseline_loss']:.4f} ({format_lr(w['baseline_lr'])}{edge('baseline')}) | {_pct(w['gap'])} "
                     f"[{_pct(w['low'])}, {_pct(w['high'])}] | {w['seeds']} |")
    lines += ["", "| model | slope per doubling [95%] | widths | verdict |", "|---|---|---|---|"]
    for p in fields["panels"]:
        slope = f"{_pct(p['slope'])} [{_pct(p['slope_low'])}, {_pct(p['slope_high'])}]" if "slope" in p else ""
        lines.append(f"| {p['title']} | {slope} | {', '.join(map(str, p['widths']))} | {p['verdict']} |")
    if fields.get("alignment"):
        lines += ["", "| model | width | contender | step | Gram dominance | row coherence | cosine (row, polar) |",
                  "|---|---|---|---|---|---|---|"]
        for a in fields["alignment"]:
            model = " ".join(str(v).rsplit(":", 1)[-1] for k, v in a.items()
                             if k not in ("scale", "contender", "step", "seeds", "matrices", *ALIGNMENT_KEYS))
            lines.append(f"| {model} | {a['scale']} | {a['contender']} | {a['step']} | "
                         f"{_three_decimals(a['gram_dominance'])} | {_three_decimals(a['gram_coherence'])} | "
                         f"{_three_decimals(a['cosine'])} |")
    return "\n".join(lines)


def _three_decimals(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.3f}"


# --- a store that is still running ------------------------------------------------------------------------

def store_outcome(out: Path, scale: str = "cpu", name: str = "gap-width") -> dict:
    """The outcome of what ``out`` holds now (read only: its runner may still be going), in the form
    ``moga reproduce`` stores, marked ``partial`` with the widths not yet run."""
    rep = next((r for r in map(read_reproduction, sorted(CONFIGS.glob("*.yaml"))) if r.name == name), None)
    if rep is None:
        raise ReproduceError(f"no reproduction {name!r}")
    sweep = rep.sweep(scale)
    store = SweepStore(out)
    running = sorted({c["params"][sweep.spec.scale_key] for c in store.cells()  # a stage not yet through
                      if c["status"] in (Status.PENDING, Status.RUNNING)})
    outcome = judge_gap(rep, sweep, Path(out), skip=running)
    outcome["report"] = shown_path(outcome["report"], out)
    outcome["running"] = running  # beside the verdict fields, which a recheck recomputes from the cells
    counts = store.counts()
    outcome.update(runs={str(k): v for k, v in counts.items() if v}, data=rep.sweep(scale).base["data"].get("name"),
                   name=rep.name, paper=rep.paper, figure=rep.figure, claim=rep.claim, scale=scale,
                   command=f"moga reproduce {rep.name}" + (" --quick" if scale == "quick" else
                                                           " --scale paper" if scale == "paper" else ""),
                   seconds=_seconds(Path(out) / FILE), max_regret=0.0)
    return _finite(outcome)


def cells_outcome(path: Path) -> dict:
    """The verdict fields of a cells file (``scripts/gpu_gap.py``'s ``gap-cells.json`` or ``hybrid-cells.json``:
    cells in the stored form, its two contenders, what the run meant to cover, its setup), and its alignment
    records per model, width and contender."""
    raw = json.loads(Path(path).read_text())
    analysis = {"gap": True, "subject": raw.get("subject", "row(p=2)"), "baseline": raw.get("baseline", "spectral"),
                "panel_keys": ["model.name"],
                "group_keys": ["model.name", "contender"], "scale_key": "model.n_embd", "margin": MARGIN,
                "contender_key": "optim.geometries.hidden", "expected": raw.get("expected")}
    fields = gap_verdict_fields(raw["cells"], analysis)
    fields["alignment"] = [{"model.name": c["model.name"], "scale": c["scale"], "contender": c["contender"],
                            "step": raw.get("setup", {}).get("steps"), "seeds": 1, **c["alignment"]}
                           for c in raw["cells"] if c.get("alignment")]
    return {**fields, "analysis": analysis, "cells": raw["cells"], "setup": raw.get("setup"),
            "skipped": raw.get("skipped", [])}


USAGE = ("usage: python -m moga.experiments.reproduce.gap judge OUT [quick|cpu|paper] [--write FILE]\n"
         "       python -m moga.experiments.reproduce.gap cells CELLS_JSON [--write FILE]\n"
         "       python -m moga.experiments.reproduce.gap seed OUT OUTCOME_JSON WIDTH")

if __name__ == "__main__":
    args = sys.argv[1:]
    target = None
    if len(args) >= 2 and args[-2] == "--write":
        args, target = args[:-2], Path(args[-1])
    if args[:1] == ["seed"] and len(args) == 4 and target is None:
        print(f"{seed_store(Path(args[1]), Path(args[2]), int(args[3]))}: widths below {args[3]} will not run")
        raise SystemExit(0)
    if args[:1] == ["judge"] and len(args) in (2, 3):
        result = store_outcome(Path(args[1]), *args[2:])
    elif args[:1] == ["cells"] and len(args) == 2:
        result = cells_outcome(Path(args[1]))
    else:
        raise SystemExit(USAGE)
    if target is not None:
        target.write_text(json.dumps(_finite(result), indent=1) + "\n")
    print("\n".join([f"{result['outcome'].upper()}: {result['key']}", *result["details"], "", gap_table(result)]))
