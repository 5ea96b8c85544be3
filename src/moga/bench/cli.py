"""`moga bench ...`: timed comparisons against torch."""

from __future__ import annotations

import json

import torch
import typer
from rich.console import Console
from rich.table import Table

from moga.bench.distributed import OPTIMIZERS, bench_distributed
from moga.bench.optimizer import add_ratios, bench_optimizers, default_names

bench_app = typer.Typer(no_args_is_help=True, help="Timed comparisons against torch, side by side in one run.")


@bench_app.command("optimizer")
def optimizer(
    blocks: int = typer.Option(1, min=1, help="GPT-2-small blocks (4x 768x768, 3072x768, 768x3072 each)."),
    repeats: int = typer.Option(5, min=1, help="Timed steps per optimizer (median reported)."),
    warmup: int = typer.Option(1, min=0, help="Untimed steps first (state allocation)."),
    only: list[str] = typer.Option(None, "--only", help="Optimizer names to run (default: all but the row-family "
                                                        "hybrids and records this CPU emulates; see --all)."),
    full: bool = typer.Option(False, "--all", help="Time every record: adds the row-family hybrids (seconds a step "
                                                   "on a CPU) and torch's bfloat16 Muon where this CPU emulates it."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of records instead of a table."),
    device: str = typer.Option("cpu", help="Where the parameters live: cpu, cuda, cuda:1, ..."),
    clock: str = typer.Option("wall", help="wall, or cpu: the process's CPU time, which leaves out the time a busy "
                                           "host keeps it off the CPU (use it with --threads 1)."),
    threads: int = typer.Option(None, min=1, help="CPU threads for torch (default: torch's own choice)."),
) -> None:
    """Time one optimizer step: torch AdamW (foreach, fused), torch Muon and every moga geometry. The default run
    takes a few minutes on a 2-core CPU; --all times every record, and docs/results.md's tables use --blocks 2
    --repeats 7."""
    before = torch.get_num_threads()
    try:
        names, note = (only, None) if only else default_names(device, full)
        if note:
            typer.echo(f"moga bench optimizer: {note}", err=True)
        torch.set_num_threads(threads or before)
        records = add_ratios(bench_optimizers(blocks, repeats, warmup, names=names, device=device,
                                              clock=clock))
    except (ValueError, RuntimeError) as e:  # RuntimeError: torch.device's on a bad device name
        raise typer.BadParameter(str(e)) from None
    finally:
        torch.set_num_threads(before)  # the caller's setting (the command also runs inside tests)
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return

    table = Table(title=f"one step, {records[0]['params']:,} parameters, {records[0]['device']}, "
                        f"{records[0]['threads']} CPU threads, {records[0]['clock']} clock; ratios: median "
                        "over rounds (quartiles)")
    for col in ("optimizer", "kernel", "median ms", "min ms", "x adamw-fused", "x peer", "state MB", "state x adamw"):
        table.add_column(col, justify="right" if col != "optimizer" else "left", no_wrap=col in ("optimizer", "kernel", "x peer", "x adamw-fused"))
    for r in records:
        table.add_row(
            r["name"], r["kernel"], f"{r['ms']:.1f}", f"{r['ms_min']:.1f}",
            _with_quartiles(r.get("ms_vs_adamw_fused", float("nan")), r.get("ms_vs_adamw_fused_iqr")),
            f"{_with_quartiles(r['ms_vs_peer'], r.get('ms_vs_peer_iqr'))} {r['peer']}" if "peer" in r else "",
            f"{r['state_bytes'] / 2**20:.1f}", f"{r.get('state_vs_adamw', float('nan')):.2f}",
        )
    Console(width=max(Console().width, 132)).print(table)  # the peer column's names fit unwrapped


def _with_quartiles(ratio: float, iqr: list[float] | None) -> str:
    return f"{ratio:.2f}" if iqr is None else f"{ratio:.2f} ({iqr[0]:.2f}-{iqr[1]:.2f})"


@bench_app.command("distributed")
def distributed(
    world: int = typer.Option(2, min=2, help="gloo processes on this machine."),
    blocks: int = typer.Option(1, min=1, help="GPT-2-small blocks (4x 768x768, 3072x768, 768x3072 each)."),
    vocab: int = typer.Option(50257, min=1, help="Rows of the token table."),
    width: int = typer.Option(768, min=1, help="Model width (GPT-2-small: 768); smaller for quick checks."),
    repeats: int = typer.Option(5, min=1, help="Timed steps per optimizer (median reported)."),
    only: list[str] = typer.Option(None, "--only", help="Optimizer names to run (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of records instead of a table."),
) -> None:
    """One step on FSDP2-sharded GPT-2-small shapes: step time and the bytes each optimizer communicates."""
    unknown = set(only or ()) - set(OPTIMIZERS)
    if unknown:
        raise typer.BadParameter(f"unknown optimizer(s) {sorted(unknown)}; known: {', '.join(OPTIMIZERS)}")
    records = bench_distributed(world, blocks, vocab, width, repeats, only or None)
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return

    r0 = records[0]
    table = Table(title=f"one step, FSDP2 on {r0['world']} gloo ranks, {r0['params']:,} parameters "
                        f"({r0['matrices']} matrices, {r0['matrix_bytes'] / 2**20:.1f} MiB)")
    for col in ("optimizer", "kernel", "median ms", "x adamw-fused", "x peer", "collectives", "bytes, rank 0",
                "bytes, all ranks", "x matrix bytes"):
        table.add_column(col, justify="left" if col in ("optimizer", "collectives") else "right",
                         no_wrap=col in ("optimizer", "kernel", "x peer"))
    for r in records:
        calls = ", ".join(f"{n} {k}" for n, k in sorted(r["collectives"].items())) or "none"
        table.add_row(r["name"], r["kernel"], f"{r['ms']:.1f}", f"{r.get('ms_vs_adamw_fused', float('nan')):.2f}",
                      f"{r['ms_vs_peer']:.2f} {r['peer']}" if "peer" in r else "", calls, f"{r['bytes_rank0']:,}",
                      f"{r['bytes_all_ranks']:,}", f"{r['bytes_all_ranks'] / r['matrix_bytes']:.3f}")
    Console(width=max(Console().width, 150)).print(table)
