"""moga: geometry-aware optimizers whose learning rate transfers across width and depth.

The names below load on first use (PEP 562), so that ``python -m moga --help`` and other commands that
never step an optimizer do not pay for importing torch."""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "moga.geometry": ("Col", "Embedding", "Geometry", "Row", "Sign", "Spectral", "Vector", "parse_geometry"),
    "moga.optim": ("MOGA", "GeometryOptimizer", "Muon", "ScaledAdamW"),
    "moga.roles": ("PlanError", "RolePlan", "build_plan"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:  # a submodule: moga.depth, moga.roles, ...
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
