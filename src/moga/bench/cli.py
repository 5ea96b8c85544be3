"""`moga bench ...`: timed comparisons against torch."""

from __future__ import annotations

import json

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Timed comparisons against torch, side by side in one run.")


@bench_app.command("optimizer")
def optimizer(
    blocks: int = typer.Option(2, min=1, help="GPT-2-small blocks (4x 768x768, 3072x768, 768x3072 each)."),
    repeats: int = typer.Option(7, min=1, help="Timed steps per optimizer (median reported)."),
    warmup: int = typer.Option(1, min=0, help="Untimed steps first (state allocation)."),
    only: list[str] = typer.Option(None, "--only", help="Optimizer names to run (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of records instead of a table."),
) -> None:
    """Time one optimizer step: torch AdamW (foreach, fused), torch Muon and every moga geometry."""
    from moga.bench.optimizer import add_ratios, bench_optimizers

    try:
        records = add_ratios(bench_optimizers(blocks, repeats, warmup, names=only or None))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one step, {records[0]['params']:,} parameters, {records[0]['threads']} threads")
    for col in ("optimizer", "kernel", "median ms", "min ms", "x adamw-fused", "state MB", "state x adamw"):
        table.add_column(col, justify="right" if col != "optimizer" else "left", no_wrap=col in ("optimizer", "kernel"))
    for r in records:
        table.add_row(
            r["name"], r["kernel"], f"{r['ms']:.1f}", f"{r['ms_min']:.1f}", f"{r.get('ms_vs_adamw_fused', float('nan')):.2f}",
            f"{r['state_bytes'] / 2**20:.1f}", f"{r.get('state_vs_adamw', float('nan')):.2f}",
        )
    Console().print(table)
