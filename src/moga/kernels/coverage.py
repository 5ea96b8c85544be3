"""What the fused kernel takes: the geometry's kernel form (:meth:`moga.geometry.Geometry.kernel_plan`) and
tensors it can read (plain, dense, contiguous, one dtype it knows)."""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from moga.geometry import Geometry, KernelPlan
from moga.hardware import traced_as_constant
from moga.layout import Layout

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@traced_as_constant  # depends on static facts only
def plan(geometry: Geometry, layout: Layout, shape: torch.Size) -> KernelPlan | None:
    """``((B, K, N), p, factor)`` such that the geometry's LMO is ``-factor * phi_p`` along K of the
    tensor's (B, K, N) view; None when the kernel does not cover it (spectral, vector, p = inf, or
    normalized axes that are not adjacent). An empty tensor has nothing to do, whatever the geometry."""
    if math.prod(shape) == 0:
        return KernelPlan((0, 0, 0), 1.0, 0.0)
    return geometry.kernel_plan(shape, layout)


def covers(geometry: Geometry) -> bool:
    """Whether the fused kernel can take a group of this geometry (p = inf aside)."""
    return geometry.has_kernel_form


def fits(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """The kernel's tensor requirements: plain tensors (a DTensor's local shard, not the DTensor), one dtype
    it knows, dense, contiguous, one device."""
    tensors = (param, grad) if buf is None else (param, grad, buf)
    return (all(plain_tensor(t) for t in tensors) and param.dtype in DTYPES and all(t.dtype == param.dtype and t.device == param.device for t in tensors)
            and all(t.layout == torch.strided and t.is_contiguous() for t in tensors))


def plain_tensor(t: torch.Tensor) -> bool:
    """A tensor itself, not a wrapper such as a DTensor (whose local shard is the plain tensor). A FakeTensor,
    torch's stand-in for one when tracing, counts as plain: a traced step takes the paths a real one takes."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or isinstance(t, FakeTensor)
