"""The verdict of a panel, and the plain sentences that state it.

- "transfers" needs both halves of the claim: every scale's optimum is inside its lr grid and the
  grid optima of all scales lie within ``max_drift_steps`` grid steps (``max_drift_log2`` log2 units
  on a grid that is not log-spaced) of each other; AND reusing the smallest scale's best lr costs at
  most ``max_regret`` (relative, 2% by default) of the best loss at every other scale, and diverges
  nowhere. Optima one step apart with a 28% regret do not transfer.
- "does not transfer": the drift exceeds that, reusing the smallest scale's best lr diverges or
  costs more than ``max_regret`` (a lower bound on the regret above it is enough), or, with curves at
  the grid edge, even the smallest drift consistent with the edges exceeds the limit (the unscaled
  baseline's optimum often runs off the grid; that is still a clear "no").
- "no verdict": a curve at the grid edge (or diverged everywhere) leaves the question open, the
  regret could not be measured, or the panel has one scale. The line says which curve and which way
  to extend the grid.
"""

from __future__ import annotations

import math

import numpy as np

from moga.sweep.report.curves import Curve, Grid
from moga.sweep.report.summary import PanelSummary
from moga.sweep.report.schema import format_lr, scale_label


MAX_REGRET = 0.02  # default: reusing the small model's rate may cost at most 2% of the best loss


def criterion_text(grid: Grid, max_drift_steps: int, max_drift_log2: float, max_regret: float = MAX_REGRET) -> str:
    if grid.regular and grid.step_log2 is not None:
        span = f"{_steps(max_drift_steps)} (a factor {2 ** (max_drift_steps * grid.step_log2):.3g} in lr on this grid)"
    elif grid.regular:
        span = _steps(max_drift_steps)
    else:
        span = f"{max_drift_log2:g} log2 units (the lr grid is not log-spaced, so grid steps are not used)"
    return (f"transfers iff every scale's optimum is inside its lr grid, all grid optima lie within {span}, "
            f"and reusing the smallest scale's best lr costs at most {100 * max_regret:g}% of the best loss "
            "at every other scale (and diverges at none)")


def decide(s: PanelSummary, max_drift_steps: int, max_drift_log2: float,
           max_regret: float = MAX_REGRET) -> tuple[str, str, list[str]]:
    """The panel's verdict, the line that states it, and its notes."""
    label = lambda scale: scale_label(s.scale_key, scale)  # noqa: E731
    span = f"from {label(s.curves[0].scale)} to {label(s.curves[-1].scale)}"
    problems = [edge_problem(c, label(c.scale)) for c in s.curves if not c.trusted]
    notes = problems + _notes(s, label)
    regular = s.grid.regular
    measured = s.drift.steps if regular else s.drift.log2_grid
    bound = s.drift.steps_at_least if regular else s.drift.log2_at_least
    limit = max_drift_steps if regular else max_drift_log2

    if len(s.curves) < 2:
        return "no verdict", f"no verdict: only one scale ({label(s.curves[0].scale)})", notes
    reused_diverges = any(r.status == "diverges" for r in s.regrets)
    w = s.worst_regret
    too_costly = w is not None and w.status == "ok" and _relative_or_none(w) is not None and w.relative > max_regret
    if not problems and measured <= limit and reused_diverges:
        # Optima a step apart do not make a rate reusable when the small model's best one diverges.
        verdict = "does not transfer"
        line = f"does not transfer: the optima lie within {_steps(limit)} {span}{_regret_phrase(s, label, ', ')}"
    elif not problems and measured <= limit and too_costly:
        # The optimum barely moves, but the small model's rate is far from good enough at scale.
        verdict = "does not transfer"
        line = (f"does not transfer: the optima lie within {_steps(limit)} {span}, but reusing "
                f"{label(s.reference_scale)}'s best lr costs {'>= ' if w.lower_bound else ''}"
                f"{100 * w.relative:.1f}% at {label(w.scale)} (more than {100 * max_regret:g}%)")
    elif not problems and measured <= limit and (w is None or _relative_or_none(w) is None):
        verdict = "no verdict"
        line = f"no verdict: the optima lie within {_steps(limit)} {span}{_regret_phrase(s, label, ', ')}"
    elif not problems and measured <= limit:
        verdict = "transfers"
        if regular and measured == 0:
            moves = f"the optimum stays at lr={format_lr(s.curves[0].best_lr)} {span}"
        elif regular:
            moves = f"the optimum stays within {_steps(limit)} {span}"
        else:
            moves = f"the optimum moves {measured:.2f} log2 units (at most {limit:g}) {span}"
        line = f"transfers: {moves}{_regret_phrase(s, label, ', ')}"
    elif (too_costly or reused_diverges) and (bound is None or bound <= limit):
        # Some curve is at the grid edge, but what reusing the small model's rate costs already decides.
        verdict = "does not transfer"
        cost = (_regret_phrase(s, label, "").removeprefix("but ") if reused_diverges else
                f"reusing {label(s.reference_scale)}'s best lr costs {'>= ' if w.lower_bound else ''}"
                f"{100 * w.relative:.1f}% at {label(w.scale)} (more than {100 * max_regret:g}%)")
        line = f"does not transfer: {cost}; " + "; ".join(problems)
    elif bound is not None and bound > limit:
        verdict = "does not transfer"
        at_least = "at least " if problems else ""
        amount = _steps(bound) if regular else f"{bound:.2f} log2 units"
        factor = 2 ** (s.drift.log2_at_least or 0.0)
        change = f"best lr {_direction(s.curves)} {at_least}{factor:.3g}x"
        for c in s.curves:
            if not c.trusted:
                change += f"; {label(c.scale)} " + ("diverged at every lr" if c.best_lr is None else "off the grid")
        line = (f"does not transfer: the optimum moves {at_least}{amount} {span} ({change})"
                f"{_regret_phrase(s, label, ', ')}")
    else:
        verdict = "no verdict"
        line = "no verdict: " + "; ".join(problems)
    return verdict, line, notes


def _relative_or_none(r) -> float | None:
    return r.relative if r.relative is not None and math.isfinite(r.relative) else None


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
