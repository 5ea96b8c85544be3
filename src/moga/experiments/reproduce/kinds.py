"""A claim kind is one object: how a reproduction of that kind runs and is judged, how its stored outcome is judged
again from its own numbers, what ``moga reproduce --list`` estimates for it and how the README's table reads it.

Each kind is a :class:`ClaimKind` defined beside its analysis (``transfer.py``: transfer and joint;
``convergence_claim.py``, ``race.py``, ``quality.py``, ``gap.py``, ``tune_claim.py``) and registered once, in
:mod:`.catalog`, where the runner, ``--list``, ``--table`` and the recheck find it: by a reproduction's ``kind``
(``kind_of``) or by the shape of a stored outcome (``stored_kind``: ``outcome.json`` names no kind).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moga.sweep.executor import run_sweep
from moga.sweep.seeds import stored_include
from moga.sweep.spec import Sweep


@dataclass(frozen=True)
class RunArgs:
    """How ``moga reproduce`` was asked to run a reproduction (:func:`moga.experiments.reproduce.run.reproduce`)."""

    scale: str = "cpu"
    data: str | None = None
    workers: int = 2
    executor: str = "local"
    ray_address: str | None = None
    max_regret: float = 0.02
    progress: bool = True
    min_seeds: int = 3
    max_seeds: int = 6

    def run(self, sweep: Sweep, out: Path) -> dict:
        """Run (or resume) ``sweep`` on the store in ``out``; failed cells (a missing data set, say) run again."""
        return run_sweep(sweep, out, workers=self.workers, executor=self.executor, ray_address=self.ray_address,
                         progress=self.progress, retry_failed=True)

    def sweep(self, rep, include: list[dict]) -> Sweep:
        """The reproduction's sweep at this scale, with ``include`` (the seeds added so far)."""
        spec = rep.sweep_dict(self.scale, self.data)
        if include:
            spec["include"] = include
        return Sweep.from_dict(spec)


def _no_seeds(count: int, min_seeds: int, max_seeds: int) -> list[int]:
    return [0, 0]


@dataclass(frozen=True)
class ClaimKind:
    name: str
    # (rep, out, RunArgs) -> its outcome: the verdict fields (outcome, key, details, ...), report, runs, data
    run: Callable[[Any, Path, RunArgs], dict]
    # (stored outcome, the paper's expectations) -> the outcome with its verdict fields recomputed from its own
    # numbers; None for a kind whose stored outcome does not keep them
    rejudge: Callable[[dict, list[dict]], dict] | None = None
    stores: Callable[[dict], bool] = lambda outcome: False  # whether a stored outcome is this kind's
    # --list: (rep, scale, cores, min_seeds, max_seeds, cost cache) -> its estimate, for a kind that is not one lr grid
    estimate: Callable[..., dict] | None = None
    # --list, for a grid: the seed cells added on one curve of ``count`` cells, [fewest, most]
    seeds_added: Callable[[int, int, int], list[int]] = _no_seeds
    # --list, for a grid: (rep, scale, sweep, {curve: (cells, seconds of one)}) -> the cells that run per curve
    curves: Callable[..., dict] | None = None
    intervals: bool = False  # --table: its verdicts carry seed intervals from the cells it stores


def judged_sweep(runs: Callable[[Any, Path, RunArgs], tuple[Sweep, dict]],
                 judge: Callable[[Any, Sweep, Path, float], dict]) -> Callable[[Any, Path, RunArgs], dict]:
    """A sweep kind's ``run``: ``runs`` runs the cells (and adds seeds where its decision needs them), then
    ``judge`` makes the outcome from the store; the outcome records the cells that ran and the data set."""

    def run(rep, out: Path, args: RunArgs) -> dict:
        sweep, counts = runs(rep, out, args)
        outcome = judge(rep, sweep, out, args.max_regret)
        outcome["runs"] = {str(k): v for k, v in counts.items() if k != "seconds" and v}
        outcome["data"] = sweep.base["data"].get("name")
        return outcome

    return run


def grid_once(rep, out: Path, args: RunArgs) -> tuple[Sweep, dict]:
    """The grid as configured (with any seeds stored earlier), run once: a re-run completes it."""
    sweep = args.sweep(rep, stored_include(out, lambda include: args.sweep(rep, include)))
    return sweep, args.run(sweep, out)


def kind_registry(*kinds: ClaimKind) -> dict[str, ClaimKind]:
    """{name: kind}, each kind once (:mod:`.catalog` registers them)."""
    registry: dict[str, ClaimKind] = {}
    for kind in kinds:
        if kind.name in registry:
            raise ValueError(f"the claim kind {kind.name!r} is registered twice")
        registry[kind.name] = kind
    return registry
