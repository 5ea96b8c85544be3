"""Which proxies to tune on: sizes on a ladder below the target, trained in one regime, within a budget.

Rung k of the ladder halves the target's width k times and its depth every ``depth_every`` rungs (never below
``min(2, target depth)``); a rung exists when its width is a whole multiple of the model's head dimension (x query
groups). The proxies are two consecutive rungs, the largest pair whose tuning fits the budget, and the rung below
them when the budget still holds it: the closest proxies fit, for the shortest extrapolation.

Regimes. ``tokens``: every proxy trains at the target's tokens (examples) per parameter, at the target's batch, so
the proxies and the target lie on one line of constant tokens per parameter. ``steps``: every proxy trains the
target's steps at the target's batch (the papers' regime: transfer across width and depth at a fixed horizon).
``auto`` takes tokens unless a proxy would get fewer than ``min_steps`` steps there (a schedule that short does
not mean what it means at the target), then steps, and says so.

A proxy's planned cost is its lr grid plus the seeds the decision will want at the least (3 decisive rates x
``min_seeds - 1``), at the FLOPs of :func:`moga.experiments.reproduce.cost.cell_cost`; time budgets use the
same estimate's seconds over the workers.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

from moga.experiments.reproduce.cost import DECISIVE_RATES, cell_cost
from moga.experiments.tune.knobs import Knobs, TuneError
from moga.train.config import ConfigError, build_config

REGIMES = ("auto", "tokens", "steps")
MIN_STEPS = 100


@dataclass
class Size:
    width: int
    depth: int
    params: int
    steps: int
    flops: float  # one training run
    seconds: float  # one training run on one core, estimated

    @property
    def label(self) -> str:
        return f"{self.width}x{self.depth}"

    def to_dict(self) -> dict:
        return {**asdict(self), "label": self.label}


def config_at(base: dict, knobs: Knobs, width: int, depth: int, steps: int | None = None,
              target_steps: int | None = None) -> dict:
    """The training config (a dict) of the model at (width, depth), trained ``steps`` steps (None: as given).
    A final window or warmup given in steps shrinks with the run (at least one step)."""
    data = copy.deepcopy(base)
    data.setdefault("model", {}).update(knobs.keys(width, depth))
    if steps is not None:
        train = data.setdefault("train", {})
        train["steps"], train["epochs"] = steps, None
        if target_steps:
            for section, key in (("eval", "final_window"), ("schedule", "warmup_steps")):
                value = data.get(section, {}).get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    data[section][key] = max(1, round(value * steps / target_steps))
    return data


def measure_size(base: dict, knobs: Knobs, width: int, depth: int, steps: int | None = None,
            target_steps: int | None = None) -> Size:
    try:
        cost = cell_cost(build_config(config_at(base, knobs, width, depth, steps, target_steps)))
    except (ConfigError, ValueError) as e:
        raise TuneError(f"the model at {width}x{depth} does not build: {str(e).splitlines()[0]}") from None
    return Size(width, depth, cost["params"], cost["steps"], cost["flops"], cost["seconds"])


def per_step(base: dict) -> int:
    """Examples (text: tokens) per optimizer step."""
    cfg = build_config(base)
    if cfg.train.batch_size == "full":
        raise TuneError("train.batch_size 'full' has no tokens per step to keep: give a batch size")
    return cfg.train.batch_size * (cfg.data.block_size if cfg.data.kind == "text" else 1)


def rungs(target: tuple[int, int], knobs: Knobs, depth_every: int = 2) -> list[tuple[int, int]]:
    """(width, depth) of rungs 1, 2, ... below the target, largest first, while the width stays valid."""
    width, depth = target
    floor = min(2, depth)
    out = []
    for k in range(1, 64):
        if width % 2**k or (width >> k) % knobs.multiple or (width >> k) < max(knobs.multiple, 8):
            break
        halvings = 0 if depth_every <= 0 else math.ceil(k / depth_every)
        out.append((width >> k, max(floor, depth >> halvings)))
    return out


@dataclass
class Plan:
    regime: str
    reasons: list[str]
    target: Size
    proxies: list[Size]  # ascending
    planned_cells: list[int]
    planned_flops: float
    planned_seconds: float  # on ``workers`` cores
    budget_flops: float | None
    budget_seconds: float | None
    depth_every: int = 2

    def to_dict(self) -> dict:
        return {"regime": self.regime, "reasons": self.reasons, "target": self.target.to_dict(),
                "proxies": [p.to_dict() for p in self.proxies], "planned_cells": self.planned_cells,
                "planned_flops": self.planned_flops, "planned_seconds": self.planned_seconds,
                "budget_flops": self.budget_flops, "budget_seconds": self.budget_seconds}


def planned_cells(n_lrs: int, min_seeds: int) -> int:
    return n_lrs + DECISIVE_RATES[0] * max(0, min_seeds - 1)


def plan_tuning(base: dict, knobs: Knobs, target: tuple[int, int], n_lrs: int, *, budget_flops: float | None = None,
         budget_seconds: float | None = None, regime: str = "auto", min_steps: int = MIN_STEPS, min_seeds: int = 3,
         workers: int = 1, depth_every: int = 2, proxies: list[tuple[int, int]] | None = None) -> Plan:
    if regime not in REGIMES:
        raise TuneError(f"regime must be one of {', '.join(REGIMES)}, got {regime!r}")
    if budget_flops is None and budget_seconds is None:
        raise TuneError("give a tuning budget: FLOPs (--budget-flops) or wall time (--budget-time)")
    t = measure_size(base, knobs, *target)
    tokens = per_step(base)
    tpp = t.steps * tokens / t.params
    ladder = [tuple(p) for p in proxies] if proxies else rungs(target, knobs, depth_every)
    if proxies:
        for w, d in ladder:
            if w > target[0] or d > target[1] or (w, d) == tuple(target):
                raise TuneError(f"the target {target[0]}x{target[1]} is not larger than proxy {w}x{d}: a proxy must "
                                "be no wider and no deeper than the target, and not the target itself")
            if w % knobs.multiple:
                raise TuneError(f"proxy width {w} is not a multiple of {knobs.multiple} (head_dim x query groups)")
        ladder = sorted(ladder, reverse=True)
    if len(ladder) < 2:
        raise TuneError(f"the target {target[0]}x{target[1]} is too small for two proxies below it (widths halve and "
                        f"stay multiples of {knobs.multiple}): give a larger target")
    cells = planned_cells(n_lrs, min_seeds)
    reasons = [f"target {t.width}x{t.depth}: {t.params:,} parameters, {t.steps} steps of {tokens} "
               f"{'tokens' if build_config(base).data.kind == 'text' else 'examples'}: "
               f"{tpp:.3g} per parameter"]

    def sizes(mode: str, pair: list[tuple[int, int]]) -> list[Size]:
        out = []
        for w, d in pair:
            steps = t.steps
            if mode == "tokens":
                params = measure_size(base, knobs, w, d).params
                steps = max(1, math.ceil(tpp * params / tokens))
            out.append(measure_size(base, knobs, w, d, steps, t.steps))
        return out

    def fits(chosen: list[Size]) -> bool:
        flops = sum(s.flops for s in chosen) * cells
        seconds = sum(s.seconds for s in chosen) * cells / workers
        return (budget_flops is None or flops <= budget_flops) and (budget_seconds is None or seconds <= budget_seconds)

    def select(mode: str) -> list[Size] | None:
        if proxies:  # the user's own: all of them, or none
            given = sizes(mode, ladder)
            return given if fits(given) else None
        for k in range(len(ladder) - 1):
            pair = sizes(mode, ladder[k:k + 2])
            if fits(pair):
                if k + 2 < len(ladder):
                    three = pair + sizes(mode, ladder[k + 2:k + 3])
                    if fits(three):
                        return three
                return pair
        return None

    mode = "tokens" if regime in ("auto", "tokens") else "steps"
    chosen = select(mode)
    if regime == "auto" and chosen is not None and min(s.steps for s in chosen) < min(min_steps, t.steps):
        short = min(chosen, key=lambda s: s.steps)
        reasons.append(f"regime steps: at {tpp:.3g} tokens per parameter proxy {short.label} would train "
                       f"{short.steps} steps, too short for the schedule to mean what it means at the target; "
                       f"every proxy trains the target's {t.steps} steps at its batch instead (the papers' regime: "
                       "width and depth transfer at a fixed horizon)")
        mode, chosen = "steps", select("steps")
    elif regime == "auto" and chosen is None:
        mode, chosen = "steps", None  # the budget is the problem: said below
    elif mode == "tokens":
        reasons.append(f"regime tokens: every proxy trains at the target's {tpp:.3g} tokens per parameter, at its "
                       "batch, so the proxies and the target lie on one line of constant tokens per parameter")
    else:
        reasons.append(f"regime steps: every proxy trains the target's {t.steps} steps at its batch (the papers' "
                       "regime: width and depth transfer at a fixed horizon)")
    if chosen is None:
        cheapest = sizes("tokens" if regime == "tokens" else "steps", ladder[-2:])
        need = sum(s.flops for s in cheapest) * cells
        secs = sum(s.seconds for s in cheapest) * cells / workers
        given = (f"{budget_flops:.3g} FLOPs" if budget_flops is not None else "") + \
            (" and " if budget_flops is not None and budget_seconds is not None else "") + \
            (f"{budget_seconds:.0f} s" if budget_seconds is not None else "")
        raise TuneError(f"budget {given} is too small for two proxies: the two smallest "
                        f"({', '.join(s.label for s in cheapest)}) need {need:.3g} FLOPs (about {secs:.0f} s on "
                        f"{workers} core(s)) for {n_lrs} rates and the seeds; give at least that, or a shorter run")
    chosen = sorted(chosen, key=lambda s: (s.width, s.depth))
    flops = sum(s.flops for s in chosen) * cells
    seconds = sum(s.seconds for s in chosen) * cells / workers
    largest = chosen[-1]
    reasons.append(f"proxies {', '.join(s.label for s in chosen)}: the largest "
                   f"{'given' if proxies else 'rungs of the ladder (width halves each rung, depth every ' + str(depth_every) + ')'}"
                   f" that fit the budget with {n_lrs} rates and {min_seeds} seeds at the decisive rates: "
                   f"{flops:.3g} FLOPs, about {seconds / 60:.1f} min on {workers} core(s); the target is "
                   f"{t.params / largest.params:.3g}x the largest proxy's parameters")
    return Plan(mode, reasons, t, chosen, [cells] * len(chosen), flops, seconds, budget_flops, budget_seconds,
                depth_every)
