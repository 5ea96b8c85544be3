"""The `moga` command line. Subcommands live beside the code they drive."""

from __future__ import annotations

import typer

from pathlib import Path

from moga.bench.cli import bench_app
from moga.smoothness.cli import smoothness_command
from moga.sweep.cli import sweep
from moga.sweep.report.cli import report_command
from moga.train_cli import lr_range, train

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Geometry-aware optimizers, and the tools to show that a learning rate transfers.")
app.command("train")(train)
app.command("lr-range")(lr_range)
app.command("sweep")(sweep)
app.command("report")(report_command)
app.command("smoothness")(smoothness_command)
app.add_typer(bench_app, name="bench")


@app.command("demo")
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="where the sweep and its report go"),
    quick: bool = typer.Option(False, "--quick", help="digits, narrow and short: about a minute"),
    workers: int = typer.Option(2, "--workers", "-w", min=1, help="worker processes"),
    data: str = typer.Option(None, help="fashion-mnist or digits (default: Fashion-MNIST where installed)"),
    update_readme: Path = typer.Option(None, help="write the figure and verdicts into this README's demo section"),
) -> None:
    """The depth paper's figure 1 at CPU scale: residual MLPs at depths 2-32, AdamW vs Muon vs MOGA, with and
    without alpha = K_base/K, six learning rates each; then the transfer report. Re-running resumes."""
    import json

    from moga.demo import run_demo

    result = run_demo(out, quick=quick, workers=workers, data=data)
    if update_readme is not None:
        from moga.demo import update_readme as write_section

        command = "moga demo" + (" --quick" if quick else "")
        write_section(update_readme, result["report"], update_readme.parent / "docs", command)
    for v in json.loads((result["report"] / "summary.json").read_text())["verdicts"]:
        panel = ", ".join(str(x) for x in v["panel"].values() if x)
        typer.echo(f"{panel} ({v['metric']}): {v['line']}")
    typer.echo(f"data: {result['data']}; cells: " + ", ".join(f"{k} {v}" for k, v in result["counts"].items() if v))
    typer.echo(f"report: {result['report'] / 'report.html'} and report.md")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
