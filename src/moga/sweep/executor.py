"""Run a sweep's cells: local worker processes, or Ray tasks on a cluster.

Both executors start the same claim-based worker loop (``moga.sweep.worker``), so they can be mixed:
several ``moga sweep`` processes, machines sharing the sweep directory, and Ray tasks never run a cell
twice. The caller's process only watches the store and draws progress.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from moga.sweep.spec import Sweep
from moga.status import DONE, Status
from moga.sweep.store import SweepStore

EXECUTORS = ("local", "ray")


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def start_local_workers(sweep_dir: Path, workers: int) -> list[subprocess.Popen]:
    threads = threads_per_worker(workers)
    cmd = [sys.executable, "-m", "moga.sweep.worker", str(sweep_dir), "--threads", str(threads),
           "--parent", str(os.getpid())]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return [subprocess.Popen(cmd, env=env) for _ in range(workers)]


def run_ray_workers(sweep_dir: Path, workers: int, address: str | None = None) -> None:
    try:
        import ray
    except ModuleNotFoundError:
        raise RuntimeError("the Ray executor needs Ray: pip install 'moga[ray]'") from None
    from moga.sweep.worker import run_worker

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    threads = threads_per_worker(workers) if address is None else 1
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
        run_ray_workers(sweep_dir, workers, ray_address)
    else:
        procs = start_local_workers(sweep_dir, workers)
        try:
            watch(store, procs, start, progress)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                p.wait()
    counts = store.counts()
    counts["seconds"] = round(time.time() - start, 1)
    return counts


def watch(store: SweepStore, procs: list[subprocess.Popen], start: float, progress: bool) -> None:
    """Redraw one progress line until the workers exit."""
    if not progress:
        for p in procs:
            p.wait()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[state]}"),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    counts = store.counts()
    initial = sum(counts[s] for s in DONE)  # settled before this run: not part of the rate (ETA)
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("cells", total=sum(counts.values()) - initial, state="")
        while True:
            alive = any(p.poll() is None for p in procs)
            c = store.counts()
            bar.update(task, completed=sum(c[s] for s in DONE) - initial,
                       state=f"running {c['running'] if alive else 0}  diverged {c['diverged']}  failed {c['failed']}")
            if not alive:
                break
            time.sleep(0.5)
