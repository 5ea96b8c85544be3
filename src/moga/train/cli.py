"""`moga train` and `moga lr-range`: command functions for the `moga` app.

Register with ``app.command("train")(train)`` and ``app.command("lr-range")(lr_range)``. Under
``torchrun`` every process runs the same command: ``torchrun --nproc-per-node 2 -m moga.train CONFIG``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import typer

from moga.filelock import DirectoryBusy
from moga.train import CheckpointError, ConfigError, load_config, lr_range_test, run
from moga.train.checkpoint import ALLOW_DATA_CHANGE, ALLOW_UNCHECKED
from moga.train.config import RunConfig, dump_yaml

_SECTIONS = ("model", "data", "optim", "schedule", "train", "eval", "checkpoint", "logging")


def config_reference() -> str:
    """Every config key with its default and meaning, section by section."""
    lines = []
    top = RunConfig.model_fields
    for key in ("seed", "name"):
        lines.append(f"  {key} = {top[key].default!r}: {top[key].description}")
    for section in _SECTIONS:
        cls = top[section].annotation
        lines.append(f"{section}:")
        for key, field in cls.model_fields.items():
            default = field.default if field.default_factory is None else field.default_factory()
            lines.append(f"  {section}.{key} = {default!r}: {field.description or ''}")
        if section == "model":
            lines.append("  model.<argument> = ...: any constructor argument of the model "
                         "(residual_mlp: width, depth, activation; gpt: n_layer, n_embd, n_head, dropout, ...)")
    return "\n".join(lines)


def _split(config: str | None, overrides: list[str] | None) -> tuple[Path | None, list[str]]:
    """The config file is optional: a first argument with '=' in it is an override."""
    overrides = list(overrides or [])
    if config is not None and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    return (Path(config) if config is not None else None), overrides


def _load(config: str | None, overrides: list[str] | None):
    path, items = _split(config, overrides)
    try:
        return load_config(path, items)
    except ConfigError as e:
        raise typer.BadParameter(str(e)) from None


def refuse_imports() -> None:
    """--no-import: set MOGA_NO_IMPORT, so this process and every worker it starts refuse foreign factories."""
    os.environ["MOGA_NO_IMPORT"] = "1"


def out_of_memory(error: BaseException) -> str | None:
    """One line for an allocation that failed (torch's CPU allocator raises a RuntimeError), else None."""
    text = str(error)
    if not (isinstance(error, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()):
        return None
    size = re.search(r"allocate (\d+) bytes", text)
    need = f" (one tensor of {int(size[1]) / 2**30:.3g} GiB)" if size else ""
    return (f"out of memory{need}: make the model or the batch smaller (model.width, model.depth, "
            "train.batch_size), or use a machine with more memory")


def _default_run_dir(cfg) -> Path:
    return Path("runs") / (cfg.name or f"{cfg.model.name}-{cfg.optim.name}-{cfg.hash()[:8]}")


def train(
    config: str = typer.Argument(None, show_default=False, metavar="[CONFIG]",
                                 help="YAML or TOML config file (without one: defaults plus overrides)."),
    overrides: list[str] = typer.Argument(None, show_default=False, metavar="[KEY=VALUE]...",
                                          help="Dotted overrides, values read as YAML: optim.lr=1e-3 model.depth=8 "
                                               "optim.betas=[0.9,0.95] data.root=null."),
    run_dir: Path = typer.Option(None, "--run-dir", "-o", help="Run directory (default: runs/<name>, or "
                                 "runs/<model>-<optim>-<hash>). Rerunning resumes it; a finished run is not "
                                 "retrained."),
    stop_at: int = typer.Option(None, "--stop-at", min=1, help="Checkpoint and stop after this many steps "
                                "(run again to continue)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines; print only the result."),
    wait: bool = typer.Option(False, "--wait", help="If another process is running this run directory, wait for "
                              "it to end, then resume (without --wait: refuse, naming its PID)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config as YAML and exit."),
    keys: bool = typer.Option(False, "--keys", help="List every config key with its default and meaning, and exit."),
    no_import: bool = typer.Option(False, "--no-import", help="Refuse every model.name='package.module:factory', "
                                   "moga's own modules too: a config from an untrusted source cannot import or run "
                                   "code (also: environment variable MOGA_NO_IMPORT=1)."),
    allow_data_change: bool = typer.Option(False, "--allow-data-change", help="Resume a checkpoint on data other "
                                           "than it trained on, on purpose (also: MOGA_ALLOW_DATA_CHANGE=1)."),
    allow_unchecked: bool = typer.Option(False, "--allow-unchecked", help="Resume a checkpoint that has no "
                                         "digests (from an older moga), trusting it (also: MOGA_ALLOW_UNCHECKED=1)."),
) -> None:
    """Train a model; its run directory gets config.yaml, metrics.jsonl, checkpoint.pt and result.json."""
    if no_import:
        refuse_imports()
    for flag, variable in ((allow_data_change, ALLOW_DATA_CHANGE), (allow_unchecked, ALLOW_UNCHECKED)):
        if flag:
            os.environ[variable] = "1"
    if keys:
        typer.echo(config_reference())
        raise typer.Exit()
    cfg = _load(config, overrides)
    if print_config:
        typer.echo(dump_yaml(cfg), nl=False)
        raise typer.Exit()

    directory = run_dir or _default_run_dir(cfg)
    try:
        result = run(cfg, directory, stop_at=stop_at, quiet=quiet, wait=wait)
    except (CheckpointError, DirectoryBusy) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except (ValueError, FileNotFoundError, ImportError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except OSError as e:  # a full disk, a read-only directory: which file, and why
        typer.echo(f"error: could not write {e.filename or directory}: {e.strerror or e}", err=True)
        raise typer.Exit(1) from None
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        typer.echo(f"error: {out_of_memory(e)}", err=True)
        raise typer.Exit(1) from None
    shown = {k: result.get(k) for k in ("status", "steps", "final_train_loss", "val_loss", "val_acc", "wall_time_s")
             if k in result}
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one line, not one per process
        typer.echo(f"{directory}: " + ", ".join(f"{k} {_shown_value(v)}" for k, v in shown.items()))


_TRAIN_HELP = """Train a model; its run directory gets config.yaml, metrics.jsonl, checkpoint.pt (train.parallel=fsdp:
the sharded checkpoint.dcp/) and result.json.

A config file (YAML, or TOML by suffix) and/or KEY=VALUE overrides set the keys below; an unknown key or a
wrong type is an error that lists the valid keys. Rerunning the same command resumes from the checkpoint
(bit for bit on CPU), and a finished run returns its stored result.

A run that diverges ends with status "diverged" and exit code 0: it is a result, not a crash. It diverges
on a non-finite loss, a loss above train.divergence_factor (default 10) times the first step's loss, or
one above train.loss_ceiling (default: none); the default needs no tuning, in sweeps too.
final_train_loss is the mean training loss over the last
eval.final_window steps (default: the last epoch). Several processes: torchrun --nproc-per-node N -m
moga.train CONFIG [KEY=VALUE]... gives the result of one process with the same global batch.

A config is code. model.name "package.module:factory" imports that module and calls the factory with
the model keys, so a config can run anything ("os:system" runs a command): treat a config from an
untrusted source like a script. --no-import (or MOGA_NO_IMPORT=1 in the environment, which sweep workers
inherit) refuses every factory: a config may name only the registered models, data and optimizers.

Config keys (section.key = default: meaning):
"""


def _paragraphs(text: str) -> str:
    """Join the lines of each prose paragraph (rich help keeps single newlines)."""
    return "\n\n".join(" ".join(p.split("\n")) for p in text.strip().split("\n\n"))


train.__doc__ = _paragraphs(_TRAIN_HELP) + "\n\n" + config_reference()


def _shown_value(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def lr_range(
    config: str = typer.Argument(None, show_default=False, metavar="[CONFIG]", help="YAML or TOML config file."),
    overrides: list[str] = typer.Argument(None, show_default=False, metavar="[KEY=VALUE]...",
                                          help="Dotted overrides, as for `moga train`."),
    out_dir: Path = typer.Option(Path("lr_range"), "--out", "-o", help="Where lr_range.json and lr_range.png go."),
    lr_min: float = typer.Option(1e-5, "--lr-min", min=0, help="Smallest learning rate."),
    lr_max: float = typer.Option(10.0, "--lr-max", min=0, help="Largest learning rate."),
    steps: int = typer.Option(100, "--steps", min=3, help="sweep: steps from lr_min to lr_max."),
    mode: str = typer.Option("sweep", "--mode", help="sweep (Smith: one run, lr grows every step) or restart "
                             "(the paper: each lr trains the initial model for --steps-per-lr steps)."),
    num_lrs: int = typer.Option(8, "--num-lrs", min=2, help="restart: number of learning rates."),
    steps_per_lr: int = typer.Option(None, "--steps-per-lr", min=1, help="restart: steps per lr (default: one epoch)."),
) -> None:
    """Learning-rate range test: loss against exponentially growing lr, a suggested lr, a plot."""
    cfg = _load(config, overrides)

    try:
        result = lr_range_test(cfg, out_dir, lr_min=lr_min, lr_max=lr_max, steps=steps, mode=mode,
                               num_lrs=num_lrs, steps_per_lr=steps_per_lr)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(json.dumps({"suggestion": result["suggestion"], "plot": result.get("plot"),
                           "json": str(out_dir / "lr_range.json")}, indent=1))
