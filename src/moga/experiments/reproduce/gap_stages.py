"""How ``moga reproduce gap-width`` runs (:func:`run_staged`): width by width from the smallest, so a partial
store has whole widths: the lr grid with seed 0; then ``min_seeds`` seeds at each contender's best rate. From
``narrow_from`` on (widths whose cells cost tens of CPU minutes) only the three rates around the contender's best
rate at the next smaller width run (its transferred optimum, one grid step either side), widened a step at a time
while the best sits on the narrow grid's edge and the configured grid goes further.

A store may start from a stored outcome (:func:`seed_store`, ``python -m moga.experiments.reproduce.gap seed OUT
OUTCOME WIDTH``): its cells of widths below WIDTH go to ``OUT/prior.json``; those widths are not run again, the
first narrow width takes its rates from them, and the judge (:mod:`moga.experiments.reproduce.gap`) reads them
beside the store's own cells. So a machine that keeps no store between sessions runs the widest width alone, on
the narrower widths' stored cells.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moga.experiments.reproduce.clock import FILE, _seconds
from moga.experiments.reproduce.stats import _finite, _same, best_lr, seed_losses
from moga.experiments.reproduce.reproduction import ReproduceError
from moga.files import shown_path, write_json, write_text
from moga.sweep.results import records
from moga.sweep.seeds import stored_include
from moga.sweep.spec import Sweep, cell_id
from moga.sweep.store import SweepStore

PRIOR = "prior.json"  # a stored outcome's cells of the widths this store does not run (seed_store)


def settings(rep, scale: str) -> dict:
    g = dict(rep.raw["gap"])
    g.update(rep.scale(scale).get("gap", {}))
    return g


# --- running, width by width ------------------------------------------------------------------------------

def run_staged(rep, scale: str, data, out: Path, run, min_seeds: int):
    """Run (or resume) the claim's sweep in ``out`` width by width; returns the last sweep and its counts."""
    g = settings(rep, scale)
    spec = rep.sweep_dict(scale, data)
    full = Sweep.from_dict(spec)  # every width, every rate: what a narrow grid may widen into
    widths = sorted(full.spec.axes[full.spec.scale_key])
    include = stored_include(out, lambda _: full)  # recorded seeds must be cells of the full grid, or their seeds
    prior = prior_cells(out, rep.name, scale)
    done = {c["scale"] for c in prior}  # widths the prior holds: not run here
    narrow: dict[tuple, list[float]] = {}  # (panel, contender, width) -> the rates run there
    sweep = counts = None
    for width in (w for w in widths if w not in done):
        if width >= g.get("narrow_from", math.inf):
            narrow.update(_narrow_rates(out, full, width, widths, g, prior))
        while True:
            sweep = _stage(spec, full, width, widths, narrow, include, g, done)
            counts = run(sweep)
            if width not in {k[2] for k in narrow} or not _widen(out, full, width, narrow, g):
                break
        extra = _seeds(out, full, width, g, min_seeds)
        if extra:
            include = include + extra
            sweep = _stage(spec, full, width, widths, narrow, include, g, done)
            counts = run(sweep)
    return sweep, counts


def _stage(spec: dict, full: Sweep, width, widths: list, narrow: dict, include: list[dict], g: dict,
           done=()) -> Sweep:
    """The sweep of the widths up to ``width`` (less ``done``, the prior's), narrow widths at their chosen
    rates, with the seeds added there."""
    scale_key, lr_key = full.spec.scale_key, full.spec.lr_key
    exclude = list(spec.get("exclude", [])) + [{scale_key: w} for w in widths if w > width or w in done]
    for (panel, contender, w), lrs in narrow.items():
        for lr in _rates(full, panel, contender, w, g):
            if lr not in lrs:
                exclude.append({**dict(zip(g["panel_keys"], panel)), g["contender_key"]: contender,
                                scale_key: w, lr_key: lr})
    staged = {**spec, "exclude": exclude}
    staged.pop("include", None)
    ids = {cell_id(c) for c in full.cells if not any(all(_same(c.get(k), v) for k, v in e.items()) for e in exclude)}
    axes = list(spec["axes"])
    kept = [c for c in include if cell_id({k: c.get(k) for k in axes}) in ids]  # the seeds of the widths so far
    return Sweep.from_dict({**staged, **({"include": kept} if kept else {})})


def _rates(full: Sweep, panel: tuple, contender, width, g: dict) -> list[float]:
    where = {**dict(zip(g["panel_keys"], panel)), g["contender_key"]: contender, full.spec.scale_key: width}
    return sorted({c[full.spec.lr_key] for c in full.cells if all(_same(c.get(k), v) for k, v in where.items())})


def _pairs(full: Sweep, g: dict) -> list[tuple]:
    """Every (panel, contender) of the grid, in a fixed order."""
    return sorted({(tuple(c.get(k) for k in g["panel_keys"]), c[g["contender_key"]]) for c in full.cells}, key=str)


def _rows(out: Path) -> list[dict]:
    store = SweepStore(out)
    return records(store) if store.exists() else []


def _narrow_rates(out: Path, full: Sweep, width, widths: list, g: dict, prior=()) -> dict:
    """Each contender's rates at ``width``: the grid's rates within a step of its best at the next smaller
    width, in the store or the prior's cells (all of them when that width has no finite best)."""
    scale_key, lr_key = full.spec.scale_key, full.spec.lr_key
    rows = _rows(out) + [{**{k: c.get(k) for k in g["panel_keys"]}, g["contender_key"]: c["contender"],
                          scale_key: c["scale"], lr_key: c["lr"], "seed": c["seed"], "train_loss": c["train_loss"]}
                         for c in prior]
    smaller = max((w for w in widths if w < width), default=None)
    chosen = {}
    for panel, contender in _pairs(full, g):
        grid = _rates(full, panel, contender, width, g)
        where = {**dict(zip(g["panel_keys"], panel)), g["contender_key"]: contender, scale_key: smaller}
        best = None if smaller is None else best_lr(seed_losses(rows, where, lr_key, "seed", "train_loss"))
        near = [] if best is None else [lr for lr in grid if best / 2.01 < lr < best * 2.01]
        chosen[(panel, contender, width)] = near or grid
    return chosen


def _widen(out: Path, full: Sweep, width, narrow: dict, g: dict) -> bool:
    """One more rate where a contender's best at ``width`` sits on the edge of its narrow rates and the grid
    goes further; True when any was added."""
    rows = _rows(out)
    scale_key, lr_key = full.spec.scale_key, full.spec.lr_key
    added = False
    for (panel, contender, w), lrs in narrow.items():
        if w != width:
            continue
        where = {**dict(zip(g["panel_keys"], panel)), g["contender_key"]: contender, scale_key: w}
        best = best_lr(seed_losses(rows, where, lr_key, "seed", "train_loss"))
        grid = _rates(full, panel, contender, w, g)
        for edge, step in ((min(lrs), -1), (max(lrs), 1)):
            if best == edge and 0 <= grid.index(edge) + step < len(grid):
                lrs.append(grid[grid.index(edge) + step])
                added = True
        lrs.sort()
    return added


def _seeds(out: Path, full: Sweep, width, g: dict, min_seeds: int) -> list[dict]:
    """Seeds 0..min_seeds-1 at each contender's best rate at ``width`` that are not stored yet."""
    store = SweepStore(out)
    params = {c["id"]: c["params"] for c in store.cells()}
    rows = records(store)
    scale_key, lr_key = full.spec.scale_key, full.spec.lr_key
    extra = []
    for panel, contender in _pairs(full, g):
        where = {**dict(zip(g["panel_keys"], panel)), g["contender_key"]: contender, scale_key: width}
        grid = seed_losses(rows, where, lr_key, "seed", "train_loss")
        lr = best_lr(grid)
        if lr is None:
            continue
        one = next(r for r in rows if all(_same(r.get(k), v) for k, v in {**where, lr_key: lr}.items()))
        base = {k: v for k, v in params[one["cell"]].items() if k != "seed"}
        extra += [{**base, "seed": s} for s in range(min_seeds) if s not in grid[lr]]
    return extra


# --- a store seeded from a stored outcome -------------------------------------------------------------------

def seed_store(out: Path, outcome: Path, below) -> Path:
    """Write the stored ``outcome``'s cells (and alignment records) of widths below ``below`` to
    ``out/prior.json``, refusing an outcome of another claim or one without those cells."""
    raw = json.loads(Path(outcome).read_text())
    if raw.get("analysis", {}).get("gap") is not True or "cells" not in raw:
        raise ReproduceError(f"{outcome}: not a stored gap outcome with its cells")
    cells = [c for c in raw["cells"] if c["scale"] < below]
    if not cells:
        raise ReproduceError(f"{outcome}: no cell below width {below}")
    prior = {"name": raw["name"], "scale": raw["scale"], "source": shown_path(outcome, out), "cells": cells,
             "alignment": [a for a in raw.get("alignment", []) if a["scale"] < below]}
    text, path = json.dumps(_finite(prior), indent=1) + "\n", Path(out) / PRIOR
    if path.is_file() and path.read_text() != text:  # the store's cells were chosen from that prior
        raise ReproduceError(f"{path} exists and holds other cells: a seeded store keeps its prior")
    Path(out).mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    write_text(path, text)
    if new:  # the claim's clock goes on from the time its cells took
        write_json(Path(out) / FILE, {"seconds": _seconds(Path(out) / FILE) + float(raw.get("seconds", 0.0))})
    return path


def read_prior(out: Path) -> dict:
    path = Path(out) / PRIOR
    return json.loads(path.read_text()) if path.is_file() else {}


def prior_cells(out: Path, name: str, scale: str) -> list[dict]:
    """The cells ``out/prior.json`` holds (none without one); a prior of another claim or scale is refused."""
    prior = read_prior(out)
    if prior and (prior["name"], prior["scale"]) != (name, scale):
        raise ReproduceError(f"{Path(out) / PRIOR} holds {prior['name']} at scale {prior['scale']}, "
                             f"not {name} at {scale}")
    return prior.get("cells", [])


def prior_alignment(out: Path) -> list[dict]:
    return read_prior(out).get("alignment", [])
