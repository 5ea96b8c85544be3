"""`moga tune CONFIG --width W --depth D --budget-flops F`: the learning rate for a target, tuned on proxies.

Register with ``app.command("tune")(tune_command)`` in :mod:`moga.cli`.
"""

from __future__ import annotations

import re
from pathlib import Path

import typer

from moga.experiments.tune.knobs import TuneError
from moga.experiments.tune.plan import MIN_STEPS, REGIMES
from moga.experiments.tune.run import tune
from moga.sweep.executor import EXECUTORS, interrupted_line
from moga.train.cli import refuse_imports

UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)?\s*", text or "")
    if not m:
        raise typer.BadParameter(f"a wall time is a number with s, m, h or d (30m, 2h), got {text!r}")
    return float(m[1]) * UNITS[m[2] or "s"]


def parse_sizes(text: str | None) -> list[tuple[int, int]] | None:
    if not text:
        return None
    try:
        return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",")]  # type: ignore[misc]
    except ValueError:
        raise typer.BadParameter(f"proxies are WIDTHxDEPTH,... (64x2,128x4), got {text!r}") from None


def tune_command(
    config: Path = typer.Argument(..., help="the training setup: a moga train config (data, batch, schedule, steps)"),
    overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="overrides of the config"),
    width: int = typer.Option(None, "--width", min=1, help="the target's width (hidden size); default: the config's"),
    depth: int = typer.Option(None, "--depth", min=1, help="the target's depth (layers); default: the config's"),
    model: str = typer.Option(None, "--model", help="a registered model, package.module:factory(width, depth), or a "
                              "Hugging Face config .json (default: the config's model)"),
    optimizer: str = typer.Option(None, "--optimizer", help="moga, muon, adamw-scaled, ... (default: the config's)"),
    budget_flops: float = typer.Option(None, "--budget-flops", min=0, help="tuning budget in training FLOPs"),
    budget_time: str = typer.Option(None, "--budget-time", help="tuning budget in wall time on --workers cores "
                                    "(estimated): 30m, 2h"),
    out: Path = typer.Option(Path("runs/tune"), "--out", "-o", help="the sweep store and tune.json; re-running resumes"),
    lrs: str = typer.Option(None, "--lrs", help="the lr grid, comma-separated (default: six powers of 2 around the "
                            "optimizer's default); an optimum on its edge grows it"),
    regime: str = typer.Option("auto", "--regime", help=f"{', '.join(REGIMES)}: proxies at the target's tokens per "
                               "parameter, or at its steps (auto: tokens unless that makes runs too short)"),
    min_steps: int = typer.Option(MIN_STEPS, "--min-steps", min=1, help="auto regime: fewest steps a proxy may train"),
    proxies: str = typer.Option(None, "--proxies", help="your own proxies, WIDTHxDEPTH,... (default: chosen)"),
    depth_scaling: str = typer.Option("auto", "--depth-scaling", help="auto (alpha = K_base/K for unit-step "
                                      "optimizers), none or inverse_depth"),
    workers: int = typer.Option(1, "--workers", "-w", min=1, help="worker processes (or Ray tasks)"),
    executor: str = typer.Option("local", "--executor", help=f"one of {', '.join(EXECUTORS)}"),
    ray_address: str = typer.Option(None, "--ray-address", help="Ray cluster address (with --executor ray)"),
    seeds: int = typer.Option(3, "--seeds", min=1, help="seeds at each proxy's decisive rates"),
    max_seeds: int = typer.Option(6, "--max-seeds", min=1, help="most seeds there while the decision is close"),
    max_regret: float = typer.Option(0.02, "--max-regret", min=0, help="largest regret that still transfers"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress line"),
    no_import: bool = typer.Option(False, "--no-import", help="refuse package.module:factory models"),
) -> None:
    """Tune the learning rate for a large model on 2-3 small proxies that fit a budget: the rate, the regret it
    is predicted to cost at the target (95% interval), whether extrapolating is justified, the FLOPs saved, and
    ready-to-run snippets (OUT/tune.json, OUT/tune.md, OUT/target.yaml). Re-running resumes."""
    if no_import:
        refuse_imports()
    try:
        tune(config, out=out, model=model, width=width, depth=depth, optimizer=optimizer, budget_flops=budget_flops,
             budget_seconds=parse_duration(budget_time) if budget_time else None,
             lrs=[float(v) for v in lrs.split(",")] if lrs else None, regime=regime, min_steps=min_steps,
             proxies=parse_sizes(proxies), depth_scaling=depth_scaling, workers=workers, executor=executor,
             ray_address=ray_address, min_seeds=min(seeds, max_seeds), max_seeds=max_seeds, max_regret=max_regret,
             overrides=overrides or (), progress=not quiet, log=typer.echo)
    except (TuneError, ValueError) as e:
        typer.echo(f"error: {str(e).strip().splitlines()[0]}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo(interrupted_line(out), err=True)
        raise typer.Exit(130) from None
