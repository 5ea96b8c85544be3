"""The lean install: `pip install moga` needs only torch, numpy and ninja. Without the cli extra the
optimizers still import and step, and the `moga` command says in one line how to get the rest.

The environment without the extra is made cheaply: a `sys.meta_path` finder, first in line, refuses every
module of the cli extra in a fresh interpreter, as if those packages were not installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from moga.extras import CLI_HINT, CLI_MODULES

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BLOCKED = CLI_MODULES + ("typer", "tomli")

WITHOUT_CLI_EXTRA = f"""
import sys

class NotInstalled:  # wraps each finder: the blocked packages are found nowhere, as if not installed
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)

assert not set({BLOCKED!r}) & set(sys.modules)
sys.meta_path[:] = [NotInstalled(f) for f in sys.meta_path]
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", WITHOUT_CLI_EXTRA + code, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=240)


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def test_the_core_install_needs_torch_and_at_most_numpy_and_ninja():
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert "torch" in core and core <= {"torch", "numpy", "ninja"}, core
    cli = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["cli"]}
    assert {"typer", "rich", "pydantic", "matplotlib", "scikit-learn", "pillow"} <= cli
    dev = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    assert cli <= dev, "the dev extra runs every test, the command's too"


def test_the_optimizers_import_and_step_without_the_cli_extra():
    code = """
import torch
import moga
from moga import MOGA, Muon

for make in (MOGA, Muon):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    opt = make(model, lr=0.02)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert all(not torch.equal(a, b) for a, b in zip(after, before)), make.__name__
loaded = sorted({m.partition(".")[0] for m in sys.modules} & set(%r))
print("stepped", loaded)
""" % (BLOCKED,)
    run = _python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "stepped []"


def test_the_command_without_the_cli_extra_says_how_to_get_it_in_one_line():
    module, _, function = PYPROJECT["project"]["scripts"]["moga"].partition(":")
    code = f"""
import runpy
from {module} import {function} as console_script

for run in (console_script, lambda: runpy.run_module("moga", run_name="__main__")):  # `moga`, `python -m moga`
    sys.argv = ["moga", "train", "--help"]
    try:
        run()
    except SystemExit as e:
        print(repr(e.code))
"""
    run = _python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    # sys.exit(text) prints the text on stderr and exits with status 1
    message = f"{CLI_HINT} (typer is not installed)"
    assert run.stdout.splitlines() == [repr(message)] * 2 and "\n" not in message


def test_the_training_module_without_the_cli_extra_names_the_extra():
    """torchrun runs `python -m moga.train`, whose package imports yaml and pydantic before any command."""
    code = """
import runpy
sys.argv = ["moga.train", "--help"]
runpy.run_module("moga.train", run_name="__main__")
"""
    run = _python(code)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: moga.train needs the cli extra: pip install 'moga[cli]' ("), last


def test_the_command_with_the_cli_extra_runs(capsys, monkeypatch):
    module, _, function = PYPROJECT["project"]["scripts"]["moga"].partition(":")
    monkeypatch.setattr(sys, "argv", ["moga", "--help"])
    with pytest.raises(SystemExit) as exit:
        getattr(__import__(module, fromlist=[function]), function)()
    assert exit.value.code == 0
    assert "reproduce" in capsys.readouterr().out
