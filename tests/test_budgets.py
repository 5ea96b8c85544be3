"""Budgets that hold the shape of the code (docs/development.md, "Budgets"): a source file stays under 500 lines,
a function under 60 lines of code, the plain step reaches its formula within 4 of moga's frames, and no two
functions in src/ share a name. An exception is listed here by name with its reason; the lists only shrink."""

import ast
import sys
from collections import defaultdict
from pathlib import Path

import torch

import moga
from moga.optim import MOGA

SRC = Path(moga.__file__).resolve().parent
FILE_LINES, FUNCTION_LINES, FRAMES = 500, 60, 4

LONG_FILES = {  # file -> why it may pass FILE_LINES for now
}
LONG_FUNCTIONS = {  # module:function -> why it may pass FUNCTION_LINES for now
    "roles/__init__.py:build_plan": "one pass that classifies every parameter; to split",
    "optim/base.py:GeometryOptimizer.__init__": "torch's Optimizer contract: params, plan, multipliers, kernel",
}
# Public wrappers: the same name for the function and the one it wraps.
WRAPPERS = {
    "main": "moga/__main__.py's main wraps cli.main (it checks the cli extra first); sweep/worker.py's is the "
            "`python -m moga.sweep.worker` entry point",
}
SHARED_NAMES = {  # name -> why two functions still share it
    "__getattr__": "the lazy imports of moga/__init__.py and cli.py (PEP 562: the name is the protocol)",
}


def _sources():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), path.read_text()


def code_lines(lines: list[str], node: ast.AST) -> int:
    """Lines of a def that hold code: its docstring, blank lines and comments aside."""
    span = set(range(node.lineno, node.end_lineno + 1))
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        span -= set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i in span if lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every def, methods as Class.method."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def measure() -> dict:
    """The numbers docs/development.md reports: files and functions over budget, and shared function names."""
    long_files, long_functions, names = {}, {}, defaultdict(list)
    for rel, text in _sources():
        lines = text.splitlines()
        if len(lines) > FILE_LINES:
            long_files[rel] = len(lines)
        tree = ast.parse(text)
        for qualname, node in _functions(tree):
            n = code_lines(lines, node)
            if n > FUNCTION_LINES:
                long_functions[f"{rel}:{qualname}"] = n
        for node in tree.body:  # module-level functions: a method is reached through its class
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name].append(rel)
    shared = {name: where for name, where in names.items() if len(where) > 1}
    return {"long_files": long_files, "long_functions": long_functions, "shared_names": shared}


def test_source_files_stay_short():
    over = measure()["long_files"]
    assert set(over) <= set(LONG_FILES), {k: v for k, v in over.items() if k not in LONG_FILES}
    assert set(LONG_FILES) <= set(over), f"back under {FILE_LINES} lines: drop {set(LONG_FILES) - set(over)}"


def test_functions_stay_short():
    over = measure()["long_functions"]
    assert set(over) <= set(LONG_FUNCTIONS), {k: v for k, v in over.items() if k not in LONG_FUNCTIONS}
    assert set(LONG_FUNCTIONS) <= set(over), f"back under budget: drop {set(LONG_FUNCTIONS) - set(over)}"


def test_one_name_per_function():
    shared = measure()["shared_names"]
    allowed = {**WRAPPERS, **SHARED_NAMES}
    assert set(shared) <= set(allowed), {k: v for k, v in shared.items() if k not in allowed}
    assert set(allowed) <= set(shared), f"no longer shared: drop {set(allowed) - set(shared)}"


def test_the_step_names_are_the_reference():
    """lmo_step_ is one function (functional's); the local path imports nothing about sharding."""
    defs = [rel for rel, text in _sources() for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef) and node.name in ("lmo_step", "lmo_step_", "lmo_steps_")]
    assert defs == ["optim/functional.py"], defs
    imported = {alias.name for node in ast.walk(ast.parse((SRC / "optim/functional.py").read_text()))
                if isinstance(node, ast.ImportFrom) for alias in node.names} | {
        node.module for node in ast.walk(ast.parse((SRC / "optim/functional.py").read_text()))
        if isinstance(node, ast.ImportFrom)}
    assert not any("sharded" in name or "DTensor" in name or "whole" in name for name in imported), imported


def step_chain(opt, target: str) -> list[str]:
    """moga's frames from ``opt.step()`` to the first call of ``target`` (a qualified name), by sys.setprofile."""
    chains = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_qualname == target and not chains:
            chain = []
            while frame is not None:
                if frame.f_code.co_filename.startswith(str(SRC)):
                    chain.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_qualname}")
                if frame.f_code.co_qualname == "GeometryOptimizer.step":
                    chains.append(chain[::-1])
                    return
                frame = frame.f_back

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    assert len(chains) == 1, chains
    return chains[0]


def test_the_plain_step_reaches_the_formula_within_four_frames():
    """From ``opt.step()`` to ``Row.apply_lmo_`` (``W += -lr n^(-1/p) phi_p(d)`` per row) on a real MOGA step of
    the plain path, counting moga's own frames (torch's no_grad and profiling wrappers aside), through the
    one-tensor step of moga.optim.functional."""
    w = torch.nn.Parameter(torch.randn(8, 16))
    opt = MOGA([w], geometry="row(p=2)", kernel="torch")
    w.grad = torch.randn(8, 16)
    chain = step_chain(opt, "Row.apply_lmo_")
    assert chain[0] == "base.py:GeometryOptimizer.step" and chain[1] == "functional.py:lmo_step_", chain
    assert chain[-1] == "geometry.py:Row.apply_lmo_" and len(chain) <= FRAMES, chain
