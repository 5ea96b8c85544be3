"""The `cli` extra: what the `moga` command needs beyond torch, and the one line that says how to get it.

``pip install moga`` brings the optimizers (torch, numpy, ninja); ``pip install 'moga[cli]'`` adds the
command, the training engine, sweeps, reports and figures.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

# The top-level modules of the cli extra's packages (pyproject.toml, [project.optional-dependencies] cli).
CLI_MODULES = ("typer", "click", "rich", "pydantic", "yaml", "scipy", "matplotlib", "sklearn", "PIL")
CLI_HINT = "the moga command needs the cli extra: pip install 'moga[cli]'"


@contextmanager
def cli_extra():
    """Inside, a missing module of the cli extra ends the process with :data:`CLI_HINT` (exit status 1)
    instead of a traceback; any other error passes through."""
    try:
        yield
    except ModuleNotFoundError as e:
        if not _of_cli_extra(e):
            raise
        sys.exit(f"{CLI_HINT} ({e.name} is not installed)")


@contextmanager
def needs_cli_extra(what: str):
    """For a package of the cli extra's world (``moga.train``): importing it without the extra raises a
    ModuleNotFoundError whose message says which install brings it, not only which module is missing."""
    try:
        yield
    except ModuleNotFoundError as e:
        if not _of_cli_extra(e):
            raise
        raise ModuleNotFoundError(f"{what} needs the cli extra: pip install 'moga[cli]' ({e.name} is not installed)",
                                  name=e.name) from e


def _of_cli_extra(error: ModuleNotFoundError) -> bool:
    return (error.name or "").partition(".")[0] in CLI_MODULES
