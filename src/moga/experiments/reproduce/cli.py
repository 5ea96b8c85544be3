"""`moga reproduce NAME|all [--quick] [--scale cpu|paper]`, `moga reproduce --list`, `moga reproduce --table`.

Register with ``app.command("reproduce")(reproduce_command)`` in :mod:`moga.cli`.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from moga.experiments.reproduce.catalog import ReproduceError, catalog, cost_cache, estimate, get
from moga.experiments.reproduce.run import reproduce
from moga.experiments.reproduce.table import load_outcomes, results_table, update_readme
from moga.filelock import writer_lock
from moga.sweep.executor import interrupted_line
from moga.sweep.spec import SweepError
from moga.sweep.store import set_aside_all

LOCK = ".reproduce.lock"  # one reproduction per output directory at a time; holds the writer's PID


def reproduce_command(
    name: str = typer.Argument(None, help="a reproduction (see --list), or all"),
    quick: bool = typer.Option(False, "--quick", help="the miniature: digits or tiny models, about a minute each; "
                               "checks the code path, its verdict says nothing about the paper"),
    scale: str = typer.Option("cpu", "--scale", help="cpu (default: each grid within ~30 min on 2 cores, plus the "
                              "seeds added where a decision is close; see --list) or paper (the papers' setups, "
                              "for a GPU machine or a Ray cluster)"),
    out: Path = typer.Option(None, "--out", "-o", help="output directory (default runs/reproduce/<scale>/<name>; "
                             "with all: the parent of one directory per reproduction)"),
    workers: int = typer.Option(2, "--workers", "-w", min=1, help="worker processes (or Ray tasks)"),
    executor: str = typer.Option("local", help="local or ray"),
    ray_address: str = typer.Option(None, help="Ray cluster address (default: start a local Ray)"),
    data: str = typer.Option(None, help="the data set: an image data set's name (fashion-mnist, cifar10, cifar100, "
                             "digits), or for GPT reproductions a text file or a train.bin/val.bin directory"),
    max_regret: float = typer.Option(0.02, min=0, help="largest relative regret that still 'transfers'"),
    seeds: int = typer.Option(3, "--seeds", min=1, help="seeds at each panel's decisive rates (the grid runs one; "
                              "more are added where the decision needs them)"),
    max_seeds: int = typer.Option(6, "--max-seeds", min=1, help="most seeds at a decisive rate when the "
                                  "verdict stays inconclusive"),
    list_: bool = typer.Option(False, "--list", help="each reproduction: paper, figure, claim, grid size and "
                               "estimated time on 2 free cores"),
    table: bool = typer.Option(False, "--table", help="print the results table from stored outcomes (--runs)"),
    runs: Path = typer.Option(Path("runs/reproduce"), "--runs", help="with --table: where the outcomes are"),
    readme: Path = typer.Option(None, "--update-readme", help="with --table: write it into this README's "
                                "reproduce section and store the outcomes in docs/reproduce beside it"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress line"),
    wait: bool = typer.Option(False, "--wait", help="if another process is running this output directory, wait "
                              "for it to end (without --wait: refuse, naming its PID)"),
    rebuild: bool = typer.Option(False, "--rebuild", help="set a damaged sweep.db aside and rebuild the store from "
                                 "the config and the cells' run directories (finished cells are not run again)"),
) -> None:
    """Every claim of the three papers as one command: a sweep on the resumable store, the papers' figures, a
    verdict per panel with seed intervals and the claim's outcome (held, failed, inconclusive, undecided).
    Re-running resumes."""
    if list_:
        _list(scale if not quick else "quick")
        return
    if table:
        _echo_table(runs, readme)
        return
    if name is None:
        raise typer.BadParameter("name a reproduction (moga reproduce --list shows them), or all")
    if quick and scale != "cpu":
        raise typer.BadParameter("--quick is its own scale: give --quick or --scale, not both")
    scale = "quick" if quick else scale
    try:
        names = list(catalog()) if name == "all" else [get(name).name]
    except ReproduceError as e:
        raise typer.BadParameter(str(e)) from None

    options = dict(workers=workers, executor=executor, ray_address=ray_address, max_regret=max_regret,
                   progress=not quiet, min_seeds=min(seeds, max_seeds), max_seeds=max_seeds)
    failed = []
    for n in names:
        target = out if out is not None and len(names) == 1 else (out or Path("runs/reproduce") / scale) / n
        typer.echo(f"== {n} ({scale}) -> {target}")
        result = _reproduce_one(n, target, scale, wait, rebuild, data=data if len(names) == 1 else None, **options)
        if result is None:
            failed.append(n)
            continue
        _echo_result(n, result)
    if failed:
        raise typer.Exit(1)


def _echo_table(runs: Path, readme: Path | None) -> None:
    """--table: the results table from the outcomes under ``runs``, or (``readme``) written into that README."""
    try:
        if readme is not None:
            typer.echo(update_readme(readme, runs, readme.parent / "docs" / "reproduce"))
        else:
            typer.echo(results_table(load_outcomes(runs)))
    except (ReproduceError, OSError) as e:  # a damaged outcome.json, a README that cannot be written
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def _reproduce_one(n: str, target: Path, scale: str, wait: bool, rebuild: bool, **options) -> dict | None:
    """Reproduction ``n`` in ``target`` under its lock; None (the error said) when it could not run."""
    try:
        with writer_lock(Path(target) / LOCK, wait=wait, on_wait=lambda pid: typer.echo(
                f"waiting for {target}: in use by PID {pid or '?'}", err=True)):
            for aside in set_aside_all(target) if rebuild else ():
                typer.echo(f"set the old store aside as {aside}; rebuilding it")
            return reproduce(get(n), target, scale, **options)
    # DirectoryBusy too; OSError: a symlink planted in the store (moga.files.UnsafeFile)
    except (ReproduceError, SweepError, OSError, RuntimeError) as e:
        typer.echo(f"{n}: error: {e}", err=True)
        return None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the sweep's workers checkpointed and handed back their cells
        typer.echo(f"{n}: {interrupted_line(target)}", err=True)
        raise typer.Exit(130) from None


def _echo_result(n: str, result: dict) -> None:
    typer.echo(f"{n}: {result['outcome'].upper()}: {result['claim']}")
    if result.get("key"):
        typer.echo(f"  key: {result['key']}")
    for line in result.get("details", []):
        typer.echo(f"  {line}")
    typer.echo(f"  report: {result.get('report')}")


def _list(scale: str) -> None:
    table = Table(title=f"moga reproduce: {scale} scale (time: estimated on 2 free cores of a quiet CPU)")
    for col in ("name", "paper", "figure", "claim", "cells", "time"):
        table.add_column(col, overflow="fold")
    cache = cost_cache()  # each cell's cost, kept between calls: its model is built once per config and code
    for name, rep in catalog().items():
        e = estimate(rep, scale, cache=cache)
        cells = "-" if e["cells"] is None else str(e["cells"]) + _added(*e["seed_cells"], str)
        time_text = _duration(e["seconds"]) + _added(*e["seed_seconds"], _duration)
        table.add_row(name, rep.paper, rep.figure, rep.claim, cells,
                      time_text + ("" if scale != "paper" else " (CPU; a GPU is far faster)"))
    Console(width=160).print(table)


def _added(lo, hi, text) -> str:
    """" + 40-200 seeds": what the seeds added where a decision is close cost, if anything."""
    return "" if not hi else f" + {text(lo)} seeds" if text(lo) == text(hi) else f" + {text(lo)}-{text(hi)} seeds"


def _duration(seconds: float) -> str:
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.0f} h"
