"""Fused optimizer steps: one pass per row for the row, col, sign and embedding geometries.

``kernel="cpp"`` runs the C++ kernel (``lmo_step.cpp``, JIT-built on first use: ``build.py``) on CPU tensors,
the local shards of FSDP2 parameters included (rows or columns split over ranks step in two calls around an
all-reduce: :func:`fused_split_step_`), and a ``torch.compile``'d step on CUDA tensors (``compiled.py``);
``"torch"`` the plain path of :mod:`moga.geometry`; ``"auto"`` the fused kernel where it can be had, else the
plain path with a one-line warning (``available.py``). Each geometry gives its kernel form
(:meth:`~moga.geometry.Geometry.kernel_plan`); ``coverage.py`` says which tensors the kernel takes, ``step.py``
calls it on lists of tensors, ``ops.py`` holds the public custom ops, and ``reference.py`` is the same step in
plain torch, tested equal to both.
"""

from moga.kernels import compiled, ops, reference
from moga.kernels.available import KERNELS, check_kernel, fused_available, fused_ready
from moga.kernels.calls import FusedCalls
from moga.kernels.coverage import DTYPES, covers, fits, plain_tensor, plan
from moga.kernels.step import all_finite, fused_lmo_step_, fused_split_step_

__all__ = [
    "DTYPES", "KERNELS", "FusedCalls", "all_finite", "check_kernel", "compiled", "covers", "fits", "fused_available",
    "fused_lmo_step_", "fused_ready", "fused_split_step_", "ops", "plain_tensor", "plan", "reference",
]
