"""The verdict of a panel, and the plain sentences that state it.

- With every optimum inside its grid: the seed-interval decision of :mod:`moga.sweep.report.decision`.
  "transfers" needs the 95% intervals of the refined optimum's drift (at most ``max_drift_steps`` grid
  steps, or ``max_drift_log2`` log2 units on a grid that is not log-spaced) and of the regret of reusing
  the smallest scale's refined optimum (at most ``max_regret``, 2% by default) within their limits at
  every scale; "does not transfer" needs one of them confidently beyond; otherwise "inconclusive", with
  about how many seeds would decide it. One seed gives no interval: inconclusive.
- "does not transfer" also when, with curves at the grid edge, even the smallest drift consistent with
  the edges exceeds the limit (the unscaled baseline's optimum often runs off the grid; that is still a
  clear "no"), or the small model's best rate diverges at a larger scale.
- "no verdict" (undecided: extend the grid): any other curve at the grid edge (or diverged everywhere),
  or the panel has one scale. The line says which curve and which way to extend the grid.
"""

from __future__ import annotations

import math

import numpy as np

from moga.sweep.report.curves import Curve, Grid
from moga.sweep.report.summary import PanelSummary
from moga.sweep.report.schema import scale_label
from moga.sweep.results import format_lr
from moga.verdicts import DOES_NOT_TRANSFER, NO_VERDICT


MAX_REGRET = 0.02  # default: reusing the small model's rate may cost at most 2% of the best loss


def criterion_text(grid: Grid, max_drift_steps: int, max_drift_log2: float, max_regret: float = MAX_REGRET) -> str:
    if grid.regular and grid.step_log2 is not None:
        span = f"{_steps(max_drift_steps)} (a factor {2 ** (max_drift_steps * grid.step_log2):.3g} in lr on this grid)"
    elif grid.regular:
        span = _steps(max_drift_steps)
    else:
        span = f"{max_drift_log2:g} log2 units (the lr grid is not log-spaced, so grid steps are not used)"
    return (f"transfers iff every scale's optimum is inside its lr grid and, with 95% seed intervals, the refined "
            f"optimum's drift lies within {span} and reusing the smallest scale's refined optimum costs at most "
            f"{100 * max_regret:g}% of the best loss at every other scale; does not transfer when either is "
            "confidently beyond; otherwise inconclusive")


def decide(s: PanelSummary, max_drift_steps: int, max_drift_log2: float,
           max_regret: float = MAX_REGRET) -> tuple[str, str, list[str]]:
    """The panel's verdict, the line that states it, and its notes.

    With every optimum inside its grid, the verdict is the seed-interval decision of
    :mod:`moga.sweep.report.decision` (transfers, does not transfer, inconclusive). With an optimum on a
    grid edge it is "no verdict" (extend the grid), unless the edges already settle it: the smallest drift
    consistent with them exceeds the limit, or the small model's best rate diverges at a larger scale.
    """
    label = lambda scale: scale_label(s.scale_key, scale)  # noqa: E731
    span = f"from {label(s.curves[0].scale)} to {label(s.curves[-1].scale)}"
    problems = [edge_problem(c, label(c.scale)) for c in s.curves if not c.trusted]
    notes = problems + _notes(s, label) + (s.decision.notes if s.decision else [])
    regular = s.grid.regular
    bound = s.drift.steps_at_least if regular else s.drift.log2_at_least
    limit = max_drift_steps if regular else max_drift_log2

    if len(s.curves) < 2:
        return NO_VERDICT, f"no verdict: only one scale ({label(s.curves[0].scale)})", notes
    if s.decision is not None:
        d = s.decision
        return d.verdict, f"{d.verdict}: {d.reason}", notes
    reused_diverges = any(r.status == "diverges" for r in s.regrets)
    if bound is not None and bound > limit:
        at_least = "at least " if problems else ""
        amount = _steps(bound) if regular else f"{bound:.2f} log2 units"
        factor = 2 ** (s.drift.log2_at_least or 0.0)
        change = f"best lr {_direction(s.curves)} {at_least}{factor:.3g}x"
        for c in s.curves:
            if not c.trusted:
                change += f"; {label(c.scale)} " + ("diverged at every lr" if c.best_lr is None else "off the grid")
        return DOES_NOT_TRANSFER, (f"does not transfer: the optimum moves {at_least}{amount} {span} ({change}; "
                                     f"read from the grid edges, no interval){_regret_phrase(s, label, ', ')}"), notes
    if reused_diverges and s.curves[0].trusted:
        cost = _regret_phrase(s, label, "").removeprefix("but ")
        return DOES_NOT_TRANSFER, f"does not transfer: {cost}; " + "; ".join(problems), notes
    return NO_VERDICT, "no verdict: " + "; ".join(problems), notes


def edge_problem(c: Curve, label: str) -> str:
    if c.status == "all diverged":
        return f"{label} diverged at every lr, extend the grid below lr={format_lr(c.lrs[0])}"
    if c.edge == "both":
        return f"{label} has a single lr ({format_lr(c.best_lr)}), extend the grid both ways"
    side, where = ("lower", "below") if c.edge == "lower" else ("upper", "above")
    return (f"{label}'s optimum is at the {side} edge of its lr grid (lr={format_lr(c.best_lr)}), "
            f"extend the grid {where} it")


def _steps(n: float) -> str:
    return "one grid step" if n == 1 else f"{n:g} grid steps"


def _direction(curves: list[Curve]) -> str:
    """'rises'/'falls' with scale: sign of the least-squares slope of the grid optima (edges included)."""
    # a curve that diverged everywhere has its optimum below its smallest lr
    pts = [(math.log2(c.scale), math.log2(c.best_lr or c.lrs[0])) for c in curves]
    if len({x for x, _ in pts}) < 2:
        return "moves"
    slope = np.polyfit(*zip(*pts), 1)[0]
    return "rises" if slope > 0 else "falls" if slope < 0 else "moves"


def _regret_phrase(s: PanelSummary, label, sep: str) -> str:
    diverges = [label(r.scale) for r in s.regrets if r.status == "diverges"]
    ref = label(s.reference_scale)
    if diverges:
        return f"{sep}but reusing {ref}'s best lr diverges at {' and '.join(diverges)}"
    w = s.worst_regret
    if w is None:
        why = [f"{label(r.scale)} has no finite loss" if r.status == "no optimum" else
               f"{ref}'s best lr was not run at {label(r.scale)}" for r in s.regrets if r.status != "reference"]
        return f"{sep}regret not measured" + (f" ({'; '.join(why)})" if why else "")
    bound = ">= " if w.lower_bound else ""
    if w.absolute == 0 and not w.lower_bound:
        return f"{sep}no regret ({ref}'s best lr is best at every scale where it was run)"
    value = f"{100 * w.relative:.1f}%" if w.relative is not None else f"{w.absolute:.3g}"
    return f"{sep}worst regret {bound}{value} ({label(w.scale)})"


def _notes(s: PanelSummary, label) -> list[str]:
    notes = []
    if not s.grid.regular:
        gaps = ", ".join(f"{g:.2f}" for g in np.diff(np.log2(s.grid.lrs)))
        notes.append(f"the lr grid is not log-spaced (log2 gaps {gaps}): drift is judged in log2 units")
    ref = s.curves[0]
    if ref.status == "edge":
        notes.append(f"the reused rate is {label(ref.scale)}'s best grid lr, which is at the grid edge")
    for c in s.curves:
        if c.trusted and c.refinement != "parabola":  # edge curves are already explained
            notes.append(f"{label(c.scale)}: {c.refinement}")
        for lr, n, d in zip(c.lrs, c.n_seeds, c.n_diverged):
            if 0 < d < n:
                notes.append(f"{label(c.scale)}, lr={format_lr(lr)}: {d} of {n} seeds diverged (counted as diverged)")
    for r in s.regrets:
        if r.status == "not run":
            notes.append(f"{label(r.scale)}: the reused lr {format_lr(r.lr)} was not run, no regret")
    return notes
