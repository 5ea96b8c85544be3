"""The public ops, ``torch.ops.moga.lmo_step_`` and ``torch.ops.moga.found_nonfinite``, as torch.library
custom ops: a mutating schema that torch.compile and FSDP see through. CPU calls the C++ kernel, every
other device the plain reference (on CUDA too: the compiled one, :mod:`moga.kernels.compiled`, gave wrong
steps on an H200; ``python scripts/gpu_check.py kernel`` checks it there)."""

from __future__ import annotations

import torch

from moga.kernels import reference
from moga.kernels.build import load_extension


@torch.library.custom_op("moga::lmo_step_", mutates_args=("params", "bufs"))
def lmo_step_op(
    params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor], found_inf: torch.Tensor | None,
    shapes: list[int], scales: list[float], p: float, momentum: float, nesterov: bool, decay: float,
) -> None:
    """For each k: ``params[k] <- decay * params[k] + scales[k] * phi_p(d)`` along K of its (B, K, N) view
    ``shapes[3k:3k+3]``, d the momentum EMA in ``bufs[k]`` (updated; ``bufs`` empty: no momentum).
    Nothing changes when ``found_inf`` is nonzero."""
    reference.tensor_steps_(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay)


@lmo_step_op.register_kernel("cpu")
def _lmo_step_cpu(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay):
    load_extension().lmo_step(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay)


@lmo_step_op.register_kernel("cuda")
def _lmo_step_cuda(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay):
    # eager, not compiled.compiled_steps_: on an H200 (torch 2.11+cu130) the compiled row and col steps moved
    # parameters by more than the step itself away from the C++ kernel's result (MOGA trained to a third of
    # AdamW's accuracy) while this one matched; docs/results.md, "CUDA"
    reference.tensor_steps_(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay)


@lmo_step_op.register_fake
def _lmo_step_fake(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay):
    return None


@torch.library.custom_op("moga::found_nonfinite", mutates_args=())
def found_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim float32 tensor on the tensors' device: 1.0 when any element is NaN or inf, else 0.0."""
    flags = [~torch.isfinite(t).all() for t in tensors if t.numel()]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    return torch.stack(flags).any().float()


@found_nonfinite.register_kernel("cpu")
def _found_nonfinite_cpu(tensors):
    return load_extension().found_nonfinite(tensors)


@found_nonfinite.register_fake
def _found_nonfinite_fake(tensors):
    return tensors[0].new_empty((), dtype=torch.float32)
