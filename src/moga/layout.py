"""Which axes of a stored tensor are fan_out, fan_in, or batch: the orientation of its logical matrix.

A layout is a string with one letter per tensor dimension (the "dimension numbers" of Optax's Muon):
``o`` fan_out (rows of the logical matrix), ``i`` fan_in (columns), ``b`` batch (independent matrices,
e.g. per-head or per-expert stacks). Common cases (docs/math.md §1.3):

- ``nn.Linear.weight`` (out, in): ``"oi"``
- ``nn.Embedding.weight`` (vocab, d): ``"io"``, since the logical matrix is its transpose (m = d, n = vocab)
- ``nn.Conv2d.weight`` (out, in, kh, kw): ``"oiii"``, the matrix out x (in*kh*kw)
- a stack of E expert matrices (E, out, in): ``"boi"``

Layouts are plain strings so they survive ``state_dict``, pickling and sharding: geometry metadata is never
stored on tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

LINEAR = "oi"
EMBEDDING = "io"


@dataclass(frozen=True)
class Layout:
    spec: str

    def __post_init__(self) -> None:
        bad = set(self.spec) - set("boi")
        if bad:
            raise ValueError(f"layout {self.spec!r}: letters must be 'o' (fan_out), 'i' (fan_in) or 'b' (batch), got {sorted(bad)}")
        if "o" not in self.spec or "i" not in self.spec:
            raise ValueError(f"layout {self.spec!r} needs at least one fan_out 'o' and one fan_in 'i' axis")

    @property
    def out_dims(self) -> tuple[int, ...]:
        return tuple(d for d, c in enumerate(self.spec) if c == "o")

    @property
    def in_dims(self) -> tuple[int, ...]:
        return tuple(d for d, c in enumerate(self.spec) if c == "i")

    @property
    def batch_dims(self) -> tuple[int, ...]:
        return tuple(d for d, c in enumerate(self.spec) if c == "b")

    def check(self, shape: torch.Size | tuple[int, ...]) -> None:
        if len(shape) != len(self.spec):
            raise ValueError(f"layout {self.spec!r} has {len(self.spec)} axes but the tensor has shape {tuple(shape)}")

    def fan_out(self, shape) -> int:
        """m, the number of rows of each logical matrix."""
        self.check(shape)
        return math.prod([shape[d] for d in self.out_dims])

    def fan_in(self, shape) -> int:
        """n, the number of columns of each logical matrix."""
        self.check(shape)
        return math.prod([shape[d] for d in self.in_dims])

    def to_matrix(self, t: torch.Tensor) -> torch.Tensor:
        """A (batch, m, n) view or copy of ``t`` holding its logical matrices."""
        self.check(t.shape)
        order = self.batch_dims + self.out_dims + self.in_dims
        batch = math.prod([t.shape[d] for d in self.batch_dims])
        return t.permute(order).reshape(batch, self.fan_out(t.shape), self.fan_in(t.shape))

    def from_matrix(self, mat: torch.Tensor, shape) -> torch.Tensor:
        """Inverse of :meth:`to_matrix` for a tensor of the given stored shape."""
        self.check(shape)
        order = self.batch_dims + self.out_dims + self.in_dims
        permuted = mat.reshape([shape[d] for d in order])
        return permuted.permute(tuple(order.index(d) for d in range(len(shape))))


@dataclass(frozen=True)
class ShardLayout(Layout):
    """A layout whose fan_in/fan_out are those of the global tensor ``shape``, applied to a local shard: a
    geometry's factors count the whole matrix, so the geometries need not know about sharding."""

    shape: tuple[int, ...] = ()

    def fan_out(self, shape) -> int:
        self.check(shape)
        return math.prod([self.shape[d] for d in self.out_dims])

    def fan_in(self, shape) -> int:
        self.check(shape)
        return math.prod([self.shape[d] for d in self.in_dims])

    def to_matrix(self, t):
        return Layout(self.spec).to_matrix(t)

    def from_matrix(self, mat, shape):
        return Layout(self.spec).from_matrix(mat, shape)


@lru_cache(maxsize=None)
def as_layout(spec: str | Layout) -> Layout:
    return spec if isinstance(spec, Layout) else Layout(spec)


def resolve_layout(layout: str | Layout | None, t: torch.Tensor) -> Layout:
    """The given layout, or ``"oi"`` for a plain 2-D matrix; other shapes must say how they are oriented."""
    if layout is None:
        if t.ndim != 2:
            raise ValueError(
                f"a tensor of shape {tuple(t.shape)} is not a plain (fan_out, fan_in) matrix: pass layout=, "
                "e.g. 'io' for an nn.Embedding weight, 'oiii' for a Conv2d kernel, 'boi' for a stack of matrices"
            )
        layout = LINEAR
    lay = as_layout(layout)
    lay.check(t.shape)
    return lay
