"""The status of a training run or a sweep cell, shared by the engine, the run store, the workers and the report."""

from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    """A string enum: ``Status.FINISHED == "finished"``, and JSON, YAML and SQLite see plain strings."""

    PENDING = "pending"  # a cell no worker has claimed yet
    RUNNING = "running"  # claimed by a worker that heartbeats
    FAILED = "failed"  # an error (not a divergence); requeued when the sweep runs again
    FINISHED = "finished"  # trained to the end
    DIVERGED = "diverged"  # the loss became non-finite or too large: a result, with loss = inf
    SKIPPED = "skipped"  # not trained: a smaller lr of its row diverged (counted as diverged)
    STOPPED = "stopped"  # a run interrupted (SIGINT/SIGTERM) after checkpointing; resumable
    MISSING = "missing"  # a report's grid point with no result

    def __str__(self) -> str:
        return self.value


DONE = (Status.FINISHED, Status.DIVERGED, Status.SKIPPED)  # settled: never trained again
DIVERGED_LIKE = (Status.DIVERGED, Status.SKIPPED)  # plotted and scored as diverged
