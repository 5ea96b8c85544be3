"""The role plan: every distinct parameter tensor of a model with its role, layout and geometry (one
:class:`PlanEntry` each), its param groups for the optimizers, and its printout (:mod:`moga.roles` builds it)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from moga.layout import as_layout


@dataclass
class PlanEntry:
    name: str
    param: nn.Parameter = field(repr=False)
    role: str
    layout: str | None
    geometry: str
    update: str  # "lmo" (steepest descent) or "adam" (Adam's direction in place of sign(G))
    owner: str  # class name(s) of the owning module(s)
    aliases: tuple[str, ...] = ()
    reason: str = ""  # why the rules chose this role and geometry, when it is not the obvious one

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)

    @property
    def matrix_shape(self) -> tuple[int, int] | None:
        if self.layout is None:
            return None
        lay = as_layout(self.layout)
        return lay.fan_out(self.shape), lay.fan_in(self.shape)


class RolePlan:
    """The role and geometry of every distinct parameter tensor of a model, and the per-role learning-rate
    multipliers the model's kind calls for (``lr_multipliers``, with the reason in ``lr_reason``; an
    optimizer's own ``lr_multipliers=`` wins role by role)."""

    def __init__(self, entries: list[PlanEntry], lr_multipliers: Mapping[str, float] | None = None,
                 lr_reason: str = ""):
        self.entries = entries
        self.lr_multipliers = dict(lr_multipliers or {})
        self.lr_reason = lr_reason
        self.optimizer_multipliers: dict[str, float] | None = None  # {role: multiplier} an optimizer applied
        self.preset: str | None = None  # the optimizer's preset, when it has one
        self.momentum: str | None = None  # the optimizer's momentum, in words, when it has one

    def with_multipliers(self, multipliers: Mapping[str, float], preset: str | None = None,
                         momentum: str | None = None) -> RolePlan:
        """A copy that prints each parameter's lr multiplier (an optimizer's, role by role), its preset and its
        momentum (e.g. "EMA 0.9, Nesterov")."""
        plan = copy.copy(self)
        plan.optimizer_multipliers, plan.preset, plan.momentum = dict(multipliers), preset, momentum
        return plan

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, name: str) -> PlanEntry:
        for e in self.entries:
            if name == e.name or name in e.aliases:
                return e
        raise KeyError(name)

    def roles(self) -> dict[str, str]:
        return {e.name: e.role for e in self.entries}

    def param_groups(self, **defaults) -> list[dict]:
        """One group per (role, geometry, update, layout), in model order; ``defaults`` go in every group."""
        groups: dict[tuple, dict] = {}
        for e in self.entries:
            key = (e.role, e.geometry, e.update, e.layout)
            if key not in groups:
                groups[key] = {
                    "params": [], "names": [], "role": e.role, "geometry": e.geometry,
                    "update": e.update, "layout": e.layout, **defaults,
                }
            groups[key]["params"].append(e.param)
            groups[key]["names"].append(e.name)
        return list(groups.values())

    def rows(self) -> list[dict]:
        return [
            {
                "name": e.name, "shape": list(e.shape), "role": e.role, "layout": e.layout,
                "matrix": list(e.matrix_shape) if e.matrix_shape else None,
                "geometry": e.geometry, "update": e.update, "owner": e.owner, "aliases": list(e.aliases),
                "reason": e.reason,
            }
            for e in self.entries
        ]

    def __str__(self) -> str:
        lrs = self.optimizer_multipliers
        header = ("parameter", "shape", "role", "m x n", "geometry", "update") + (("lr x",) if lrs is not None else ())
        body = []
        for e in self.entries:
            name = e.name + (f" (= {', '.join(e.aliases)})" if e.aliases else "")
            mn = "x".join(map(str, e.matrix_shape)) if e.matrix_shape else "-"
            lr = () if lrs is None else (f"{lrs.get(e.role, 1.0):g}",)
            body.append((name, "x".join(map(str, e.shape)) or "scalar", e.role, mn, e.geometry, e.update, *lr))
        widths = [max(len(r[k]) for r in [header, *body]) for k in range(len(header))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        counts = {}
        for e in self.entries:
            counts[e.role] = counts.get(e.role, 0) + e.param.numel()
        total = sum(counts.values())
        summary = ", ".join(f"{r} {n:,}" for r, n in counts.items())
        notes = _plan_notes(self.entries)
        if self.lr_multipliers:
            scaled = ", ".join(f"{role} x{m:g}" for role, m in self.lr_multipliers.items())
            notes.append(f"note: learning rate {scaled}: {self.lr_reason}")
        if self.momentum is not None:
            source = " (nesterov= sets it; left unset, the preset's)" if self.preset is not None else ""
            notes.append(f"momentum: {self.momentum}{source}")
        if lrs is not None:
            preset = f"the preset {self.preset!r}, " if self.preset is not None else ""
            notes.append(f"lr x: each parameter steps at lr times its role's multiplier ({preset}lr_multipliers= "
                         "override it role by role)")
        return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, body),
                          f"{len(self.entries)} tensors, {total:,} parameters ({summary})", *notes])

    __repr__ = __str__


def _plan_notes(entries: list[PlanEntry]) -> list[str]:
    """One line per reason: the tensors it covers (block indices as '*'), their layout, and the reason."""
    by_reason: dict[str, dict[str, int]] = {}
    layouts: dict[str, set] = {}
    for e in entries:
        if e.reason:
            names = by_reason.setdefault(e.reason, {})
            names[block_glob(e.name)] = names.get(block_glob(e.name), 0) + 1
            layouts.setdefault(e.reason, set()).add(e.layout)
    lines = []
    for reason, names in by_reason.items():
        if any(n in reason for n in names):
            lines.append(f"note: {reason}")  # it names its tensor already (a tie)
            continue
        which = ", ".join(f"{n} ({k})" if k > 1 else n for n, k in names.items())
        lay = "/".join(sorted(filter(None, layouts[reason])))
        lines.append(f"note: {which}: {reason}" + (f"; layout {lay}" if lay else ""))
    return lines


def block_glob(name: str) -> str:
    """The name with its block indices as wildcards: one pattern for the same tensor in every block."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))
