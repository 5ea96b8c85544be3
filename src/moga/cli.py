"""The `moga` command. Subcommands are imported when they run: `moga --help` and `moga reproduce --list`
load neither the training engine nor scipy, matplotlib or torch.distributed (tests/test_cli.py holds it)."""

from __future__ import annotations

import importlib

import typer
from typer.core import TyperGroup

# name -> (module, attribute: a command function or a Typer app, its one-line help as `moga --help` shows it;
# kept here, so that `moga --help` imports no command)
COMMANDS = {
    "train": ("moga.train.cli", "train", "Train a model; its run directory gets config.yaml, metrics.jsonl, "
              "checkpoint.pt (train.parallel=fsdp: the sharded checkpoint.dcp/) and result.json."),
    "lr-range": ("moga.train.cli", "lr_range", "Learning-rate range test: loss against exponentially growing lr, "
                 "a suggested lr, a plot."),
    "sweep": ("moga.sweep.cli", "sweep", "Run every cell of a learning-rate sweep; re-running resumes it, and "
              "several processes can share it."),
    "report": ("moga.sweep.report.cli", "report_command", "Figures (loss vs lr, one curve per scale), optima, "
               "drift, regret and a verdict per panel."),
    "smoothness": ("moga.experiments.smoothness.cli", "smoothness_command", "Measure the depth and width papers' "
                   "smoothness claims and reproduce the convergence paper at CPU scale."),
    "demo": ("moga.experiments.demo", "demo_command", "The depth paper's figure 1 at CPU scale."),
    "reproduce": ("moga.experiments.reproduce.cli", "reproduce_command", "Every claim of the three papers as one "
                  "command."),
    "coordcheck": ("moga.experiments.coordcheck_cli", "coordcheck_command", "muP's coordinate check."),
    "tune": ("moga.experiments.tune.cli", "tune_command", "Tune the learning rate on small proxies and carry it to "
             "a larger target, with the regret it will cost."),
    "bench": ("moga.bench.cli", "bench_app", "Timed comparisons against torch, side by side in one run."),
    "data": ("moga.data.cli", "data_app", "Datasets: download where a network exists."),
}


def load_command(name: str):
    module, attribute, _ = COMMANDS[name]
    target = getattr(importlib.import_module(module), attribute)
    if isinstance(target, typer.Typer):  # a group even with one subcommand (get_command would make `moga data`
        command = typer.main.get_group(target)  # the fetch command itself, refusing `moga data fetch NAME`)
    else:
        wrapper = typer.Typer(add_completion=False)
        wrapper.command(name)(target)
        command = typer.main.get_command(wrapper)
    command.name = name
    return command


class LazyGroup(TyperGroup):
    """A Typer group (typer runs its own copy of click: only its main maps typer.Exit to its code, Ctrl-C to 130
    and a bad parameter to one line) that imports a subcommand when it runs."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        return load_command(name) if name in COMMANDS else None

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(name, help) for name, (_, _, help) in COMMANDS.items()])


HELP = "Geometry-aware optimizers, and the tools to show that a learning rate transfers."
command = LazyGroup(name="moga", no_args_is_help=True, help=HELP, rich_markup_mode=None)  # plain help: no import


def main() -> None:
    command()


def __getattr__(name: str):
    if name == "app":  # the whole command as a Typer app, every subcommand imported (typer.testing's CliRunner)
        app = typer.Typer(no_args_is_help=True, add_completion=False, help=HELP)
        for sub, (module, attribute, _) in COMMANDS.items():
            target = getattr(importlib.import_module(module), attribute)
            if isinstance(target, typer.Typer):
                app.add_typer(target, name=sub)
            else:
                app.command(sub)(target)
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
