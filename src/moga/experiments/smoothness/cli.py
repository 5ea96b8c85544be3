"""`moga smoothness EXPERIMENT`: the papers' smoothness claims measured, with figures and a verdict per claim.

Register with ``app.command("smoothness")(smoothness_command)`` in :mod:`moga.cli`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import typer

from moga.experiments.smoothness import convergence, scaling
from moga.experiments.smoothness.plots import plot_diagnostics
from moga.train import read_metrics

EXPERIMENTS = ("depth", "width", "convergence", "steprule")


def _verdict_lines(summary: Path) -> list[str]:
    """The lines of summary.md's verdict section."""
    lines, inside = [], False
    for line in summary.read_text().splitlines():
        if line.startswith("## "):
            inside = line.startswith("## Verdict")
            continue
        if inside and line.strip():
            lines.append(line)
    return lines


def smoothness_command(
    experiment: str = typer.Argument(..., help="depth, width, convergence, steprule or all; "
                                     "or 'diagnostics RUN_DIR' to plot a run's per-layer diagnostics"),
    run_dir: Path = typer.Argument(None, help="diagnostics: a run trained with logging.diagnostics_every=N"),
    out: Path = typer.Option(None, "--out", "-o", help="output directory (default: runs/smoothness/EXPERIMENT, "
                             "with --quick runs/smoothness-quick/EXPERIMENT; diagnostics: RUN_DIR/diagnostics.png)"),
    quick: bool = typer.Option(False, "--quick", help="the miniatures: 2 depths, 2 widths, digits, a few steps "
                               "(seconds; the numbers mean nothing)"),
    json_out: bool = typer.Option(False, "--json", help="also print results.json (always written) to stdout"),
    full_block: bool = typer.Option(False, "--full-block", help="depth: also measure the block of every "
                                    "parameter (embeddings and biases included)"),
    data: str = typer.Option(None, help="image data: depth, width and steprule take one name (fashion-mnist, "
                             "digits); convergence a comma-separated list (default fashion-mnist,cifar10)"),
    threads: int = typer.Option(None, min=1, help="torch CPU threads (1 is fastest for the small models "
                                "on a busy machine)"),
) -> None:
    """Measure the depth and width papers' smoothness claims and reproduce the convergence paper at CPU scale.

    depth: Lipschitz and smoothness constants vs depth K = 2..64, alpha = 1 vs K_base/K, residual MLPs and GPTs.
    width: smoothness vs width 64..1024 in the row, column, sign and spectral geometries.
    convergence: adaptive vs constant lr (feedforward nets), shared-weights nets over depth, ||W_t|| at L = 2
    (the same experiment as `moga reproduce convergence`, which also judges the paper's claim).
    steprule: the depth paper's eta* = ||grad||_*/L (optim.step_rule=depth_paper) vs the best constant lr.
    Each writes a figure, results.json and summary.md under OUT; reruns reuse finished training runs.
    """
    if threads:
        torch.set_num_threads(threads)
    if experiment == "diagnostics":
        if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
            raise typer.BadParameter(f"{run_dir} is not a run directory with metrics.jsonl")
        try:
            path = plot_diagnostics(read_metrics(run_dir / "metrics.jsonl", "diagnostics"),
                                    out or run_dir / "diagnostics.png")
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        typer.echo(f"diagnostics: {path}")
        return
    names = EXPERIMENTS if experiment == "all" else (experiment,)
    if any(n not in EXPERIMENTS for n in names) or run_dir is not None:
        raise typer.BadParameter(f"experiment must be one of {', '.join(EXPERIMENTS)}, all or diagnostics; "
                                 f"got {experiment!r}" + (f" {run_dir}" if run_dir is not None else ""))
    root = out or Path("runs") / ("smoothness-quick" if quick else "smoothness")
    for name in names:
        # OUT is the experiment's own directory, or with 'all' the parent of one per experiment
        target = out if out is not None and len(names) == 1 else root / name
        result = _run_experiment(name, target, quick, full_block, data)
        typer.echo(f"== {name}: {result['files']['summary']} ({result.get('seconds')} s)")
        for line in _verdict_lines(Path(result["files"]["summary"])):
            typer.echo(line)
        if json_out:
            typer.echo(json.dumps(result, indent=1))


def _run_experiment(name: str, out: Path, quick: bool, full_block: bool, data: str | None) -> dict:
    log = (lambda line: None) if quick else (lambda line: typer.echo(line, err=True))
    try:
        if name == "depth":
            return scaling.depth_experiment(out, quick, log, data=data, full_block=full_block or None)
        if name == "width":
            return scaling.width_experiment(out, quick, log, data=data)
        if name == "convergence":
            names = [d.strip() for d in data.split(",")] if data else None
            return convergence.convergence_experiment(out, quick, log, data=names)
        return convergence.step_rule_experiment(out, quick, log, data=data)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
