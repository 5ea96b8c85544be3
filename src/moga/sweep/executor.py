"""Run a sweep's cells: local worker processes, or Ray tasks on a cluster.

Both executors start the same claim-based worker loop (``moga.sweep.worker``), so they can be mixed:
several ``moga sweep`` processes, machines sharing the sweep directory, and Ray tasks never run a cell
twice. The caller's process only watches the store and draws progress.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from moga.status import DONE, Status
from moga.sweep.spec import Sweep, SweepError
from moga.sweep.store import SweepStore
from moga.sweep.worker import run_worker

# Deferred on purpose, imported where used: ray (the optional `ray` extra), only for the Ray executor.

EXECUTORS = ("local", "ray")


class WorkerStopped(SweepError):
    """Workers ended with an error before the sweep was settled; ``said``: each printed its one line (exit 2)."""

    def __init__(self, codes: list[int]):
        self.said = all(code == 2 for code in codes)
        super().__init__(f"{len(codes)} worker(s) stopped with an error (exit {', '.join(map(str, codes))}; see "
                         "above) before the sweep was done: run the same command again to resume it")


def start_local_workers(sweep_dir: Path, workers: int, threads: int = 1) -> list[subprocess.Popen]:
    """``threads`` is the sweep's fixed per-cell thread count (``SweepSpec.threads``), never derived from the
    number of workers: that would make a cell's losses depend on the machine."""
    cmd = [sys.executable, "-m", "moga.sweep.worker", str(sweep_dir), "--threads", str(threads),
           "--parent", str(os.getpid())]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with _sigint_ignored():  # inherited: Ctrl-C on the terminal stops workers once, through this process
        return [subprocess.Popen(cmd, env=env) for _ in range(workers)]


def interrupt(signum, frame):
    raise KeyboardInterrupt


def interrupted_line(out) -> str:
    """What a command that ran a sweep says when Ctrl-C or SIGTERM stopped it."""
    return (f"interrupted: this command's workers checkpointed and handed back any cell they were running; "
            f"run the same command to resume ({out})")


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM (a scheduler's stop, `kill PID`) takes Ctrl-C's path: the workers checkpoint and hand back their
    cells, and the command says how to resume, under every command that runs a sweep."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _sigint_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def run_ray_workers(sweep_dir: Path, workers: int, address: str | None = None, threads: int = 1) -> None:
    try:
        import ray
    except ModuleNotFoundError:
        raise RuntimeError("the Ray executor needs Ray: pip install 'moga[ray]'") from None

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    task = ray.remote(num_cpus=threads)(run_worker)
    ray.get([task.remote(str(sweep_dir.resolve()), threads=threads) for _ in range(workers)])


def run_sweep(sweep: Sweep, sweep_dir: Path, workers: int = 1, executor: str = "local",
              ray_address: str | None = None, progress: bool = True, retry_failed: bool = False) -> dict:
    """Create (or check and resume) the sweep in ``sweep_dir`` and work until every cell is settled."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    store = SweepStore(sweep_dir)
    store.create_or_check(sweep)
    if retry_failed:
        store.requeue((Status.FAILED,))
    start = time.time()
    if executor == "ray":
        run_ray_workers(sweep_dir, workers, ray_address, sweep.spec.threads)
    else:
        with sigterm_as_ctrl_c():
            procs = start_local_workers(sweep_dir, workers, sweep.spec.threads)
            try:
                watch(store, procs, start, progress)
            finally:  # on Ctrl-C too: one SIGTERM each, so each worker checkpoints and releases its cell
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                try:
                    for p in procs:
                        p.wait()
                except KeyboardInterrupt:  # a second Ctrl-C: stop now; the claims are retaken at the next run
                    for p in procs:
                        p.kill()
                    raise
        stopped = [p.returncode for p in procs if p.returncode]
        if stopped:  # a full disk, a damaged store: not "done" with cells still waiting
            raise WorkerStopped(stopped)
    counts = store.counts()
    counts["seconds"] = round(time.time() - start, 1)
    return counts


def watch(store: SweepStore, procs: list[subprocess.Popen], start: float, progress: bool) -> None:
    """Redraw one progress line until the workers exit."""
    if not progress:
        for p in procs:
            p.wait()
        return

    columns = (TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[state]}"),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    try:
        counts = store.counts()
        initial = sum(counts[s] for s in DONE)  # settled before this run: not part of the rate (ETA)
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task("cells", total=sum(counts.values()) - initial, state="")
            while True:
                alive = any(p.poll() is None for p in procs)
                c = store.counts()
                bar.update(task, completed=sum(c[s] for s in DONE) - initial,
                           state=f"running {c['running'] if alive else 0}  diverged {c['diverged']}  "
                                 f"failed {c['failed']}")
                if not alive:
                    break
                time.sleep(0.5)
    except SweepError:  # the store cannot be read now (a full disk): the workers meet it too and say so
        for p in procs:
            p.wait()
