"""`moga tune`: proxies below the target, an lr sweep on each on the resumable store, the transfer decision among
them, and the rate for the target with the regret it is predicted to cost there.

The sweep is a plain ``moga sweep`` on ``OUT`` (``OUT/sweep.db``, ``OUT/cells``): one curve per proxy (the width
key is the scale axis; depth, steps and heads follow it as dependent axes), run locally or on Ray by the sweep's
executor. After the grid's one seed, seeds are added on the decisive rates (:func:`moga.sweep.seeds.more_seeds`)
while the budget lasts, and a grid whose optimum lies on its edge grows one rate that way. Re-running resumes:
finished cells are never trained again. Results: ``OUT/tune.json``, ``OUT/tune.md``, ``OUT/target.yaml``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from moga.experiments.tune.knobs import TuneError, model_section, resolve_knobs, target_size
from moga.experiments.tune.plan import MIN_STEPS, Size, config_at, measure_size, plan_tuning, rungs, within_budget
from moga.experiments.tune.predict import MAX_EXTRAPOLATION, predict
from moga.experiments.tune.report import render, snippets
from moga.optim.registry import OPTIMIZERS, UNIT_STEP_OPTIMIZERS
from moga.sweep.executor import run_sweep
from moga.sweep.report import analyze
from moga.sweep.report.decision import MAX_SEEDS_QUOTED
from moga.sweep.report.summary import json_safe
from moga.sweep.results import records
from moga.sweep.seeds import more_seeds, stored_include
from moga.sweep.spec import Sweep, SweepError
from moga.sweep.store import SweepStore
from moga.train.config import ConfigError, RunConfig, apply_overrides, read_config_file
from moga.files import write_json, write_text
from moga.verdicts import DOES_NOT_TRANSFER, TRANSFERS

GROUP = ("optimizer", "scaling")
# Six rates a factor 2 apart around each optimizer's default rate; an optimum on an edge grows the grid.
DEFAULT_GRIDS = {"moga": (-7, -2), "muon": (-8, -3), "adamw-scaled": (-9, -4), "adamw": (-12, -7), "sgd": (-9, -4)}
MAX_EXTENSIONS = 4


def base_config(config: Any, overrides: Sequence[str] = ()) -> dict:
    if isinstance(config, RunConfig):
        data = config.to_dict()
    elif isinstance(config, (str, Path)):
        data = read_config_file(config)
    elif isinstance(config, dict):
        data = copy.deepcopy(config)
    else:
        raise TuneError(f"config must be a moga train config (a file, a dict or a RunConfig), got {type(config).__name__}")
    return apply_overrides(data, list(overrides))


def prepare(config: Any, model: Any = None, width: int | None = None, depth: int | None = None,
            optimizer: str | None = None, depth_scaling: str = "auto", overrides: Sequence[str] = ()):
    """(base config dict, knobs, target, notes): the training setup with the model and optimizer in it."""
    base = base_config(config, overrides)
    raw_model = dict(base.get("model") or {})
    base["model"] = section = model_section(raw_model, model)
    knobs = resolve_knobs(section)
    target = target_size(section, knobs, width, depth)
    optim = dict(base.get("optim") or {})
    if optimizer is not None and optimizer != optim.get("name"):
        if optimizer not in OPTIMIZERS:
            raise TuneError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        optim = {"name": optimizer, **{k: v for k, v in optim.items() if k == "weight_decay"}}
    optim.setdefault("name", "moga")
    optim.pop("lr", None)
    base["optim"] = optim
    notes = list(knobs.notes)
    if depth_scaling not in ("auto", "none", "inverse_depth"):
        raise TuneError(f"depth_scaling must be auto, none or inverse_depth, got {depth_scaling!r}")
    if depth_scaling != "auto":
        section["depth_scaling"] = depth_scaling
    elif "depth_scaling" not in raw_model or model is not None and "depth_scaling" not in section:
        section["depth_scaling"] = "inverse_depth" if optim["name"] in UNIT_STEP_OPTIMIZERS else "none"
        notes.append(f"depth scaling {section['depth_scaling']}" + (
            f" (alpha = {section.get('k_base', 2):g}/K: {optim['name']} takes unit steps, so the depth paper's "
            "scaling applies)" if section["depth_scaling"] == "inverse_depth" else
            f" ({optim['name']} takes no unit steps: the depth paper's scaling does not apply)"))
    try:
        measure_size(base, knobs, *target)
    except TuneError as e:
        if section.get("depth_scaling") == "inverse_depth" and depth_scaling == "auto":
            section["depth_scaling"] = "none"
            notes.append(f"depth scaling none: moga could not scale this model's residual branches ({e})")
            measure_size(base, knobs, *target)
        else:
            raise
    return base, knobs, target, notes


def lr_grid(optimizer: str, lrs: Sequence[float] | None) -> list[float]:
    if lrs:
        values = sorted(float(v) for v in lrs)
        if len(values) < 3 or any(v <= 0 for v in values):
            raise TuneError(f"the lr grid needs at least 3 positive rates, got {list(lrs)}")
        return values
    lo, hi = DEFAULT_GRIDS.get(optimizer, DEFAULT_GRIDS["moga"])
    return [2.0**k for k in range(lo, hi + 1)]


def sweep_dict(base: dict, knobs, proxies: list[Size], target_steps: int, lrs: list[float],
               include: list[dict]) -> dict:
    wkey = f"model.{knobs.width_key}"
    follow: dict[str, dict] = {}
    for p in proxies:
        cfg = config_at(base, knobs, p.width, p.depth, p.steps, target_steps)
        values = {f"model.{k}": v for k, v in knobs.keys(p.width, p.depth).items() if k != knobs.width_key}
        values["train.steps"] = p.steps
        for section, key in (("eval", "final_window"), ("schedule", "warmup_steps")):
            if isinstance(cfg.get(section, {}).get(key), int):
                values[f"{section}.{key}"] = cfg[section][key]
        for k, v in values.items():
            follow.setdefault(k, {})[str(p.width)] = [v]
    axes = {wkey: [p.width for p in proxies], **{k: {"by": wkey, "values": v} for k, v in follow.items()},
            "optim.lr": lrs}
    base = copy.deepcopy(base)
    base.setdefault("train", {})["epochs"] = None
    return {"name": "tune", "base": base, "axes": axes, "scale_key": wkey, "include": include}


class Budget:
    """FLOPs (and estimated seconds) of a proxy's cell; what the settled cells and a list of cells cost."""

    def __init__(self, proxies: list[Size], wkey: str, flops: float | None, seconds: float | None, workers: int):
        self.by_width = {p.width: p for p in proxies}
        self.wkey, self.flops, self.seconds, self.workers = wkey, flops, seconds, workers

    def cost(self, cells: list[dict]) -> tuple[float, float]:
        sizes = [self.by_width[c[self.wkey]] for c in cells if c.get(self.wkey) in self.by_width]
        return sum(s.flops for s in sizes), sum(s.seconds for s in sizes) / self.workers

    def allows(self, cells: list[dict]) -> bool:
        return within_budget(*self.cost(cells), self.flops, self.seconds)


class ProxySweep:
    """The proxies' lr sweep on the store at ``out``: built from a grid and the seed cells included, trained and
    analysed into the one panel the decision reads."""

    def __init__(self, base: dict, knobs, plan, out: Path, max_regret: float, **run_options):
        self.base, self.knobs, self.plan, self.out, self.max_regret = base, knobs, plan, out, max_regret
        self.wkey = f"model.{knobs.width_key}"
        self.run_options = run_options  # run_sweep's workers, executor, ray_address, progress

    def proxy_sweep(self, grid: list[float], include: list[dict]) -> Sweep:
        return Sweep.from_dict(sweep_dict(self.base, self.knobs, self.plan.proxies, self.plan.target.steps, grid,
                                          include))

    def checked_sweep(self, grid: list[float], include: list[dict]) -> Sweep:
        """The sweep, a config it cannot build said in one line."""
        try:
            return self.proxy_sweep(grid, include)
        except (SweepError, ConfigError) as e:
            raise TuneError(str(e).splitlines()[-1].strip()) from None

    def train_cells(self, sweep: Sweep) -> dict:
        return run_sweep(sweep, self.out, **self.run_options, retry_failed=True)

    def tuning_panel(self):
        """(the store's rows, their panel)."""
        rows = records(SweepStore(self.out))
        return rows, analyze(rows, scale_key=self.wkey, group_keys=GROUP, max_regret=self.max_regret)[0]


def _trained(store: SweepStore) -> int:
    return sum(e["event"] in ("claim", "retake") for e in store.events()) if store.exists() else 0


def stored_grid(store: SweepStore, grid: list[float]) -> list[float]:
    """The grid with the rates an earlier run extended it by."""
    if store.exists():
        stored = store.definition()["spec"]["axes"].get("optim.lr")
        if isinstance(stored, list):
            return sorted(set(grid) | {float(v) for v in stored})
    return grid


def tune(config: Any, *, out: str | Path = "runs/tune", model: Any = None, width: int | None = None,
         depth: int | None = None, optimizer: str | None = None, budget_flops: float | None = None,
         budget_seconds: float | None = None, lrs: Sequence[float] | None = None, regime: str = "auto",
         min_steps: int = MIN_STEPS, proxies: list[tuple[int, int]] | None = None, depth_every: int = 2,
         depth_scaling: str = "auto", workers: int = 1, executor: str = "local", ray_address: str | None = None,
         min_seeds: int = 3, max_seeds: int = 6, max_regret: float = 0.02, overrides: Sequence[str] = (),
         progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Tune the learning rate for the target on proxies; returns (and writes to ``out/tune.json``) the result.

    ``config``: the training setup (a ``moga train`` config file, dict or RunConfig); ``model``: None (the
    config's), a registered name, ``package.module:factory`` (taking width and depth) or a Hugging Face config
    (dict, PretrainedConfig or JSON file); ``width``/``depth``: the target (default: the config's model);
    ``budget_flops`` / ``budget_seconds``: the tuning budget (estimated, :mod:`moga.experiments.reproduce.cost`).
    Bad input raises :class:`TuneError` with one line. Re-running with the same arguments resumes."""
    out = Path(out)
    base, knobs, target, notes = prepare(config, model, width, depth, optimizer, depth_scaling, overrides)
    store = SweepStore(out)
    grid = stored_grid(store, lr_grid(base["optim"]["name"], lrs))  # a grid an earlier run extended keeps its rates
    p = plan_tuning(base, knobs, target, len(grid), budget_flops=budget_flops, budget_seconds=budget_seconds,
                    regime=regime, min_steps=min_steps, min_seeds=min_seeds, workers=workers,
                    depth_every=depth_every, proxies=proxies)
    for line in notes + p.reasons:
        log(line)
    ps = ProxySweep(base, knobs, p, out, max_regret, workers=workers, executor=executor, ray_address=ray_address,
                    progress=progress)
    budget = Budget(p.proxies, ps.wkey, budget_flops, budget_seconds, workers)
    trained_before = _trained(store)
    grid, rows, panel, stops = settle_sweep(ps, budget, grid, min_seeds, max_seeds, log)
    result = judge(base, knobs, p, panel, rows, ps.wkey, grid, max_regret, stops, out)
    result["cells_trained"] = _trained(SweepStore(out)) - trained_before
    result["notes"] = notes
    write_json(out / "tune.json", json_safe(result))
    write_text(out / "tune.md", render(result))
    log(render(result, short=True))
    return result


def settle_sweep(ps: ProxySweep, budget: Budget, grid: list[float], min_seeds: int, max_seeds: int,
                 log: Callable[[str], None]):
    """Run the sweep, growing the grid past optima on its edges and adding the seeds the decision wants while the
    budget lasts; (grid, rows, panel, why it stopped short)."""
    out, wkey = ps.out, ps.wkey
    include = stored_include(out, lambda inc: ps.proxy_sweep(grid, inc))
    extensions, stops = 0, []
    while True:
        sweep = ps.checked_sweep(grid, include)
        log(f"sweep: {len(sweep.cells)} cells on {len(ps.plan.proxies)} proxies -> {out}")
        counts = ps.train_cells(sweep)
        if counts.get("failed"):
            errors = [c for c in SweepStore(out).cells() if c["status"] == "failed" and c["error"]]
            why = errors[0]["error"].strip().splitlines()[-1] if errors else "see the store"
            raise TuneError(f"{counts['failed']} proxy cells failed ({why}); `moga sweep status {out}` shows them")
        rows, panel = ps.tuning_panel()
        edges = [c for c in panel.curves if c.status != "ok"]
        if edges:
            grown, stop = grow_past_edges(grid, edges, extensions, budget, sweep.cells, ps)
            if stop:
                stops.append(stop)
                break
            log(f"an optimum is on the grid's edge: the grid grows to {', '.join(f'{v:g}' for v in grown if v not in grid)}")
            grid, extensions = sorted(set(grid) | set(grown)), extensions + 1
            continue
        params = {c["id"]: c["params"] for c in SweepStore(out).cells()}
        extra = more_seeds([panel], rows, wkey, GROUP, params.__getitem__, min_seeds, max_seeds)
        if not extra:
            break
        affordable = affordable_seeds(budget, sweep.cells, extra)
        if not affordable:
            stops.append(f"the budget ends before the seeds the decision wants ({len(extra)} more cells)")
            break
        log(f"seeds: {len(affordable)} more cells where the decision is close")
        include = include + affordable
        if len(affordable) < len(extra):
            stops.append(f"the budget ran {len(extra) - len(affordable)} seed cells short of what the decision wants")
            ps.train_cells(ps.proxy_sweep(grid, include))
            rows, panel = ps.tuning_panel()
            break
    return grid, rows, panel, stops


def grow_past_edges(grid: list[float], edges, extensions: int, budget: Budget, cells: list[dict],
                    ps: ProxySweep) -> tuple[list[float] | None, str | None]:
    """(the grid grown one rate past each optimum on its edge, None) or (None, why it cannot grow)."""
    grown = _grow(grid, edges)
    if grown is None or extensions >= MAX_EXTENSIONS:
        return None, "an optimum stays on the lr grid's edge: give a wider grid (lrs)"
    new = [{ps.wkey: p_.width, "optim.lr": lr} for p_ in ps.plan.proxies for lr in grown if lr not in grid]
    if not budget.allows([*cells, *new]):
        return None, "the budget ends before the lr grid could grow past an optimum on its edge"
    return grown, None


def affordable_seeds(budget: Budget, cells: list[dict], extra: list[dict]) -> list[dict]:
    """The seed cells, in order, that the budget still holds after ``cells``."""
    affordable = []
    for cell in extra:
        if budget.allows([*cells, *affordable, cell]):
            affordable.append(cell)
    return affordable


def _grow(grid: list[float], edges) -> list[float] | None:
    """The grid with one more rate past each edge that holds an optimum (log-spaced as it is)."""
    if len(grid) < 2:
        return None
    step = math.log2(grid[1] / grid[0])
    out = list(grid)
    for c in edges:
        if c.edge in ("lower", "both") or c.status == "all diverged":
            out.append(grid[0] / 2**step)
        if c.edge in ("upper", "both"):
            out.append(grid[-1] * 2**step)
    return sorted(set(out))


def tuning_record(base: dict, p, panel, rows: list[dict], wkey: str, grid: list[float], max_regret: float) -> dict:
    """What the tuning ran and found, before the rate: plan, grid, the panel's verdict, each proxy's curve, FLOPs."""
    proxies, target = p.proxies, p.target
    by_width = {s.width: s for s in proxies}
    counted = [r for r in rows if r.get(wkey) in by_width]
    tuning_flops = sum(by_width[r[wkey]].flops for r in counted)
    per_proxy = max(sum(r.get(wkey) == w for r in counted) for w in by_width)
    at_target = per_proxy * target.flops
    return {
        "target": target.to_dict(), "plan": p.to_dict(), "model": base["model"].get("name"),
        "optimizer": base["optim"]["name"], "depth_scaling": base["model"].get("depth_scaling", "none"),
        "lr_grid": grid, "decision": {"verdict": panel.verdict, "line": panel.verdict_line,
                                      "decision": None if panel.decision is None else asdict(panel.decision)}, "max_regret": max_regret,
        "flops": {"tuning": tuning_flops, "at_target": at_target, "saved": 1 - tuning_flops / at_target,
                  "cells": len(counted), "cells_per_proxy_at_target": per_proxy},
        "proxies": [{**s.to_dict(), "optimum_lr": c.refined_lr, "best_lr": c.best_lr, "status": c.status,
                     "seeds": max(c.n_seeds), "curve": {"lrs": c.lrs, "loss": c.loss, "n_seeds": c.n_seeds}}
                    for s, c in zip(proxies, panel.curves)],
    }


def judge(base: dict, knobs, p, panel, rows: list[dict], wkey: str, grid: list[float], max_regret: float,
          stops: list[str], out: Path) -> dict:
    """The rate, the predicted regret, whether extrapolating is justified, what to run next, FLOPs, snippets."""
    proxies, target = p.proxies, p.target
    result = tuning_record(base, p, panel, rows, wkey, grid, max_regret)
    trusted = len(panel.curves) == len(proxies) and all(c.trusted for c in panel.curves)
    if not trusted:
        result.update(rate=None, prediction=None, justified=False,
                      why=stops or ["a proxy's optimum is not inside its lr grid"],
                      next=["give a wider lr grid (lrs) so that every proxy's optimum lies inside it"])
        return result
    pred = predict(panel.curves, [math.log2(s.params) for s in proxies], math.log2(target.params))
    result["prediction"] = pred.to_dict()
    result["rate"] = pred.lr
    why, nxt = rate_doubts(base, knobs, p, panel, pred, min(s["seeds"] for s in result["proxies"]), max_regret)
    why = stops + why
    result.update(justified=not why, why=why or [
        f"the proxies transfer ({panel.verdict_line}); the predicted regret at the target is at most "
        f"{100 * pred.regret_interval[1]:.1f}% (95% upper bound), within {100 * max_regret:g}%; the target lies "
        f"{pred.extrapolation:.2f}x the proxies' span beyond the largest"], next=nxt)
    cfg = config_at(base, knobs, target.width, target.depth)
    cfg.setdefault("optim", {})["lr"] = pred.lr
    write_text(out / "target.yaml", yaml.safe_dump(cfg, sort_keys=False))
    result["snippets"] = snippets(cfg, out / "target.yaml")
    return result


def rate_doubts(base: dict, knobs, p, panel, pred, seeds: int, max_regret: float) -> tuple[list[str], list[str]]:
    """(why the predicted rate is not justified, what to run next): empty lists when it is. ``seeds``: the
    fewest seeds at a proxy."""
    why, nxt = [], []
    verdict = panel.verdict
    if verdict == DOES_NOT_TRANSFER:
        why.append(f"the optimum moves among the proxies ({panel.verdict_line})")
    elif verdict != TRANSFERS:
        why.append(f"the proxies' transfer is not decided ({panel.verdict_line})")
    bent = pred.bend_interval is not None and (pred.bend_interval[0] > 0 or pred.bend_interval[1] < 0)
    too_wide = pred.regret_interval is not None and pred.regret_interval[1] > max_regret
    if pred.regret_interval is None:
        why.append("no seed spread at some proxy: the predicted regret has no interval")
        nxt.append("more seeds: at least 3 at each proxy's decisive rates (min_seeds)")
    elif too_wide:
        why.append(f"the predicted regret's upper bound {100 * pred.regret_interval[1]:.1f}% exceeds "
                   f"{100 * max_regret:g}%")
        need = math.ceil(seeds * pred.regret_interval[1] / max_regret)
        if need <= MAX_SEEDS_QUOTED:
            nxt.append(f"more seeds: about {need} at each proxy's decisive rates (the upper bound shrinks about as "
                       "1/seeds): max_seeds")
    if bent:
        why.append(f"the optimum bends across the proxies (the middle one sits {pred.bend:+.2f} log2 off the "
                   f"line, 95% interval [{pred.bend_interval[0]:+.2f}, {pred.bend_interval[1]:+.2f}])")
    if pred.extrapolation > MAX_EXTRAPOLATION:
        why.append(f"the target lies {pred.extrapolation:.1f}x the proxies' span of log size beyond the largest "
                   f"(at most {MAX_EXTRAPOLATION:g}x is extrapolated)")
    if pred.extrapolation > MAX_EXTRAPOLATION or verdict == DOES_NOT_TRANSFER or bent or too_wide:
        nxt.append(larger_proxy_advice(base, knobs, p))
    return why, nxt


def larger_proxy_advice(base: dict, knobs, p) -> str:
    """The next rung above the largest proxy to tune on, or the target itself when none lies between."""
    proxies, target = p.proxies, p.target
    ladder = rungs((target.width, target.depth), knobs, p.depth_every)
    up = [r for r in ladder if r[0] > proxies[-1].width]
    if up:
        bigger = measure_size(base, knobs, *up[-1], proxies[-1].steps if p.regime == "steps" else None,
                              target.steps)
        return f"a larger proxy: {bigger.label} ({bigger.flops:.3g} FLOPs a cell), which shortens the extrapolation"
    return (f"tune at the target itself: no rung lies between the largest proxy and the target "
            f"({target.flops:.3g} FLOPs a cell)")
