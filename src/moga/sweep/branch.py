"""Warmup-stable-decay budgets from one stable run: a sweep's cooldowns branch from its longest budget's run.

Where a sweep's cells differ only in ``train.steps`` under ``schedule.name: wsd``, each shorter budget's run is the
longest one's up to its own decay start, step for step (:mod:`moga.train.branch`). So the longest budget's cell
keeps its checkpoint at every shorter budget's decay start (``checkpoint.keep``), and each shorter cell starts
from it (``train.branch_from``) instead of from step 0: budgets 1x, 2x, 4x and 8x with a 20% decay cost
8 + 0.2 x (1 + 2 + 4) = 9.4 units instead of 1 + 2 + 4 + 8 = 15, with the same numbers bit for bit.

A shorter cell waits while its source is pending or running and its checkpoint is not there yet; once the source
has settled without it (failed, diverged first, skipped), the cell runs from step 0 as any other. Both keys are
left out of the config hash, so stores made before branching resume, and their results stand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from moga.status import Status
from moga.sweep.spec import Sweep, canonical, cell_id
from moga.train.config import ScheduleConfig, build_config
from moga.train.schedule import build_schedule

BUDGET_KEY = "train.steps"
WAITING = (Status.PENDING, Status.RUNNING)  # a source that may still write the checkpoint


class Branches:
    """Which cell starts from which cell's checkpoint, and at which step."""

    def __init__(self, sweep: Sweep, cell_dir: Callable[[str], Path]):
        self.sweep, self.cell_dir = sweep, cell_dir
        self.points: dict[str, tuple[str, int]] = {}  # cell id -> (its source's id, the step it branches at)
        self.keep: dict[str, list[int]] = {}  # source id -> the steps whose checkpoints it keeps
        if BUDGET_KEY not in sweep.spec.axes:
            return
        rows: dict[str, list[tuple[dict, dict]]] = {}
        for params in sweep.cells:
            rest = {k: v for k, v in params.items() if k != BUDGET_KEY}
            rows.setdefault(canonical(rest), []).append((params, sweep.config_dict(params)))
        for row in rows.values():
            self._plan_row(row)

    def _plan_row(self, row: list[tuple[dict, dict]]) -> None:
        lengths = [data["train"].get("steps") for _, data in row]
        if len(row) < 2 or None in lengths:
            return
        source, long = max(row, key=lambda cell: cell[1]["train"]["steps"])
        long_schedule = _wsd(long)
        if long_schedule is None:
            return
        for params, data in row:
            schedule = _wsd(data)
            if params is source or schedule is None:
                continue
            start = schedule.total - schedule.decay
            if (0 < start < schedule.total and schedule.warmup == long_schedule.warmup <= start
                    and long_schedule.total - long_schedule.decay >= start
                    and _but_length(data) == _but_length(long)):
                self.points[cell_id(params)] = (cell_id(source), start)
                self.keep.setdefault(cell_id(source), []).append(start)

    def checkpoint(self, cid: str) -> Path | None:
        """The checkpoint the cell branches from (None: it does not branch)."""
        if cid not in self.points:
            return None
        source, step = self.points[cid]
        return self.cell_dir(source) / f"checkpoint-{step}.pt"

    def waits(self, cid: str, status: dict[str, str]) -> bool:
        """Whether the cell must wait for its source to reach its branch point (``status``: id -> status)."""
        path = self.checkpoint(cid)
        return path is not None and status.get(self.points[cid][0]) in WAITING and not path.is_file()

    def config(self, params: dict):
        """The cell's training config: with the checkpoints it keeps for others, or the one it starts from."""
        cid, data = cell_id(params), self.sweep.config_dict(params)
        if cid in self.keep:
            saves = data.setdefault("checkpoint", {})
            saves["keep"] = sorted(set(saves.get("keep", [])) | set(self.keep[cid]))
        path = self.checkpoint(cid)
        if path is not None and path.is_file():
            data["train"]["branch_from"] = str(path)
        return build_config(data)

    def settled(self, cid: str, result: dict) -> None:
        """A cell that branched is done: its source's checkpoint at that step serves nobody else."""
        if "branched_from" in result:
            self.checkpoint(cid).unlink(missing_ok=True)


def _wsd(data: dict):
    """The run's warmup-stable-decay schedule, or None (another schedule, or warmup in epochs)."""
    schedule = ScheduleConfig.model_validate(data.get("schedule", {}))
    if schedule.name != "wsd" or schedule.warmup_epochs is not None:
        return None
    return build_schedule(schedule, data["train"]["steps"], None)


def _but_length(data: dict) -> dict:
    return {**data, "train": {**data["train"], "steps": None}}
