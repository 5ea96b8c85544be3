"""The ablation: each value of a research sweep's ablated axes (``configs/research/ablation_*.yaml``) at its own
tuned lr against MOGA's default (the first value of each axis), per width, with the quality claim's comparison
(:mod:`moga.experiments.reproduce.stats`): relative seed-mean loss with a seed-bootstrap interval. Or against
the best baseline tuned at each width (``--baseline``, the gap: ``configs/research/gap_*.yaml``), or against a
named variant of the same sweep tuned at each width (``--against optim.name=muon``: the hybrids' table). Run as
``python -m moga.experiments.reproduce.quality ablation RUN_DIR [RUN_DIR ...]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from moga.experiments.reproduce.stats import (RESAMPLES, _finite, _mean, _pct, _same, best_lr, relative_interval,
                                              seed_losses)
from moga.files import write_json
from moga.sweep.results import records
from moga.sweep.store import SweepStore


def ablation(rows: list[dict], axes: dict[str, list], *, scale_key: str, lr_key: str = "optim.lr",
             seed_key: str = "seed", metric: str = "train_loss", resamples: int = RESAMPLES,
             baseline: list[dict] | None = None, against: dict | None = None) -> list[dict]:
    """Each combination of the ablated axes (every axis but scale, lr and seed) at its own tuned lr against the
    default (each axis' first value), per width: relative loss with its interval; ``moves`` when the interval
    excludes 0 (None when a side has one seed). With ``baseline`` (the rows of another sweep, e.g. AdamW's),
    each combination is compared with the baseline tuned at that width instead (the optimizer of lowest seed mean
    at its own best lr): the gap. With ``against`` ({axis: value}, e.g. ``{"optim.name": "muon"}``), with the
    variant of these rows that matches it, tuned at that width (over its lr and every choice ``against`` leaves
    open). A dependent axis with one value per value of its ``by`` axis follows that
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
    if against is not None:
        unknown = [k for k in against if k not in choice_keys + follower_keys]
        if unknown:
            raise ValueError(f"--against names {', '.join(unknown)}, which this sweep does not choose among; its "
                             f"choices: {', '.join(choice_keys + follower_keys)}")
    out = []
    for scale in sorted({r[scale_key] for r in rows}):
        tuned = []  # (variant, what it runs besides, its {lr: {seed: loss}}, its best lr) at this width
        for values, follows in variants:
            variant = dict(zip(choice_keys, values))
            grid = seed_losses(rows, {**variant, scale_key: scale}, lr_key, seed_key, metric)
            tuned.append((variant, follows, grid, best_lr(grid)))
        if baseline is None and against is None:
            reference = {"name": "default"}
            ref_grid = seed_losses(rows, {**default, scale_key: scale}, lr_key, seed_key, metric)
            ref_lr = best_lr(ref_grid)
        elif baseline is None:
            reference, ref_grid, ref_lr = _tuned_variant(tuned, against, choice_keys)
        else:
            reference, ref_grid, ref_lr = _tuned_baseline(baseline, scale_key, scale, lr_key, seed_key, metric)
        for variant, follows, grid, lr in tuned:
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


def _lowest(candidates):
    """The (label, grid, lr) of lowest seed mean at its own best lr (the first of equals); None when none has a
    finite one."""
    found = [c for c in candidates if c[2] is not None]
    return min(found, key=lambda c: _mean(c[1][c[2]].values())) if found else None


def _tuned_variant(tuned: list[tuple], against: dict, choice_keys: list[str]):
    """({name, lr, lr_on_edge}, its grid, its lr) of the variant matching ``against`` (over the variants' own
    values and what they run besides) of lowest seed mean at its own best lr. Its name is ``against``'s, with the
    choices that set it apart when several variants match (Muon with weight decay 0 and 0.1 is two variants;
    pooling them would let one's seed overwrite the other's)."""
    named = [({**variant, **follows}, grid, lr) for variant, follows, grid, lr in tuned]
    matching = [m for m in named if all(_same(m[0].get(k), value) for k, value in against.items())]
    name = ", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in against.items())
    best = _lowest(matching)
    if best is None:
        return {"name": name}, {}, None
    variant, grid, lr = best
    apart = [k for k in choice_keys
             if k not in against and len({json.dumps(m[0][k], sort_keys=True) for m in matching}) > 1]
    if apart:
        name += " (" + ", ".join(f"{k.split('.', 1)[-1]}={variant[k]}" for k in apart) + ")"
    return {"name": name, "lr": lr, "lr_on_edge": lr in (min(grid), max(grid))}, grid, lr


def _tuned_baseline(rows: list[dict], scale_key: str, scale, lr_key: str, seed_key: str, metric: str):
    """({name, lr, lr_on_edge}, its {lr: {seed: loss}}, its lr) of the optimizer of lowest seed mean at its own
    best lr at this width; the lr is None when no optimizer has a finite loss there."""
    names = sorted({r.get("optim.name") for r in rows if _same(r.get(scale_key), scale)}, key=str)
    grids = [(name, seed_losses(rows, {"optim.name": name, scale_key: scale}, lr_key, seed_key, metric))
             for name in names]
    best = _lowest([(name, grid, best_lr(grid)) for name, grid in grids])
    if best is None:
        return {"name": "baseline"}, {}, None
    name, grid, lr = best
    return {"name": name, "lr": lr, "lr_on_edge": lr in (min(grid), max(grid))}, grid, lr


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
