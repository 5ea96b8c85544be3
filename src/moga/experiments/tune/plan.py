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


def within_budget(flops: float, seconds: float, budget_flops: float | None, budget_seconds: float | None) -> bool:
    """Whether a cost fits a budget; a bound that is None does not bind."""
    return (budget_flops is None or flops <= budget_flops) and (budget_seconds is None or seconds <= budget_seconds)


@dataclass
class PlanBudget:
    """The tuning budget (either bound may be None) and what tuning a list of proxies costs against it."""
    flops: float | None
    seconds: float | None
    cells: int  # planned cells per proxy
    workers: int

    def plan_cost(self, chosen: list[Size]) -> tuple[float, float]:
        """FLOPs and seconds (on ``workers`` cores) of tuning ``chosen``."""
        return sum(s.flops for s in chosen) * self.cells, sum(s.seconds for s in chosen) * self.cells / self.workers

    def affords(self, chosen: list[Size]) -> bool:
        return within_budget(*self.plan_cost(chosen), self.flops, self.seconds)


@dataclass
class ProxySizer:
    """Sizes proxies against the target: at its tokens per parameter (``tokens``) or at its steps (``steps``)."""
    base: dict
    knobs: Knobs
    target: Size
    tokens: int  # per step
    tpp: float  # the target's tokens per parameter

    def sizes_at(self, mode: str, pair: list[tuple[int, int]]) -> list[Size]:
        out = []
        for w, d in pair:
            steps = self.target.steps
            if mode == "tokens":
                params = measure_size(self.base, self.knobs, w, d).params
                steps = max(1, math.ceil(self.tpp * params / self.tokens))
            out.append(measure_size(self.base, self.knobs, w, d, steps, self.target.steps))
        return out


def given_ladder(proxies: list[tuple[int, int]], target: tuple[int, int], knobs: Knobs) -> list[tuple[int, int]]:
    """The user's proxies, checked to lie below the target at valid widths, largest first."""
    ladder = [tuple(p) for p in proxies]
    for w, d in ladder:
        if w > target[0] or d > target[1] or (w, d) == tuple(target):
            raise TuneError(f"the target {target[0]}x{target[1]} is not larger than proxy {w}x{d}: a proxy must "
                            "be no wider and no deeper than the target, and not the target itself")
        if w % knobs.multiple:
            raise TuneError(f"proxy width {w} is not a multiple of {knobs.multiple} (head_dim x query groups)")
    return sorted(ladder, reverse=True)


def select_proxies(sizer: ProxySizer, budget: PlanBudget, ladder: list[tuple[int, int]], mode: str,
                   given: bool) -> list[Size] | None:
    """The largest two consecutive rungs that fit, with the rung below when it fits too (given: all or none)."""
    if given:  # the user's own: all of them, or none
        chosen = sizer.sizes_at(mode, ladder)
        return chosen if budget.affords(chosen) else None
    for k in range(len(ladder) - 1):
        pair = sizer.sizes_at(mode, ladder[k:k + 2])
        if budget.affords(pair):
            if k + 2 < len(ladder):
                three = pair + sizer.sizes_at(mode, ladder[k + 2:k + 3])
                if budget.affords(three):
                    return three
            return pair
    return None


def choose_regime(sizer: ProxySizer, budget: PlanBudget, ladder: list[tuple[int, int]], regime: str,
                  min_steps: int, given: bool, reasons: list[str]) -> tuple[str, list[Size] | None]:
    """(mode, proxies or None when none fit) in the regime asked for, ``auto`` resolved; the reason appended."""
    t, tpp = sizer.target, sizer.tpp
    mode = "tokens" if regime in ("auto", "tokens") else "steps"
    chosen = select_proxies(sizer, budget, ladder, mode, given)
    if regime == "auto" and chosen is not None and min(s.steps for s in chosen) < min(min_steps, t.steps):
        short = min(chosen, key=lambda s: s.steps)
        reasons.append(f"regime steps: at {tpp:.3g} tokens per parameter proxy {short.label} would train "
                       f"{short.steps} steps, too short for the schedule to mean what it means at the target; "
                       f"every proxy trains the target's {t.steps} steps at its batch instead (the papers' regime: "
                       "width and depth transfer at a fixed horizon)")
        mode, chosen = "steps", select_proxies(sizer, budget, ladder, "steps", given)
    elif regime == "auto" and chosen is None:
        mode, chosen = "steps", None  # the budget is the problem: said by the caller
    elif mode == "tokens":
        reasons.append(f"regime tokens: every proxy trains at the target's {tpp:.3g} tokens per parameter, at its "
                       "batch, so the proxies and the target lie on one line of constant tokens per parameter")
    else:
        reasons.append(f"regime steps: every proxy trains the target's {t.steps} steps at its batch (the papers' "
                       "regime: width and depth transfer at a fixed horizon)")
    return mode, chosen


def budget_too_small(sizer: ProxySizer, budget: PlanBudget, ladder: list[tuple[int, int]], regime: str,
                     n_lrs: int) -> TuneError:
    """The error that says what the two smallest proxies would need."""
    cheapest = sizer.sizes_at("tokens" if regime == "tokens" else "steps", ladder[-2:])
    need, secs = budget.plan_cost(cheapest)
    given = (f"{budget.flops:.3g} FLOPs" if budget.flops is not None else "") + \
        (" and " if budget.flops is not None and budget.seconds is not None else "") + \
        (f"{budget.seconds:.0f} s" if budget.seconds is not None else "")
    return TuneError(f"budget {given} is too small for two proxies: the two smallest "
                     f"({', '.join(s.label for s in cheapest)}) need {need:.3g} FLOPs (about {secs:.0f} s on "
                     f"{budget.workers} core(s)) for {n_lrs} rates and the seeds; give at least that, or a shorter run")


def plan_tuning(base: dict, knobs: Knobs, target: tuple[int, int], n_lrs: int, *,
                budget_flops: float | None = None, budget_seconds: float | None = None, regime: str = "auto",
                min_steps: int = MIN_STEPS, min_seeds: int = 3, workers: int = 1, depth_every: int = 2,
                proxies: list[tuple[int, int]] | None = None) -> Plan:
    if regime not in REGIMES:
        raise TuneError(f"regime must be one of {', '.join(REGIMES)}, got {regime!r}")
    if budget_flops is None and budget_seconds is None:
        raise TuneError("give a tuning budget: FLOPs (--budget-flops) or wall time (--budget-time)")
    t = measure_size(base, knobs, *target)
    tokens = per_step(base)
    sizer = ProxySizer(base, knobs, t, tokens, t.steps * tokens / t.params)
    ladder = given_ladder(proxies, target, knobs) if proxies else rungs(target, knobs, depth_every)
    if len(ladder) < 2:
        raise TuneError(f"the target {target[0]}x{target[1]} is too small for two proxies below it (widths halve and "
                        f"stay multiples of {knobs.multiple}): give a larger target")
    cells = planned_cells(n_lrs, min_seeds)
    budget = PlanBudget(budget_flops, budget_seconds, cells, workers)
    reasons = [f"target {t.width}x{t.depth}: {t.params:,} parameters, {t.steps} steps of {tokens} "
               f"{'tokens' if build_config(base).data.kind == 'text' else 'examples'}: "
               f"{sizer.tpp:.3g} per parameter"]
    mode, chosen = choose_regime(sizer, budget, ladder, regime, min_steps, bool(proxies), reasons)
    if chosen is None:
        raise budget_too_small(sizer, budget, ladder, regime, n_lrs)
    chosen = sorted(chosen, key=lambda s: (s.width, s.depth))
    flops, seconds = budget.plan_cost(chosen)
    largest = chosen[-1]
    reasons.append(f"proxies {', '.join(s.label for s in chosen)}: the largest "
                   f"{'given' if proxies else 'rungs of the ladder (width halves each rung, depth every ' + str(depth_every) + ')'}"
                   f" that fit the budget with {n_lrs} rates and {min_seeds} seeds at the decisive rates: "
                   f"{flops:.3g} FLOPs, about {seconds / 60:.1f} min on {workers} core(s); the target is "
                   f"{t.params / largest.params:.3g}x the largest proxy's parameters")
    return Plan(mode, reasons, t, chosen, [cells] * len(chosen), flops, seconds, budget_flops, budget_seconds,
                depth_every)
