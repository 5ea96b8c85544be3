"""The `moga` command line. Subcommands live beside the code they drive."""

from __future__ import annotations

import typer

from moga.bench.cli import bench_app
from moga.data.cli import data_app
from moga.experiments.coordcheck import coordcheck_command
from moga.experiments.demo import demo_command
from moga.experiments.reproduce.cli import reproduce_command
from moga.experiments.smoothness.cli import smoothness_command
from moga.experiments.tune.cli import tune_command
from moga.sweep.cli import sweep
from moga.sweep.report.cli import report_command
from moga.train.cli import lr_range, train

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Geometry-aware optimizers, and the tools to show that a learning rate transfers.")
app.command("train")(train)
app.command("lr-range")(lr_range)
app.command("sweep")(sweep)
app.command("report")(report_command)
app.command("smoothness")(smoothness_command)
app.command("demo")(demo_command)
app.command("reproduce")(reproduce_command)
app.command("coordcheck")(coordcheck_command)
app.command("tune")(tune_command)
app.add_typer(bench_app, name="bench")
app.add_typer(data_app, name="data")


def main() -> None:
    app()
