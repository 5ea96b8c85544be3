"""The `moga` command line. Subcommands live beside the code they drive."""

from __future__ import annotations

import typer

from moga.bench.cli import bench_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Geometry-aware optimizers and learning-rate transfer.")
app.add_typer(bench_app, name="bench")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
