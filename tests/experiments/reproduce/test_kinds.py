"""A claim kind is one object, defined once and registered once; nothing outside the registry dispatches on a
kind's name, and a stored outcome is recognized as the kind it was made by."""

import ast
import json
from pathlib import Path

import pytest

import moga
from moga.experiments.reproduce.catalog import KINDS, catalog, get, kind_of, stored_kind
from moga.experiments.reproduce.kinds import ClaimKind, kind_registry

SRC = Path(moga.__file__).parent
STORED = Path(__file__).parents[3] / "docs" / "reproduce" / "cpu"


def _trees():
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text())


def test_a_kind_registered_twice_is_refused():
    with pytest.raises(ValueError, match="'gap' is registered twice"):
        kind_registry(*KINDS.values(), KINDS["gap"])


def test_every_kind_is_defined_once_and_every_reproduction_has_one():
    defined = [node.args[0].value for _, tree in _trees() for node in ast.walk(tree)
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ClaimKind"]
    assert sorted(defined) == sorted(KINDS)  # each name once, each defined kind registered
    assert all(isinstance(k, ClaimKind) and k.name == name for name, k in KINDS.items())
    assert {kind_of(rep).name for rep in catalog().values()} == set(KINDS)


def _names(node) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _is_kind(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "kind"


def test_no_module_dispatches_on_a_kind_name():
    """``rep.kind == "gap"``, ``rep.kind in ("transfer", "joint")`` or ``{"race": ...}[rep.kind]``: the
    kind's object says it instead (kinds.py's ClaimKind fields)."""
    found = []
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_is_kind(s) for s in sides) and set().union(*map(_names, sides)) & set(KINDS):
                    found.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Subscript) and _is_kind(node.slice) and isinstance(node.value, ast.Dict):
                found.append(f"{rel}:{node.lineno}")
    assert not found, found


def test_each_stored_outcome_is_recognized_as_its_kind():
    """docs/reproduce/cpu: the outcome of a kind that rechecks is that kind's and no other's."""
    checked = 0
    for path in sorted(STORED.glob("*.json")):
        outcome = json.loads(path.read_text())
        kind = kind_of(get(outcome["name"]))
        owners = [k.name for k in KINDS.values() if k.stores(outcome)]
        if kind.rejudge is None:
            assert owners == [], path.name
            continue
        if owners:  # an outcome stored before it kept its numbers has none
            assert owners == [kind.name] and stored_kind(outcome) is kind, path.name
            checked += 1
    if not checked:
        pytest.skip("no stored CPU outcome keeps its numbers yet")
