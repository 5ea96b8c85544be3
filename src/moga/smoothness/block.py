"""The block norm of a geometry plan: every parameter in its own geometry, tied together by a max.

``||W||_block = max_k ||W_k||_k`` and its dual ``||G||_block,* = sum_k ||G_k||_k*`` (docs/math.md §1.5).
The block LMO is every parameter's own LMO together: the block ball is a product of balls,
so ``<G, D>`` is minimised over it one factor at a time. Tensors travel as lists in the order of
``block.entries`` (``block.params``), the order every function of this package expects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from moga.geometry import Geometry, Spectral, parse_geometry
from moga.layout import resolve_layout
from moga.roles import RolePlan, build_plan

Tensors = Sequence[torch.Tensor]


def exact_geometry(geometry: Geometry) -> Geometry:
    """The same norm with an exact LMO: Muon's Newton-Schulz polar factor is swapped for the SVD one.

    Newton-Schulz leaves singular values in roughly [0.7, 1.2], so its "unit" direction can lie outside the
    unit ball, and a value computed from it would no longer be a lower bound. Norms and dual norms are
    exact in every geometry already.
    """
    if isinstance(geometry, Spectral) and geometry.method != "svd":
        return dataclasses.replace(geometry, method="svd")
    return geometry


@dataclass(frozen=True, eq=False)
class BlockEntry:
    """One parameter of the block: its geometry and the layout that orients it."""

    name: str
    param: torch.Tensor
    geometry: Geometry
    layout: str | None = None
    role: str | None = None
    update: str = "lmo"  # "adam" entries step with Adam's direction; their norms are the sign geometry's
    group: int | None = None  # index of the optimizer param group, when built from an optimizer

    def norm(self, t: torch.Tensor) -> float:
        return float(self.geometry.norm(t, self.layout))

    def dual_norm(self, t: torch.Tensor) -> float:
        return float(self.geometry.dual_norm(t, self.layout))

    def lmo(self, t: torch.Tensor) -> torch.Tensor:
        return self.geometry.lmo(t, self.layout)


class BlockGeometry:
    """``||.||_block`` over a list of parameters, with its dual norm and LMO over lists of tensors."""

    def __init__(self, entries: Iterable[BlockEntry]):
        self.entries = list(entries)
        if not self.entries:
            raise ValueError("a block geometry needs at least one parameter")
        for e in self.entries:
            if e.geometry.matrix:  # fail now, with the name, rather than inside a norm later
                try:
                    resolve_layout(e.layout, e.param)
                except ValueError as err:
                    raise ValueError(f"{e.name}: {err}") from None

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_plan(cls, plan, exact: bool = True) -> BlockGeometry:
        """From a :class:`~moga.roles.RolePlan`; ``exact`` swaps approximate LMOs for exact ones."""
        entries = []
        for e in plan:
            geometry = parse_geometry(e.geometry)
            entries.append(BlockEntry(e.name, e.param, exact_geometry(geometry) if exact else geometry,
                                      e.layout, e.role, e.update))
        return cls(entries)

    @classmethod
    def from_model(cls, model: nn.Module, geometries: Mapping[str, str] | None = None,
                   overrides: Mapping | None = None, exact: bool = True) -> BlockGeometry:
        """From the role plan of ``model`` (``geometries`` maps role -> spec, as in ``build_plan``)."""
        own = model.plan_overrides() if callable(getattr(model, "plan_overrides", None)) else {}
        return cls.from_plan(build_plan(model, geometries, {**own, **(overrides or {})}), exact)

    @classmethod
    def from_optimizer(cls, optimizer, exact: bool = True) -> BlockGeometry:
        """From a :class:`~moga.optim.GeometryOptimizer`'s param groups: the norms it takes steps in."""
        plan = getattr(optimizer, "plan", None)
        roles = {id(e.param): (e.name, e.role) for e in plan} if plan is not None else {}
        entries = []
        for gi, group in enumerate(optimizer.param_groups):
            if group.get("geometry") is None:
                raise ValueError(f"param group {gi} has no geometry: only moga's geometry optimizers define norms")
            geometry = parse_geometry(group["geometry"])
            if exact:
                geometry = exact_geometry(geometry)
            for k, p in enumerate(group["params"]):
                name, role = roles.get(id(p), (None, group.get("role")))
                if name is None:
                    name = group["names"][k] if "names" in group else f"group{gi}.param{k}"
                layout = resolve_layout(group["layout"], p).spec if geometry.matrix else None
                entries.append(BlockEntry(name, p, geometry, layout, role, group.get("update", "lmo"), gi))
        return cls(entries)

    @classmethod
    def of(cls, source, exact: bool = True) -> BlockGeometry:
        """A block geometry from whatever the caller holds: itself, a plan, an optimizer or a model."""
        if isinstance(source, BlockGeometry):
            return source
        if isinstance(source, RolePlan):
            return cls.from_plan(source, exact)
        if isinstance(source, torch.optim.Optimizer):
            return cls.from_optimizer(source, exact)
        if isinstance(source, nn.Module):
            return cls.from_model(source, exact=exact)
        raise TypeError(f"cannot build a block geometry from {type(source).__name__}: pass a RolePlan, "
                        "a moga optimizer, a model or a BlockGeometry")

    def select(self, keep) -> BlockGeometry:
        """The block of the entries with ``keep(entry)`` true, e.g. ``lambda e: e.role == "hidden"``: its
        constants are those of the loss as a function of these parameters alone, the others held fixed."""
        return BlockGeometry(e for e in self.entries if keep(e))

    # --- the parameters ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def params(self) -> list[torch.Tensor]:
        return [e.param for e in self.entries]

    def snapshot(self) -> list[torch.Tensor]:
        """Detached copies of the current parameters."""
        return [e.param.detach().clone() for e in self.entries]

    def grads(self) -> list[torch.Tensor]:
        """Copies of the parameters' ``.grad`` (zeros where there is none)."""
        return [e.param.grad.detach().clone() if e.param.grad is not None else torch.zeros_like(e.param)
                for e in self.entries]

    def check(self, tensors: Tensors) -> None:
        """One tensor per entry, each of its parameter's shape (catches lists in another order)."""
        if len(tensors) != len(self.entries):
            raise ValueError(f"expected {len(self.entries)} tensors (one per block entry), got {len(tensors)}")
        for e, t in zip(self.entries, tensors):
            if t.shape != e.param.shape:
                raise ValueError(f"{e.name}: got a tensor of shape {tuple(t.shape)} for a parameter of shape "
                                 f"{tuple(e.param.shape)}; tensors must follow the order of block.entries")

    # --- norms --------------------------------------------------------------------------------------

    def norms(self, tensors: Tensors) -> list[float]:
        """``||T_k||_k`` for every parameter k."""
        self.check(tensors)
        return [e.norm(t) for e, t in zip(self.entries, tensors)]

    def norm(self, tensors: Tensors) -> float:
        """``||T||_block = max_k ||T_k||_k``."""
        return max(self.norms(tensors))

    def dual_norms(self, tensors: Tensors) -> list[float]:
        """``||G_k||_k*`` for every parameter k."""
        self.check(tensors)
        return [e.dual_norm(t) for e, t in zip(self.entries, tensors)]

    def dual_norm(self, tensors: Tensors) -> float:
        """``||G||_block,* = sum_k ||G_k||_k*``."""
        return sum(self.dual_norms(tensors))

    def lmo(self, tensors: Tensors) -> list[torch.Tensor]:
        """``argmin_{||D||_block <= 1} <G, D>``: each parameter's own LMO."""
        self.check(tensors)
        return [e.lmo(t) for e, t in zip(self.entries, tensors)]

    def ascent(self, tensors: Tensors) -> list[torch.Tensor]:
        """``argmax_{||D||_block <= 1} <G, D> = -lmo(G)``, where ``<G, D> = ||G||_block,*``."""
        return [d.neg_() for d in self.lmo(tensors)]

    def random_unit(self, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """A random point of the unit sphere: a Gaussian divided by its block norm (the ball is filled
        only near its boundary in high dimension; extreme points come from :meth:`ascent`)."""
        noise = [_randn_like(e.param, generator) for e in self.entries]
        scale = self.norm(noise)
        return [z.div_(scale) for z in noise]


def inner(a: Tensors, b: Tensors) -> float:
    """``<A, B> = sum_k sum(A_k * B_k)``, accumulated in float64."""
    if len(a) != len(b):
        raise ValueError(f"inner product of {len(a)} and {len(b)} tensors")
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def difference(a: Tensors, b: Tensors) -> list[torch.Tensor]:
    """``A - B`` tensor by tensor."""
    if len(a) != len(b):
        raise ValueError(f"difference of {len(a)} and {len(b)} tensors")
    return [x.detach() - y.detach() for x, y in zip(a, b)]


def _randn_like(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
