"""The ``transfer`` and ``joint`` kinds: an lr sweep over one scale axis (or two), judged panel by panel.

A transfer reproduction runs its grid with one seed, then adds seeds on each panel's decisive rates until
every panel is decided or has ``max_seeds`` there (:mod:`moga.sweep.seeds`); each panel's verdict carries 95% seed
intervals on drift and regret (:mod:`moga.sweep.report.decision`). The claim is **held** when every panel the paper
makes a claim about gets the verdict it claims, **failed** when any of them is confidently the opposite,
**undecided** when one cannot be judged on this grid (an optimum on its edge: extend the grid; one scale; missing
cells), **inconclusive** otherwise. The outcome keeps every cell's final losses (a joint claim's with both scale
keys), so the verdicts recompute from the stored file alone.
"""


from __future__ import annotations

import json
import math
from pathlib import Path

from moga.experiments.reproduce.cost import cell_cost, decisive_rate_seeds
from moga.experiments.reproduce.kinds import ClaimKind, RunArgs, judged_sweep
from moga.experiments.reproduce.reproduction import ReproduceError, Reproduction
from moga.files import write_json
from moga.sweep.report import analyze, write_report
from moga.sweep.report.joint import analyze_joint, plot_regret_map
from moga.sweep.report.schema import ALIASES, parse_records
from moga.sweep.report.summary import json_safe
from moga.sweep.results import records
from moga.sweep.seeds import run_until_decided
from moga.sweep.spec import optimizer_labels
from moga.sweep.store import SweepStore
from moga.verdicts import DOES_NOT_TRANSFER, TRANSFERS, UNDECIDED, panel_state, worst_state


def _until_decided(rep: Reproduction, out: Path, args: RunArgs, joint: bool = False):
    """A transfer's or joint's grid with one seed, then seeds on each panel's decisive rates until decided. A joint
    sweep takes its seeds from the one-axis panels (a curve per width at each depth): every pair's argmin and
    neighbours, and the rates around each depth's reference optimum."""
    keys = rep.sweep(args.scale, args.data).spec.all_scale_keys
    group = [*rep.group_keys, keys[1]] if joint else rep.group_keys
    rows_of = (lambda sw: (_records(rep, sw, out)[0], keys[0])) if joint else (lambda sw: _records(rep, sw, out))
    sweep, counts, _ = run_until_decided(lambda include: args.sweep(rep, include), out, lambda sw: args.run(sw, out),
                                         rows_of, group, args.max_regret, args.min_seeds, args.max_seeds)
    return sweep, counts  # the report says which panels have no verdict


def judge_panels(expect: list[dict], verdicts: list[dict]) -> tuple[str, list[str]]:
    """(outcome, one line per claimed panel) from the paper's expectations and the panels' verdicts."""
    lines, states = [], []
    for e in expect:
        matched = [v for v in verdicts if all(str(v["panel"].get(k)) == str(val) for k, val in e["panel"].items())]
        if not matched:
            states.append(UNDECIDED)
            lines.append(f"{_panel_text(e['panel'])}: no panel ran (claimed: {e['verdict']})")
        for v in matched:
            state = panel_state(e["verdict"], v["verdict"])
            states.append(state)
            lines.append(f"[{state}] {v['title']} (claimed: {e['verdict']}): {v['line']}")
    if not states:
        return UNDECIDED, ["the paper's claim names no panel"]
    return worst_state(states), lines


def _panel_text(panel: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in panel.items())


def key_number(expect: list[dict], panels: list[dict]) -> str:
    """The claim in numbers: over the claimed panels, the largest drift and the worst regret with their 95%
    seed intervals, and the fewest seeds at a decisive rate."""
    parts = []
    for wanted in (TRANSFERS, DOES_NOT_TRANSFER):
        chosen = [p for p in panels if any(e["verdict"] == wanted and all(
            str(p["panel"].get(k)) == str(val) for k, val in e["panel"].items()) for e in expect)]
        scales = [s for p in chosen if p.get("decision") for s in p["decision"]["scales"][1:]]
        who = "" if wanted == TRANSFERS else "baseline "
        if scales:
            drift = max(scales, key=lambda s: abs(s["drift_steps"]))
            regret = max(scales, key=lambda s: -1 if s["regret"] is None else s["regret"])
            text = f"{who}drift {drift['drift_steps']:+.2f} steps{_interval_text(drift['drift_interval'], '{:+.2f}')}"
            if regret["regret"] is not None:
                text += (f", worst regret {100 * regret['regret']:.1f}%"
                         f"{_interval_text(regret['regret_interval'], '{:.1%}')}")
            text += f" ({min(s['seeds'] for s in scales)}+ seeds)"
            parts.append(text)
        elif chosen:
            drifts = [_drift(p) for p in chosen if _drift(p) is not None]
            parts.append(f"{who}drift >= {min(drifts):g} steps (grid edge)" if drifts else f"{who}drift n/a")
    return "; ".join(parts)


def _interval_text(iv, fmt: str) -> str:
    if iv is None:
        return ""
    lo, hi = (v if v is not None else math.inf for v in iv)  # null: a diverging resample
    show = lambda v: "inf" if math.isinf(v) else fmt.format(v)  # noqa: E731
    return f" [{show(lo)}, {show(hi)}]"


def _drift(p: dict) -> float | None:
    d = p["drift"]
    if d.get("steps") is not None:
        return d["steps"] if d.get("steps_at_least") is None else max(d["steps"], d["steps_at_least"])
    if d.get("steps_at_least") is not None:
        return d["steps_at_least"]
    return d.get("log2_grid")


def _records(rep: Reproduction, sweep, out: Path) -> tuple[list[dict], str]:
    rows = records(SweepStore(out))
    scale_key = sweep.spec.scale_key
    mapping = (rep.raw.get("scale_values") or {}).get(scale_key)
    if mapping:  # e.g. ResNet stages -> K, the number of residual blocks
        for r in rows:
            r["K"] = mapping[str(r[scale_key])]
        scale_key = "K"
    if not rows:
        raise ReproduceError(f"{rep.name}: no cell of {out} settled; see `moga sweep status {out}`")
    return rows, scale_key


def _transfer(rep: Reproduction, sweep, out: Path, max_regret: float) -> dict:
    rows, scale_key = _records(rep, sweep, out)
    write_report(rows, out / "report", scale_key=scale_key, title=f"{rep.name}: {rep.claim}",
                 group_keys=rep.group_keys, formats=("png",), max_regret=max_regret)
    summary = json.loads((out / "report" / "summary.json").read_text())
    return {**verdict_fields(rep.expect, summary["metrics"].get("train_loss", []), optimizer_labels(sweep)),
            "report": str(out / "report" / "report.md"),
            "analysis": {"scale_key": scale_key, "group_keys": rep.group_keys, "metric": "train_loss",
                         "max_regret": max_regret},
            "cells": stored_cells(rows, scale_key, rep.group_keys)}


def verdict_fields(expect: list[dict], panels: list[dict], arms: dict[str, str] | None = None) -> dict:
    """An outcome's verdict fields (outcome, key, details, unclaimed, panels) from its panels' summaries; ``arms``
    ({optimizer: :func:`moga.sweep.spec.arm_label`}) names in each panel's title which Muon and MOGA ran."""
    panels = [_arm_titled(p, arms or {}) for p in panels]
    verdicts = [{"panel": p["panel"], "title": p["title"], "verdict": p["verdict"], "line": p["verdict_line"]}
                for p in panels]
    outcome, lines = judge_panels(expect, verdicts)
    others = [f"{v['title']}: {v['line']}" for v in verdicts
              if not any(all(str(v["panel"].get(k)) == str(val) for k, val in e["panel"].items()) for e in expect)]
    return {"outcome": outcome, "key": key_number(expect, panels), "details": lines, "unclaimed": others,
            **({"arms": arms} if arms else {}),
            "panels": [{"panel": p["panel"], "title": p["title"], "verdict": p["verdict"], "line": p["verdict_line"],
                        "decision": p.get("decision")} for p in panels]}


CELL_KEYS = ("scale", "lr", "seed", "status", "train_loss", "val_loss")


def _arm_titled(panel: dict, arms: dict[str, str]) -> dict:
    """The panel with its title's leading optimizer name replaced by its arm, "muon" -> "muon (moga preset)"."""
    name = panel["panel"].get("optimizer")
    label = arms.get(name)
    if not label or label == name or not panel["title"].startswith(name):
        return panel
    return {**panel, "title": label + panel["title"][len(name):]}


def stored_cells(rows: list[dict], scale_key: str, group_keys) -> list[dict]:
    """Every settled cell's panel, scale, lr, seed and final losses: what a reader needs to recheck a verdict."""
    out = []
    for r in parse_records(rows, scale_key):
        cell = {k: r.get(k) for k in group_keys}
        cell.update({k: r.get(k) for k in CELL_KEYS})
        cell["scale_key"] = scale_key
        out.append(cell)
    return out


def _rejudge_transfer(outcome: dict, expect: list[dict]) -> dict:
    a = outcome["analysis"]
    panels = analyze(outcome["cells"], scale_key=a["scale_key"], metric=a["metric"], group_keys=a["group_keys"],
                     max_regret=a["max_regret"])
    return {**outcome, **verdict_fields(expect, [p.to_dict() for p in panels], outcome.get("arms"))}


def _rejudge_joint(outcome: dict, expect: list[dict]) -> dict:
    """The tuning FLOPs saved come from the sweep's cost model, not from cells: kept as stored."""
    saved = {json.dumps(p["panel"], sort_keys=True): p.get("tuning_flops_saved") for p in outcome["panels"]}
    joint = analyze_joint_cells(outcome["cells"], outcome["analysis"])
    return {**outcome, **joint_fields(expect, joint, [saved.get(json.dumps(j.panel, sort_keys=True)) for j in joint])}


def _joint(rep: Reproduction, sweep, out: Path, max_regret: float) -> dict:
    rows, _ = _records(rep, sweep, out)
    keys = sweep.spec.all_scale_keys
    # the one-axis report, one panel per depth with a curve per width
    write_report(rows, out / "report", scale_key=keys[0], title=f"{rep.name}: {rep.claim}",
                 group_keys=[*rep.group_keys, keys[1]], formats=("png",), max_regret=max_regret)
    analysis = {"scale_keys": keys, "group_keys": rep.group_keys, "metric": "train_loss", "max_regret": max_regret}
    cells = stored_cells(rows, keys[0], [*rep.group_keys, keys[1]])  # the other scale key as a group
    joint = analyze_joint_cells(cells, analysis)  # from the stored cells, exactly as a recheck reads them
    figures = [str(plot_regret_map(j, out / "report" / "figures" / f"regret_map_{i}.png", max_regret))
               for i, j in enumerate(joint)]
    fields = joint_fields(rep.expect, joint, [_tuning_saved(sweep, j) for j in joint])
    write_json(out / "report" / "joint.json", fields["panels"])
    return {**fields, "figures": figures, "report": str(out / "report" / "report.md"), "analysis": analysis,
            "cells": cells}


def analyze_joint_cells(cells: list[dict], analysis: dict) -> list:
    a = analysis
    return analyze_joint(cells, a["scale_keys"], metric=a["metric"], group_keys=a["group_keys"],
                         max_regret=a["max_regret"])


def joint_fields(expect: list[dict], joint: list, saved: list[float | None]) -> dict:
    """A joint outcome's verdict fields (outcome, key, details, panels) from its panels' analyses and the share
    of tuning FLOPs that reusing the smallest pair's rate saves in each."""
    verdicts = [{"panel": j.panel, "title": j.title, "verdict": j.verdict, "line": j.verdict_line} for j in joint]
    outcome, lines = judge_panels(expect, verdicts)
    saved_text = lambda s: "n/a" if s is None or not math.isfinite(s) else f"{100 * s:.0f}%"  # noqa: E731
    key = "; ".join(f"{j.title}: worst regret " + ("n/a" if j.worst_regret is None else "diverges"
                                                    if math.isinf(j.worst_regret) else f"{100 * j.worst_regret:.1f}%")
                    + (f", drift {j.drift_steps} steps" if j.drift_steps is not None else "")
                    + f", tuning FLOPs saved {saved_text(s)}" for j, s in zip(joint, saved))
    panels = [json_safe({**j.to_dict(), "title": j.title, "tuning_flops_saved": s}) for j, s in zip(joint, saved)]
    return {"outcome": outcome, "key": key, "details": lines, "panels": panels}


def _tuning_saved(sweep, j) -> float:
    """Share of the tuning FLOPs saved by sweeping lrs on the smallest pair only and training every other pair
    once at its rate, against sweeping every pair's grid."""
    keys = sweep.spec.all_scale_keys
    costs: dict[tuple, float] = {}
    lrs: dict[tuple, int] = {}
    for cell in sweep.cells:
        if any(str(cell.get(k)) != str(v) for k, v in _panel_params(j.panel).items()):
            continue
        pair = tuple(float(cell[k]) for k in keys)
        lrs[pair] = lrs.get(pair, 0) + 1
        if pair not in costs:
            costs[pair] = cell_cost(sweep.config(cell))["flops"]
    if not costs:
        return math.nan
    full = sum(costs[p] * lrs[p] for p in costs)
    ref = min(costs)
    transfer = costs[ref] * lrs[ref] + sum(c for p, c in costs.items() if p != ref)
    return 1 - transfer / full


def _panel_params(panel: dict) -> dict:
    names = {v: k for k, v in ALIASES.items()}
    return {names.get(k, k): v for k, v in panel.items() if v not in (None, "")}


def _analysis(outcome: dict) -> dict:
    return outcome.get("analysis") or {}


TRANSFER = ClaimKind(
    "transfer", judged_sweep(_until_decided, _transfer), _rejudge_transfer,
    stores=lambda o: "scale_key" in _analysis(o) and "scale_keys" not in _analysis(o) and not _analysis(o).get("gap"),
    seeds_added=decisive_rate_seeds, intervals=True)
JOINT = ClaimKind(
    "joint", judged_sweep(lambda rep, out, args: _until_decided(rep, out, args, joint=True), _joint), _rejudge_joint,
    stores=lambda o: "scale_keys" in _analysis(o), seeds_added=decisive_rate_seeds, intervals=True)
