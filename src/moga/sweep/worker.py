"""A sweep worker: claim a cell, train it in its run directory, record the outcome, repeat.

Workers are separate processes (``moga sweep --workers N`` starts them; Ray tasks run the same loop), so
one crashing run cannot take the others down. A heartbeat thread keeps the claim alive while a cell trains
and ends the worker at once if the process that started it is gone, so that killing ``moga sweep`` with
SIGKILL also stops its workers; their claims are then retaken and the cells resume from their checkpoints.
An exclusive lock on the run directory makes sure two live processes never train the same cell.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from moga.sweep.spec import Sweep, SweepSpec
from moga.status import DONE, Status
from moga.sweep.store import SweepStore, new_owner

HEARTBEAT_SECONDS = 2.0
IDLE_POLL_SECONDS = 1.0


def load_sweep(store: SweepStore) -> Sweep:
    definition = store.definition()
    return Sweep(SweepSpec.model_validate(definition["spec"]), definition["base"])


@contextmanager
def run_dir_lock(run_dir: Path):
    """Block until this process holds the run directory; the OS drops the lock when the process dies."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Heartbeat(threading.Thread):
    def __init__(self, store: SweepStore, cell: str, owner: str, parent_pid: int | None):
        super().__init__(daemon=True)
        self.store, self.cell, self.owner, self.parent_pid = store, cell, owner, parent_pid
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(HEARTBEAT_SECONDS):
            if orphaned(self.parent_pid):
                os._exit(3)  # as if killed with the parent: the claim goes stale, the checkpoint stays
            self.store.heartbeat(self.cell, self.owner)


def orphaned(parent_pid: int | None) -> bool:
    return parent_pid is not None and os.getppid() != parent_pid


def smaller_lr_diverged(store: SweepStore, sweep: Sweep, params: dict) -> bool:
    lr_key = sweep.spec.lr_key
    row = {k: v for k, v in params.items() if k != lr_key}
    return any(
        c["status"] == Status.DIVERGED and c["params"][lr_key] < params[lr_key]
        and {k: v for k, v in c["params"].items() if k != lr_key} == row
        for c in store.cells()
    )


def train_cell(config, run_dir: Path) -> dict:
    from moga.train import run

    return run(config, run_dir, quiet=True)


def run_worker(sweep_dir: str | Path, *, threads: int | None = None, parent_pid: int | None = None,
               owner: str | None = None) -> int:
    """Work until no cell is pending or running; returns the number of cells this worker settled."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    store = SweepStore(sweep_dir)
    sweep = load_sweep(store)
    owner = owner or new_owner()
    settled = 0
    while True:
        if orphaned(parent_pid):
            return settled
        claim = store.claim(owner, sweep.spec.heartbeat_timeout)
        if claim is None:
            counts = store.counts()
            if counts[Status.PENDING] == 0 and counts[Status.RUNNING] == 0:
                return settled
            time.sleep(IDLE_POLL_SECONDS)  # others are running; their cells may still come back
            continue
        cid, params = claim["id"], claim["params"]
        beat = Heartbeat(store, cid, owner, parent_pid)
        beat.start()
        try:
            with run_dir_lock(store.cell_dir(cid)):
                if sweep.spec.early_stop_diverged and smaller_lr_diverged(store, sweep, params):
                    result = {"status": Status.SKIPPED, "reason": "a smaller learning rate of this row diverged",
                              "train_loss": float("inf")}
                else:
                    result = train_cell(sweep.config(params), store.cell_dir(cid))
            status = result.get("status", Status.FINISHED)
            if status in DONE:
                store.finish(cid, owner, status, result)
            else:  # stopped early (SIGTERM): the checkpoint is there, the cell resumes later
                store.release(cid, owner)
                return settled
        except Exception:  # a crash of one run is recorded, and the sweep goes on
            store.finish(cid, owner, Status.FAILED, error=traceback.format_exc(limit=20))
        finally:
            beat.done.set()
        settled += 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one moga sweep worker (started by `moga sweep`)")
    parser.add_argument("sweep_dir")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--parent", type=int, default=None)
    args = parser.parse_args(argv)
    run_worker(args.sweep_dir, threads=args.threads, parent_pid=args.parent)


if __name__ == "__main__":
    main()
