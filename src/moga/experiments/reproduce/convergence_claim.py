"""The ``convergence`` kind: the convergence paper's experiment (:mod:`moga.experiments.smoothness.convergence`),
its checks judged on per-seed numbers, which the outcome keeps so that they recompute from the stored file.
"""


from __future__ import annotations

from pathlib import Path

import torch

from moga.experiments.reproduce.cost import convergence_estimate
from moga.experiments.reproduce.kinds import ClaimKind, RunArgs
from moga.experiments.reproduce.reproduction import Reproduction
from moga.experiments.smoothness.checks import judge_checks
from moga.experiments.smoothness.convergence import convergence_experiment
from moga.verdicts import worst_state

CONVERGENCE_THREADS = 1  # its runs are in this process: pinned like a sweep cell's (moga.sweep.spec)


def combined_outcome(states: list[str]) -> str:
    """A claim of several checks: failed when one failed, undecided when one was not measured (or none ran),
    inconclusive when one was, held when all held."""
    return worst_state(states)


def _convergence(rep: Reproduction, out: Path, args: RunArgs) -> dict:
    settings = rep.settings(args.scale, args.data)
    quick = bool(settings.pop("quick", False))
    log = (lambda line: print(line, flush=True)) if args.progress else (lambda line: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(CONVERGENCE_THREADS)  # as a sweep cell: the numbers must not depend on the machine's cores
    try:
        result = convergence_experiment(out, quick, log, **settings)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    return {**convergence_fields(result["seed_numbers"]), "seed_numbers": result["seed_numbers"],
            "report": result["files"]["summary"], "data": ",".join(result["settings"]["data"]),
            "runs": {"missing data": result["missing"]} if result["missing"] else {},
            "threads": used}


def convergence_fields(numbers: dict) -> dict:
    """A convergence outcome's verdict fields (outcome, key, details) from its per-seed numbers."""
    checks = judge_checks(numbers)
    return {"outcome": combined_outcome([c["state"] for c in checks]),
            "key": "; ".join(c["text"] for c in checks[:2]),
            "details": [f"[{c['state']}] {c['claim']}: {c['text']}" for c in checks]}


CONVERGENCE = ClaimKind(
    "convergence", _convergence, lambda o, expect: {**o, **convergence_fields(o["seed_numbers"])},
    stores=lambda o: "seed_numbers" in o, estimate=convergence_estimate)
