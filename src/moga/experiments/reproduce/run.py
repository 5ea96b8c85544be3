"""Run one reproduction and judge the paper's claim: held, failed, inconclusive or undecided, with its key numbers.

Sweeps run on the sweep store (``OUT/sweep.db``, cells in ``OUT/cells``): re-running resumes, a kill -9 loses
no finished cell, and the claim's wall time adds up over every call (``OUT/seconds.json``, :mod:`.clock`).
Every run writes ``OUT/report/`` and ``OUT/outcome.json``, the stored summary that the README's table is
made from (:mod:`.table`).

The claim's kind (:mod:`.kinds`, registered in :mod:`.catalog`) runs it and judges it (``transfer.py``: the
panels' verdicts with 95% seed intervals; ``race.py``, ``quality.py``, ``gap.py``, ``convergence_claim.py``,
``tune_claim.py``): **held**, **failed**, **inconclusive** (the intervals straddle a limit) or **undecided** (the
grid cannot tell), the words of :mod:`moga.verdicts`. ``outcome.json`` keeps the numbers its verdict is made
from, so :func:`rejudge` recomputes the verdicts from the stored file alone.
"""

from __future__ import annotations

from pathlib import Path

from moga.experiments.reproduce.catalog import Reproduction, kind_of, stored_kind
from moga.experiments.reproduce.clock import ClaimClock
from moga.experiments.reproduce.convergence_claim import combined_outcome
from moga.experiments.reproduce.kinds import RunArgs
from moga.experiments.reproduce.transfer import judge_panels
from moga.files import refuse_symlinks, shown_path, write_json
from moga.sweep.report.summary import json_safe
from moga.sweep.report.verdict import MAX_REGRET

__all__ = ["combined_outcome", "judge_panels", "recheck", "rejudge", "reproduce"]


def reproduce(rep: Reproduction, out: Path, scale: str = "cpu", *, workers: int = 2, executor: str = "local",
              ray_address: str | None = None, data: str | None = None, max_regret: float = MAX_REGRET,
              progress: bool = True, command: str | None = None, min_seeds: int = 3, max_seeds: int = 6) -> dict:
    """Run (or resume) ``rep`` at ``scale`` in ``out``, write its report and outcome.json; return the outcome."""
    out = Path(out)
    refuse_symlinks(out / "report")  # a link planted there would take the report out of the directory
    args = RunArgs(scale, data, workers, executor, ray_address, max_regret, progress, min_seeds, max_seeds)
    with ClaimClock(out) as clock:  # a resumed or extended run adds to the time already spent, kills included
        outcome = kind_of(rep).run(rep, out, args)
        outcome.update(name=rep.name, paper=rep.paper, figure=rep.figure, claim=rep.claim, scale=scale,
                       command=command or f"moga reproduce {rep.name}" + (" --quick" if scale == "quick" else
                                                                          " --scale paper" if scale == "paper" else ""),
                       seconds=clock.elapsed(), max_regret=max_regret)
        if "report" in outcome:
            outcome["report"] = shown_path(outcome["report"], out)
        write_json(out / "outcome.json", json_safe(outcome))  # a kill mid-write keeps the last outcome
    return outcome


def recheck(outcome: dict) -> list[dict]:
    """The panels' verdicts recomputed from a stored outcome's cells (the same analysis settings)."""
    return [{"panel": p["panel"], "verdict": p["verdict"], "line": p["line"]}
            for p in rejudge(outcome, [])["panels"]]


def rejudge(outcome: dict, expect: list[dict]) -> dict:
    """A stored outcome with its verdict fields recomputed from its own numbers (a transfer's or joint's cells,
    convergence's per-seed numbers): after a change to the statistics, the verdicts move without re-running a
    cell."""
    return stored_kind(outcome).rejudge(outcome, expect)


