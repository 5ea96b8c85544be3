"""What every geometry is (:class:`Geometry`: norm, dual norm, LMO and its in-place step, the dims a step reduces
over, its kernel form) and the fused kernel's form of a step (:class:`KernelPlan`). The geometries themselves,
one per row of docs/math.md §2, and ``parse_geometry`` are in :mod:`moga.geometry`."""

from __future__ import annotations

import functools
import math
from dataclasses import fields
from typing import NamedTuple

import torch

from moga.layout import Layout, resolve_layout
from moga.numerics import INF, Reduce, Scalar, add_scaled_
from moga.workspace import Workspace


def zero_size_safe(method):
    """A zero-size tensor has no direction (and no 0 ** -1/p): its norms and LMO are zero, its step a no-op."""

    @functools.wraps(method)
    def wrapper(self, t, *args, **kwargs):
        if t.numel() == 0 or (method.__name__ == "apply_lmo_" and args[0].numel() == 0):
            if method.__name__ == "lmo":
                return torch.zeros_like(t)
            return None if method.__name__ == "apply_lmo_" else t.new_zeros(())
        return method(self, t, *args, **kwargs)

    return wrapper


class _ZeroSizeSafe(type):
    def __new__(mcs, name, bases, ns):
        for key in ("norm", "dual_norm", "lmo", "apply_lmo_"):
            if key in ns:
                ns[key] = zero_size_safe(ns[key])
        return super().__new__(mcs, name, bases, ns)


def check_exponent(name: str, p: float) -> float:
    p = float(p)
    if math.isnan(p) or p < 1:
        raise ValueError(f"{name} must be a real number >= 1 (or inf), got {p}")
    return p


class KernelPlan(NamedTuple):
    """A step the fused kernel takes: ``-factor * phi_p`` along K of the tensor's (B, K, N) view."""

    shape: tuple[int, int, int]  # (B, K, N)
    p: float
    factor: float

    @staticmethod
    def along(shape, dims: tuple[int, ...], p: float, factor: float) -> KernelPlan | None:
        """``phi_p`` along the tensor dims ``dims``; None for p = inf (no kernel form) or dims that are not
        adjacent (no (B, K, N) view). p = 1 is elementwise: any rows will do."""
        if p == INF:
            return None
        if p == 1:
            last = shape[-1] if len(shape) else 1
            return KernelPlan((math.prod(shape) // last, last, 1), 1.0, factor)
        if list(dims) != list(range(dims[0], dims[-1] + 1)):
            return None
        return KernelPlan((math.prod(shape[: dims[0]]), math.prod(shape[dims[0]: dims[-1] + 1]),
                           math.prod(shape[dims[-1] + 1:])), p, factor)


class Geometry(metaclass=_ZeroSizeSafe):
    """A norm on one parameter, with its dual norm and linear minimisation oracle.

    ``lmo(G)`` returns ``D* = argmin_{||D|| <= 1} <G, D>``, so ``<G, D*> = -dual_norm(G)`` and the
    optimizer step is ``W <- (1 - lr*wd) W + lr * D*``.
    """

    name = "geometry"
    matrix = True  # needs a layout with fan_out and fan_in axes
    batched = True  # same-shape whole-matrix steps may share one batched call (see Spectral)
    stateful = False  # keeps per-parameter state besides momentum (see state_shape)

    def reduced_dims(self, layout: str | Layout | None = None) -> tuple[int, ...]:
        """The tensor dims the step reduces over: sharding one of them needs ``reduce``."""
        raise NotImplementedError

    def norm(self, d: torch.Tensor, layout: str | Layout | None = None, reduce: Reduce | None = None, shape=None):
        raise NotImplementedError

    def dual_norm(self, g: torch.Tensor, layout: str | Layout | None = None, reduce: Reduce | None = None,
                  shape=None):
        raise NotImplementedError

    def lmo(self, g: torch.Tensor, layout: str | Layout | None = None, reduce: Reduce | None = None, shape=None):
        raise NotImplementedError

    def apply_lmo_(self, param: torch.Tensor, g: torch.Tensor, alpha: Scalar, layout=None,
                   workspace: Workspace | None = None, reduce: Reduce | None = None, shape=None) -> None:
        """``param += alpha * lmo(g)`` in place, temporaries in ``workspace``; tested against ``lmo``.
        ``alpha`` is a number or a 0-d tensor (the optimizer's device-side step size)."""
        add_scaled_(param, self.lmo(g, layout, reduce, shape), alpha)

    def sign_scale(self, shape, layout: str | Layout | None = None) -> float | None:
        """c when the LMO is ``-c * sign(G)``, else None. Rescaled AdamW swaps sign(G) for Adam's direction."""
        return None

    def state_shape(self, shape, layout: str | Layout | None = None) -> tuple[int, ...] | None:
        """The shape of the per-parameter state the step keeps besides momentum (the optimizer makes it and
        passes it to ``apply_lmo_`` as ``moment``); None for the stateless geometries, all but NorMuon's."""
        return None

    def kernel_plan(self, shape, layout: Layout) -> KernelPlan | None:
        """The LMO in the fused kernel's form for a tensor of this shape (``layout``'s fan_in and fan_out may
        be a whole tensor's, a shard's shape aside); None where it has none (spectral, vector, p = inf)."""
        return None

    @property
    def has_kernel_form(self) -> bool:
        """Whether the fused kernel can take this geometry at all (it defines :meth:`kernel_plan`)."""
        return type(self).kernel_plan is not Geometry.kernel_plan

    def _layout(self, t: torch.Tensor, layout) -> Layout:
        return resolve_layout(layout, t)

    def __str__(self) -> str:
        shown = [
            f for f in fields(self)  # type: ignore[arg-type]
            if f.name in ("p", "q") or getattr(self, f.name) != f.default
        ]
        args = ", ".join(f"{f.name}={_fmt(getattr(self, f.name))}" for f in shown)
        return f"{self.name}({args})" if args else self.name


def _fmt(v) -> str:
    if isinstance(v, float):
        return "inf" if v == INF else f"{v:g}"
    return str(v)
