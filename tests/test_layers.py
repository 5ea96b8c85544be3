"""The package's imports run one way, top to bottom, with no cycles (every import counts, also those
inside functions: a function-level import that hides a cycle is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import moga

# Lowest first. A module may import from its own layer and from lower ones, never from a higher one.
# The smoothness library (block norm, Hessian operator, estimates, diagnostics) needs only the core and
# the models, and training logs its diagnostics, so it sits below train.
LAYERS = [
    ["moga.hardware", "moga.layout", "moga.workspace", "moga.numerics", "moga.orthogonalize", "moga.geometry_base",
     "moga.geometry", "moga.forward_use", "moga.roles", "moga.status", "moga.verdicts", "moga.kernels",
     "moga.filelock", "moga.files",
     "moga.extras"],
    ["moga.optim", "moga.depth", "moga.models"],
    ["moga.smoothness"],
    ["moga.data", "moga.train", "moga.integrations"],
    ["moga.sweep"],
    ["moga.experiments", "moga.bench"],
    ["moga.cli", "moga.__main__", "moga"],
]

ROOT = Path(moga.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in found if m == "moga" or m.startswith("moga.")}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        edges[name] = {m for m in imports_of(path, name) if m in files and m != name}
    return edges


def layer_of(name: str) -> int:
    best, index = "", None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    assert index is not None, f"{name} is in no layer: add it to LAYERS in {__file__}"
    return index


def test_every_module_has_a_layer():
    for name in graph():
        layer_of(name)


def test_every_layer_entry_names_a_module():
    modules = set(graph())
    stale = [prefix for layer in LAYERS for prefix in layer
             if not any(m == prefix or m.startswith(prefix + ".") for m in modules)]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_no_import_goes_up_a_layer():
    upward = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph().items() for b in targets
        if b != "moga" and layer_of(b) > layer_of(a)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = graph()
    # a package's __init__ re-exporting its submodules is not a cycle with them
    edges = {a: {b for b in bs if not a.startswith(b + ".") and b != "moga"} for a, bs in edges.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
