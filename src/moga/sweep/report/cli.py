"""`moga report SWEEP`: the transfer report of a finished (or partly finished) sweep.

Register with ``app.command("report")(report_command)`` in :mod:`moga.cli`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from moga.files import out_of_space, read_only, refuse_symlinks
from moga.sweep.report.metrics import select_scale
from moga.sweep.report.outputs import analyze_metrics, write_outputs
from moga.sweep.report.render import print_verdicts
from moga.sweep.report.schema import load_records, parse_records
from moga.sweep.results import records
from moga.sweep.spec import SweepError
from moga.sweep.store import SweepStore


def report_command(
    sweep: Path = typer.Argument(..., exists=True, help="a sweep directory, or a records file (.jsonl, .json, .csv)"),
    out: Path = typer.Option(None, "--out", "-o", help="output directory (default: SWEEP/report)"),
    scale_key: str = typer.Option(None, help="the axis with one curve per value (default: the sweep's scale_key)"),
    by: list[str] = typer.Option(["optimizer", "scaling"], "--by", help="keys that make a panel (repeat)"),
    title: str = typer.Option(None, help="report title"),
    max_drift_steps: int = typer.Option(1, min=0, help="largest drift in grid steps that still transfers"),
    max_regret: float = typer.Option(0.02, min=0, help="largest relative regret of reusing the smallest "
                                     "scale's lr that still transfers (0.02: 2% of the best loss)"),
    svg: bool = typer.Option(False, "--svg", help="write SVG figures instead of PDF"),
) -> None:
    """Figures (loss vs lr, one curve per scale), optima, drift, regret and a verdict per panel."""
    if out is None and sweep.is_dir() and read_only(sweep):
        typer.echo(f"error: {sweep} is read-only: give the report another place (--out DIR)", err=True)
        raise typer.Exit(1)
    try:
        db = sweep / "sweep.db"
        if sweep.is_dir() and (db.exists() or db.is_symlink()):  # the store says what is wrong with one
            rows, scale_key = _from_store(sweep, scale_key)
            records = parse_records(rows, scale_key)
        else:
            records = load_records(sweep, scale_key)
        records = select_scale(records, scale_key)
        summaries = analyze_metrics(records, group_keys=tuple(by), max_drift_steps=max_drift_steps,
                                    max_regret=max_regret)
        if out is None:  # inside the sweep: a link planted there would take the report elsewhere
            out = (sweep if sweep.is_dir() else sweep.parent) / "report"
            refuse_symlinks(out)
        paths = write_outputs(summaries, records, out, title, tuple(by), ("png", "svg" if svg else "pdf"))
    except SweepError as e:  # a damaged store (moga.sweep.store.StoreDamaged): one line
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
    except OSError as e:  # a read-only sweep directory or a full disk: the store was read, the report cannot go there
        fix = "free some space or give --out DIR elsewhere" if out_of_space(e) else "give --out DIR elsewhere"
        typer.echo(f"error: could not write {e.filename or out}: {e.strerror or e}; {fix} (the sweep itself is only "
                   "read)", err=True)
        raise typer.Exit(1) from None
    print_verdicts(summaries)
    typer.echo(f"report: {paths['report.html']}")


def _from_store(sweep_dir: Path, scale_key: str | None):
    """The runner's settled cells, and its scale_key unless one was given."""
    store = SweepStore(sweep_dir)
    return records(store), scale_key or store.definition()["spec"].get("scale_key")
