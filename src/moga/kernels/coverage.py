"""What the fused kernel takes: the geometry's kernel form (:meth:`moga.geometry.Geometry.kernel_plan`) and
tensors it can read (plain, dense, contiguous, one dtype it knows)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import FakeTensor

from moga.geometry import Geometry, KernelPlan
from moga.layout import Layout

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def plan(geometry: Geometry, layout: Layout, shape: torch.Size) -> KernelPlan | None:
    """``((B, K, N), p, factor)`` such that the geometry's LMO is ``-factor * phi_p`` along K of the
    tensor's (B, K, N) view; None when the kernel does not cover it (spectral, vector, p = inf, or
    normalized axes that are not adjacent). An empty tensor has nothing to do, whatever the geometry.
    Remembered in eager, where every step asks again for each tensor (geometries and layouts are frozen,
    so the answer cannot change); a traced step may see symbolic shapes, which do not hash, and traces the
    arithmetic (marked constant, torch 2.11's dynamo refuses a frozen dataclass argument)."""
    if torch.compiler.is_compiling():
        return _plan(geometry, layout, shape)
    return _remembered_plan(geometry, layout, shape)


def _plan(geometry: Geometry, layout: Layout, shape: torch.Size) -> KernelPlan | None:
    if math.prod(shape) == 0:
        return KernelPlan((0, 0, 0), 1.0, 0.0)
    return geometry.kernel_plan(shape, layout)


_remembered_plan = lru_cache(maxsize=4096)(_plan)


def covers(geometry: Geometry) -> bool:
    """Whether the fused kernel can take a group of this geometry (p = inf aside)."""
    return geometry.has_kernel_form


def fits(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """The kernel's tensor requirements: plain tensors (a DTensor's local shard, not the DTensor), one dtype
    it knows, dense, contiguous, one device."""
    dtype, device = param.dtype, param.device
    if dtype not in DTYPES:
        return False
    for t in (param, grad) if buf is None else (param, grad, buf):  # a loop: asked per tensor every step
        if not (plain_tensor(t) and t.dtype == dtype and t.device == device and t.layout == torch.strided
                and t.is_contiguous()):
            return False
    return True


def plain_tensor(t: torch.Tensor) -> bool:
    """A tensor itself, not a wrapper such as a DTensor (whose local shard is the plain tensor). A FakeTensor,
    torch's stand-in for one when tracing, counts as plain: a traced step takes the paths a real one takes."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or isinstance(t, FakeTensor)
