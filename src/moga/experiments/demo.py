"""`moga demo`: the depth paper's figure 1 at CPU scale, from sweep to verdict.

Residual MLPs of fixed width (128) and depths K = 2, 8, 32 are trained on Fashion-MNIST (scikit-learn's
digits where Fashion-MNIST is not installed) with AdamW, Muon (the papers' all-geometry one, preset moga) and
MOGA (row, p = 2), each over six learning
rates, with unscaled branches (alpha = 1) and with the inverse-depth scaling alpha = K_base/K (K_base = 2).
The report then says, per optimizer and scaling, whether the best learning rate stays put across depth, with
95% seed intervals: after the grid's one seed, seeds are added on each panel's decisive rates until its verdict
is decided (3 seeds there at least, 6 at most; ``--seeds`` and ``--max-seeds``).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import typer

from moga.experiments.reproduce.table import table_cell
from moga.files import copy_file, refuse_symlinks, write_text
from moga.sweep.executor import interrupted_line, run_sweep
from moga.sweep.report import write_report
from moga.sweep.results import records
from moga.sweep.seeds import run_until_decided
from moga.sweep.spec import Sweep, SweepError, optimizer_labels
from moga.sweep.store import SweepStore, set_aside_all

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

BASE = {
    "seed": 0,
    "model": {"name": "residual_mlp", "width": 128, "depth": 2, "activation": "gelu", "k_base": 2},
    "data": {"name": "fashion-mnist"},
    "optim": {"name": "moga"},
    "schedule": {"name": "cosine", "warmup_fraction": 0.1, "min_lr_ratio": 0.1},
    "train": {"steps": 300, "batch_size": 128, "loss_ceiling": 10.0},
    # The final training loss is the mean over the last 50 steps: 300 steps are less than an epoch, and
    # a mean over the whole run would reward fast starts, not low final loss.
    "eval": {"every": 0, "train_eval": False, "final_window": 50},
    "checkpoint": {"every": 100},
    "logging": {"progress": False},
}
# Six rates per optimizer, a factor 2 apart. A pilot with nine rates each at K = 2 and 32 put the optima
# at 2^-8 (AdamW), 2^-5 (Muon) and 2^-3 (MOGA) for K = 2, and at most three steps lower for unscaled
# K = 32; these grids hold all of them inside. The geometries' natural scales differ by orders of magnitude.
LRS = {
    "adamw": {"pow2": [-11, -6]},
    "muon": {"pow2": [-9, -4]},
    "moga": {"pow2": [-6, -1]},
}
# 60 steps on digits want larger rates than 300 on Fashion-MNIST (found by running the quick demo).
QUICK_LRS = {
    "adamw": {"pow2": [-7, -4]},
    "muon": {"pow2": [-5, -2]},
    "moga": {"pow2": [-4, -1]},
}
# Muon as the depth and width papers define it, steepest descent under the (2, mean) -> (2, mean) norm on every
# matrix: moga's all-geometry Muon, which the grids above were tuned for and the README's verdicts measured. Not an
# axis, so the cells keep the ids of the stores made while it was Muon's default (moga.sweep.spec).
OVERRIDES = {"optim.preset": {"by": "optim.name", "values": {"muon": "moga"}}}
AXES = {
    "optim.name": ["adamw", "muon", "moga"],
    "model.depth_scaling": ["none", "inverse_depth"],
    "model.depth": [2, 8, 32],
    "optim.lr": {"by": "optim.name", "values": LRS},
}


# Measured: 4.0 min wall for `moga demo --quick` (48-cell grid, then seeds: 169 cells) with 2 workers on a
# shared 2-core AVX2 CPU (load 3-5); one worker takes about twice as long (a newcomer saw 6 min).
QUICK_TIME = "48 runs, then seeds at the decisive rates; about 4 min with 2 workers on a 2-core CPU, twice that with 1"
# README.md's measurement of the full grid; the seeds after it can triple the time.
FULL_TIME = "108 runs, about 7 min with 2 workers on a 2-core CPU, then seeds at the decisive rates (up to 3x that)"


def demo_sweep(quick: bool = False, data: str | None = None) -> dict:
    """The sweep config: the full demo, or ``quick`` (digits, narrow, short: QUICK_TIME)."""
    spec = {"name": "demo-quick" if quick else "demo", "base": copy.deepcopy(BASE), "axes": copy.deepcopy(AXES),
            "overrides": copy.deepcopy(OVERRIDES), "scale_key": "model.depth"}
    spec["base"]["data"]["name"] = data or ("fashion-mnist" if FASHION_MNIST.is_dir() and not quick else "digits")
    if quick:
        spec["base"]["model"]["width"] = 32
        spec["base"]["train"].update(steps=60, batch_size=64)
        spec["base"]["eval"]["final_window"] = 20
        spec["base"]["checkpoint"]["every"] = 30
        spec["axes"]["model.depth"] = [2, 8]
        spec["axes"]["optim.lr"]["values"] = QUICK_LRS
    return spec


def run_demo(out: Path, quick: bool = False, workers: int = 2, data: str | None = None,
             progress: bool = True, min_seeds: int = 3, max_seeds: int = 6) -> dict:
    """The sweep, then seeds on each panel's decisive rates until its verdict is decided (or ``max_seeds``)."""
    spec = demo_sweep(quick, data)
    refuse_symlinks(out / "report")  # a link planted there would take the report out of the directory
    sweep, counts, _ = run_until_decided(
        lambda include: Sweep.from_dict({**spec, "include": include}), out,
        lambda sw: run_sweep(sw, out, workers=workers, progress=progress),
        lambda sw: (records(SweepStore(out)), "model.depth"), ("optimizer", "scaling"), 0.02, min_seeds, max_seeds)
    rows = records(SweepStore(out))
    if not rows:  # every cell failed: the report would have nothing to say
        raise SweepError(f"no cell of {out} settled; see `moga sweep status {out}`")
    paths = write_report(rows, out / "report", scale_key="model.depth",
                         title=f"Learning-rate transfer across depth ({sweep.base['data']['name']}, residual MLP)",
                         formats=("png", "svg"))
    return {"counts": counts, "report": out / "report", "paths": paths, "data": sweep.base["data"]["name"],
            "arms": optimizer_labels(sweep)}


README_START, README_END = "<!-- demo:start -->", "<!-- demo:end -->"


def update_demo_readme(readme: Path, report_dir: Path, figure_dir: Path, command: str,
                       arms: dict[str, str] | None = None) -> None:
    """Replace the README's demo section with this run's figure and verdicts, each optimizer named by its arm
    (``arms``: {optimizer: :func:`moga.sweep.spec.arm_label`}, e.g. "muon (moga preset)")."""
    summary = json.loads((report_dir / "summary.json").read_text())
    figure_dir.mkdir(parents=True, exist_ok=True)
    figure = figure_dir / "demo_train_loss.png"
    copy_file(report_dir / "figures" / "train_loss.png", figure)
    lines = [README_START, f"Generated by `{command}` ({summary['runs']['total']} runs).", "",
             f"![final training loss against learning rate]({figure.relative_to(readme.parent).as_posix()})", "",
             "| optimizer | branches | verdict (final training loss) |", "|---|---|---|"]
    for v in summary["verdicts"]:
        if v["metric"] == "train_loss":
            scaling = {"none": "alpha = 1", "inverse_depth": "alpha = 2/K"}.get(v["panel"].get("scaling"), "")
            name = v["panel"]["optimizer"]
            cells = ((arms or {}).get(name, name), scaling, v["line"])
            lines.append("| " + " | ".join(table_cell(c) for c in cells) + " |")
    lines.append(README_END)
    text = readme.read_text()
    pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {README_START} ... {README_END} section to replace")
    write_text(readme, pattern.sub(lambda _: "\n".join(lines), text))


def demo_command(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="where the sweep and its report go"),
    quick: bool = typer.Option(False, "--quick", help=f"digits, narrow and short: {QUICK_TIME}"),
    workers: int = typer.Option(2, "--workers", "-w", min=1, help="worker processes"),
    data: str = typer.Option(None, help="fashion-mnist or digits (default: Fashion-MNIST where installed)"),
    readme: Path = typer.Option(None, "--update-readme", help="write the figure and verdicts into this README's demo section"),
    seeds: int = typer.Option(3, "--seeds", min=1, help="seeds at each panel's decisive rates (the grid runs one)"),
    max_seeds: int = typer.Option(6, "--max-seeds", min=1, help="most seeds there while a verdict is inconclusive"),
    rebuild: bool = typer.Option(False, "--rebuild", help="set a damaged sweep.db aside and rebuild the store from "
                                 "the config and the cells' run directories (finished cells are not run again)"),
) -> None:
    """The depth paper's figure 1 at CPU scale: residual MLPs at depths 2-32, AdamW vs Muon vs MOGA, with and
    without alpha = K_base/K, six learning rates each; then the transfer report. Re-running resumes."""
    typer.echo(f"moga demo{' --quick' if quick else ''}: {QUICK_TIME if quick else FULL_TIME}; this run: {workers} "
               f"worker(s) on {os.cpu_count()} CPU(s); re-running resumes", err=True)
    try:
        for aside in set_aside_all(out) if rebuild else ():
            typer.echo(f"set the old store aside as {aside}; rebuilding it")
        result = run_demo(out, quick=quick, workers=workers, data=data, min_seeds=min(seeds, max_seeds),
                          max_seeds=max_seeds)
        if readme is not None:
            command = "moga demo" + (" --quick" if quick else "")
            update_demo_readme(readme, result["report"], readme.parent / "docs", command, result["arms"])
    # a damaged store (SweepError), a busy directory, a planted symlink (OSError), a README without its section
    except (ValueError, RuntimeError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the sweep's workers checkpointed and handed back their cells
        typer.echo(interrupted_line(out), err=True)
        raise typer.Exit(130) from None
    for v in json.loads((result["report"] / "summary.json").read_text())["verdicts"]:
        panel = ", ".join(str(result["arms"].get(x, x)) for x in v["panel"].values() if x)
        typer.echo(f"{panel} ({v['metric']}): {v['line']}")
    typer.echo(f"data: {result['data']}; cells: " + ", ".join(f"{k} {v}" for k, v in result["counts"].items() if v))
    typer.echo(f"report: {result['report'] / 'report.html'} and report.md")
