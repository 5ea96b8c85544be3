"""The verdict words, in one place for every package that judges.

Two vocabularies, kept apart on purpose. A panel's verdict says whether an optimum transfers across scales
(:mod:`moga.sweep.report`; ``moga tune`` reads it). A claim's outcome (``moga reproduce``) and each of its
checks' states say whether the paper's claim holds; a claim's panels, targets, budgets or checks are mapped to
states and the claim takes the worst of them.
"""

from __future__ import annotations

from collections.abc import Iterable

# A panel's verdict on transfer (moga.sweep.report.verdict, .joint, .decision).
TRANSFERS = "transfers"
DOES_NOT_TRANSFER = "does not transfer"
INCONCLUSIVE = "inconclusive"  # also a claim's or a check's state: the intervals straddle a limit
NO_VERDICT = "no verdict"  # the grid cannot tell (an optimum on its edge, one scale): extend it
# The gap's trend in width (moga reproduce gap-width).
CLOSES, DOES_NOT_CLOSE = "closes", "does not close"

# A claim's outcome, and the state of each thing it is judged on.
HELD, FAILED, UNDECIDED = "held", "failed", "undecided"
NOT_MEASURED = "not measured"  # a check whose numbers are missing: the claim is undecided
OUTCOMES = (HELD, FAILED, INCONCLUSIVE, UNDECIDED)
WORST_FIRST = (FAILED, UNDECIDED, INCONCLUSIVE, HELD)


def worst_state(states: Iterable[str]) -> str:
    """A claim's outcome from its parts' states: the worst of them (failed, undecided, inconclusive, held), and
    undecided when there is none (nothing ran) or a part was not measured."""
    seen = {UNDECIDED if s == NOT_MEASURED else s for s in states}
    return next((s for s in WORST_FIRST if s in seen), UNDECIDED)


def within_goal(low: float, high: float, goal: float) -> str:
    """A relative shortfall's state from its interval: held when it lies within ``goal``, failed when it lies
    beyond, inconclusive when it straddles it."""
    return HELD if high <= goal else FAILED if low > goal else INCONCLUSIVE


def panel_state(claimed: str, verdict: str) -> str:
    """A claimed panel's state from its verdict: held when it is the claimed one, undecided for no verdict,
    inconclusive for inconclusive, failed otherwise (confidently the opposite)."""
    return (HELD if verdict == claimed else UNDECIDED if verdict == NO_VERDICT
            else INCONCLUSIVE if verdict == INCONCLUSIVE else FAILED)
