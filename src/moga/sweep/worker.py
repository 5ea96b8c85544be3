"""A sweep worker: claim a cell, train it in its run directory, record the outcome, repeat.

Workers are separate processes (``moga sweep --workers N`` starts them; Ray tasks run the same loop), so
one crashing run cannot take the others down. A heartbeat thread keeps the claim alive while a cell trains
and ends the worker at once if the process that started it is gone, so that killing ``moga sweep`` with
SIGKILL also stops its workers; their claims are then retaken and the cells resume from their checkpoints.
An exclusive lock on the run directory makes sure two live processes never train the same cell.

Stopping: SIGTERM (or Ctrl-C, for a worker run by hand) checkpoints the cell at the next step boundary,
hands it back to the store once, and ends the worker quietly. Workers started by ``moga sweep`` ignore
SIGINT, so Ctrl-C on the terminal's process group reaches them once, as the parent's SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from moga.filelock import exclusive_lock
from moga.files import out_of_space
from moga.status import DONE, Status
from moga.sweep.branch import Branches
from moga.sweep.owners import new_owner
from moga.sweep.spec import Sweep, SweepError, SweepSpec, canonical
from moga.sweep.store import SweepStore
import moga.train as training  # its engine loads with the first cell, not with the module
from moga.train import CheckpointError

HEARTBEAT_SECONDS = 2.0
IDLE_POLL_SECONDS = 1.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A stop signal while a claimed cell is set up: its claim is released (training itself stops cleanly)."""


class _StopRequest:
    """SIGTERM / SIGINT: between cells only a flag; inside a claimed cell an exception that releases it.

    (Inside the training loop the engine's own handler takes over and checkpoints at the step boundary.)
    """

    def __init__(self):
        self.requested, self.raise_now, self._old = False, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        if self.raise_now:
            self.raise_now = False
            raise Interrupted

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def load_sweep(store: SweepStore) -> Sweep:
    definition = store.definition()
    return Sweep(SweepSpec.model_validate(definition["spec"]), definition["base"])


def run_dir_lock(run_dir: Path):
    """Block until this process holds the run directory; the OS drops the lock when the process dies."""
    return exclusive_lock(run_dir / ".lock")


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
    return training.run(config, run_dir, quiet=True)


def run_worker(sweep_dir: str | Path, *, threads: int | None = None, parent_pid: int | None = None,
               owner: str | None = None) -> int:
    """Work until no cell is pending or running; returns the number of cells this worker settled."""
    store = SweepStore(sweep_dir)
    sweep, allowed, branches = _stored_sweep(store)
    if threads is not None and threads != sweep.spec.threads:
        raise SweepError(f"this sweep runs every cell with {sweep.spec.threads} thread(s) (its `threads`), "
                         f"not {threads}: a cell's losses depend on the thread count")
    torch.set_num_threads(sweep.spec.threads)
    owner = owner or new_owner()
    settled = 0
    with _StopRequest() as stop:
        while True:
            if stop.requested or orphaned(parent_pid):
                return settled
            # a signal now only sets the flag; a sweep with nothing to branch claims without reading every status
            claim = store.claim(owner, sweep.spec.heartbeat_timeout, branches.waits if branches.points else None)
            if claim is None:
                counts = store.counts()
                if counts[Status.PENDING] == 0 and counts[Status.RUNNING] == 0:
                    return settled
                time.sleep(IDLE_POLL_SECONDS)  # others are running; their cells may still come back
                continue
            cid, params = claim["id"], claim["params"]
            if canonical(params) not in allowed:  # another `moga sweep` may have extended the config since
                sweep, allowed, branches = _stored_sweep(store)
            if canonical(params) not in allowed:  # a row the config does not make (the store is data, not config)
                refused = store.damaged(f"cell {cid} is not a cell of this sweep's config; it was refused")
                store.finish(cid, owner, Status.FAILED, error=str(refused))
                settled += 1
                continue
            beat = Heartbeat(store, cid, owner, parent_pid)
            beat.start()
            try:
                stop.raise_now = True
                if stop.requested:  # it came during the claim
                    raise Interrupted
                result = cell_result(store, sweep, cid, params, branches)
                stop.raise_now = False
                result["threads"] = torch.get_num_threads()  # recorded: the losses depend on it
                status = result.get("status", Status.FINISHED)
                if status in DONE:
                    store.finish(cid, owner, status, result)
                    branches.settled(cid, result)
                else:  # stopped early (SIGTERM, Ctrl-C): the checkpoint is there, the cell resumes later
                    store.release(cid, owner)
                    return settled
            except (KeyboardInterrupt, Interrupted):  # stopped before the loop could checkpoint, or twice
                stop.raise_now = False
                store.release(cid, owner)
                return settled
            except Exception as e:  # a crash of one run is recorded, and the sweep goes on
                stop.raise_now = False
                full = out_of_space(e)
                if full:  # not the cell's fault, and every next cell would fail the same way
                    store.release(cid, owner)
                    raise SweepError(_out_of_space_line(e, full, cid, store.cell_dir(cid))) from None
                store.finish(cid, owner, Status.FAILED, error=traceback.format_exc(limit=20))
            finally:
                beat.done.set()
            settled += 1


def _stored_sweep(store: SweepStore) -> tuple[Sweep, set, Branches]:
    """The store's sweep as its config says now, the cells it makes (nothing else runs), and where they branch
    from."""
    sweep = load_sweep(store)
    return sweep, {canonical(c) for c in sweep.cells}, Branches(sweep, store.cell_dir)


def cell_result(store: SweepStore, sweep: Sweep, cid: str, params: dict, branches: Branches) -> dict:
    """Train the cell in its own directory (from the checkpoint it branches from, if any), or skip it when a
    smaller rate of its row diverged."""
    with run_dir_lock(store.cell_dir(cid)):
        if sweep.spec.early_stop_diverged and smaller_lr_diverged(store, sweep, params):
            return {"status": Status.SKIPPED, "reason": "a smaller learning rate of this row diverged",
                    "train_loss": float("inf")}
        config = branches.config(params)
        result = train_cell(config, store.cell_dir(cid))
    if config.train.branch_from is not None:
        source, step = branches.points[cid]
        result["branched_from"] = {"cell": source, "step": step}
    return result


def _out_of_space_line(error: Exception, cause: OSError, cid: str, run_dir: Path) -> str:
    """One line: which file (``cause``: the write that failed behind ``error``), and that the same command goes on
    once there is space."""
    what = str(error) if isinstance(error, CheckpointError) else (  # that one names its file and the way on
        f"could not write {cause.filename or run_dir} ({cause.strerror}). Free some space and run the same command "
        "again")
    return f"cell {cid}: {what.rstrip('.')}; the cell was handed back (it resumes from its last checkpoint, if any), " \
        "no finished cell is lost"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one moga sweep worker (started by `moga sweep`)")
    parser.add_argument("sweep_dir")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--parent", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        run_worker(args.sweep_dir, threads=args.threads, parent_pid=args.parent)
    except SweepError as e:  # a damaged or read-only store: one line, as `moga sweep` prints it
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
