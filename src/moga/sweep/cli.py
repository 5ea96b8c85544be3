"""`moga sweep CONFIG`, `moga sweep status DIR`."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from moga.status import Status
from moga.sweep.executor import EXECUTORS, WorkerStopped, interrupt, interrupted_line, run_sweep
from moga.sweep.results import plan_table, status_table
from moga.sweep.seeds import run_sweep_until_decided
from moga.sweep.spec import Sweep, SweepError
from moga.sweep.store import SweepStore
from moga.train.cli import refuse_imports
from moga.train.config import ConfigError


def sweep(
    target: str = typer.Argument(..., help="a sweep config (YAML/TOML), or 'status' followed by a sweep directory"),
    directory: Path = typer.Argument(None, help="with 'status': the sweep directory to show"),
    out: Path = typer.Option(None, "--out", "-o", help="sweep directory (default: runs/<config name>)"),
    workers: int = typer.Option(1, "--workers", "-w", min=1, help="worker processes (or Ray tasks)"),
    executor: str = typer.Option("local", help=f"one of {', '.join(EXECUTORS)}"),
    ray_address: str = typer.Option(None, help="Ray cluster address (default: start a local Ray)"),
    retry_failed: bool = typer.Option(False, help="run cells that failed before again"),
    metric: str = typer.Option("final_train_loss", help="with 'status': the result field shown in the grid"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress line"),
    rebuild: bool = typer.Option(False, "--rebuild", help="set a damaged sweep.db aside and rebuild the store from "
                                 "the cells' run directories (finished cells are not run again)"),
    seeds: int = typer.Option(1, "--seeds", min=1, help="after the grid (one seed), add seeds on each panel's "
                              "decisive rates until its transfer verdict is decided: at least this many there "
                              "(panels: --by; curves: the sweep's scale_key; 1: the grid alone)"),
    max_seeds: int = typer.Option(6, "--max-seeds", min=1, help="with --seeds: most seeds at a decisive rate "
                                  "while the verdict stays inconclusive"),
    by: list[str] = typer.Option(["optimizer", "scaling"], "--by", help="with --seeds: keys that make a panel "
                                 "(repeat; as in moga report)"),
    max_regret: float = typer.Option(0.02, min=0, help="with --seeds: largest relative regret that still transfers"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the sweep's cells, each with its state "
                                 "in the sweep directory, and run nothing (the directory is not written)"),
    no_import: bool = typer.Option(False, "--no-import", help="refuse every package.module:factory model (a config is "
                                   "code: see moga train --help); also MOGA_NO_IMPORT=1"),
) -> None:
    """Run every cell of a learning-rate sweep; re-running resumes it, and several processes can share it.

    Each cell is a training run in DIR/cells/<id>. Finished cells are never run again, unfinished ones
    resume from their checkpoint, and a killed sweep (even with SIGKILL) loses no finished cell.
    """
    console = Console()
    if no_import:
        refuse_imports()
    if target == "status":
        if directory is None:
            raise typer.BadParameter("give the sweep directory: moga sweep status DIR")
        _show_status(SweepStore(directory), metric, console)
        return
    if directory is not None:
        raise typer.BadParameter(f"unexpected argument {directory}; to show a sweep use: moga sweep status DIR")

    try:
        spec = Sweep.from_file(target)
    except (SweepError, ConfigError) as e:
        _error_exit(console, e)
    out = out or Path("runs") / (spec.spec.name or Path(target).stem)
    if dry_run:
        _show_plan(spec, SweepStore(out), console)
        return
    if rebuild:
        aside = SweepStore(out).set_aside()
        if aside is not None:
            console.print(f"set the old store aside as {aside}; rebuilding it from {out / 'cells'}")
    console.print(f"sweep {Path(target).name}: {len(spec.cells)} cells -> {out} ({workers} worker(s), "
                  f"{spec.spec.threads} thread(s) each)", soft_wrap=True)
    run = lambda sw: run_sweep(sw, out, workers, executor, ray_address, progress=not quiet,  # noqa: E731
                               retry_failed=retry_failed)
    counts = _run_cells(spec, out, run, console, seeds, max_seeds, by, max_regret)
    _report_counts(counts, out, workers, console)


def _run_cells(spec: Sweep, out: Path, run, console: Console, seeds: int, max_seeds: int, by: list[str],
               max_regret: float) -> dict:
    """Run the sweep (with --seeds above 1, until its panels' verdicts are decided), SIGTERM taken as Ctrl-C;
    its counts."""
    old = signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C between runs too (seeds are judged between them)
    try:
        if seeds > 1:
            spec, counts, unseeded = run_sweep_until_decided(spec, out, run, by, max_regret, min(seeds, max_seeds),
                                                             max_seeds)
            console.print(f"seeds: {len(spec.cells)} cells with those added where a decision was close")
            for line in unseeded:  # an optimum on the grid's edge, or one scale: the grid grows first
                console.print(line, soft_wrap=True)
        else:
            counts = run(spec)
    except (SweepError, ValueError, RuntimeError, OSError) as e:
        if isinstance(e, WorkerStopped) and e.said:  # each worker printed its one line
            raise typer.Exit(2) from None
        _error_exit(console, e)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM
        console.print(interrupted_line(out))
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, old)
    return counts


def _error_exit(console: Console, e: Exception) -> NoReturn:
    """Say the error in one line and exit 2."""
    console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
    raise typer.Exit(2) from None


def _show_status(store: SweepStore, metric: str, console: Console) -> None:
    """`moga sweep status DIR`: the grid of the store's cells."""
    try:
        spec = store.definition()["spec"]
        table = status_table(store, spec["lr_key"], metric)
    except (SweepError, OSError) as e:  # OSError: a symlink planted at sweep.db (moga.files.UnsafeFile)
        _error_exit(console, e)
    Console(width=max(console.width, 40 + 9 * len(table.columns))).print(table)  # never squash the grid


def _show_plan(spec: Sweep, store: SweepStore, console: Console) -> None:
    """`moga sweep CONFIG --dry-run`: what a run would do, before it does it (a pre-registered count of seeds, an
    extension's new cells)."""
    try:
        table, summary = plan_table(spec, store)
    except (SweepError, OSError) as e:
        _error_exit(console, e)
    Console(width=max(console.width, 20 + 12 * len(table.columns))).print(table)
    console.print(summary, soft_wrap=True)


def _report_counts(counts: dict, out: Path, workers: int, console: Console) -> None:
    """What the run did; failed cells exit 1 with the last line of their first errors."""
    summary = ", ".join(f"{k} {v}" for k, v in counts.items() if v and k != "seconds")
    console.print(f"done in {counts['seconds']} s with {workers} worker(s): {summary}", soft_wrap=True)
    failed = counts.get(Status.FAILED, 0)
    if failed:  # a sweep with failed cells is unfinished work: exit non-zero, so scripts and CI notice
        total = sum(v for k, v in counts.items() if k != "seconds")
        console.print(f"[red]error:[/red] {failed} of {total} cells failed; see `moga sweep status {out}` "
                      "and their errors in the store; --retry-failed runs them again")
        errors = [c for c in SweepStore(out).cells() if c["status"] == Status.FAILED and c["error"]]
        for cell in errors[:3]:  # the last line of a traceback says what went wrong
            console.print(f"  {cell['id']}: {cell['error'].strip().splitlines()[-1]}", markup=False, highlight=False,
                          soft_wrap=True)
        raise typer.Exit(1)
