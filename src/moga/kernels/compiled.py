"""A compiled step: :func:`moga.kernels.reference.tensor_step_` (the step of :mod:`moga.optim.functional` on a
(B, K, N) view, with the same ``phi`` and ``direction``) under ``torch.compile``. Not what CUDA runs: on an
H200 (torch 2.11+cu130, triton) its row and col steps landed farther from the C++ kernel's result than the
step itself while the eager reference matched, so the op steps CUDA tensors in the eager reference
(:mod:`moga.kernels.ops`). It stays to be fixed on a GPU, where ``python scripts/gpu_check.py kernel`` checks it; on
the CPU (inductor's C++ backend) it matches the reference (tests/kernels/test_compiled.py).

No tensor is made on the device per call: the numbers (``c`` and ``decay``, which follow the lr, ``p``,
``momentum``) go in as Python floats, which ``dynamic=True`` compiles once for every value (a schedule
does not recompile; dynamo wraps them in 0-d host tensors that the kernel reads on the host, no copy to
the device). Shapes are dynamic too, so a model needs one compile per layout. A compile that fails (the backend's bug, no working triton) is decided once per kind of call:
that kind steps in plain torch from then on, with a one-line warning, and nothing was touched on the way.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import torch

from moga.kernels import reference

_failed: dict[tuple, str] = {}  # kind of call -> why its compile failed


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises (before anything runs): dynamo's and inductor's own errors."""
    # deferred on purpose: torch._dynamo is half of the cost of `import moga` (about 1 s) and only a compile needs it
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
    from torch._inductor.exc import InductorError

    return TorchDynamoException, InductorError, FailOnRecompileLimitHit  # the last is no TorchDynamoException


@lru_cache(maxsize=None)
def compiled_step():
    return torch.compile(reference.tensor_step_, dynamic=True, fullgraph=True)  # fullgraph: all or nothing


def compiled_steps_(params, grads, bufs, found_inf, shapes, scales, p, momentum, nesterov, decay) -> None:
    """The list form of the op, each tensor through the compiled step (or the plain one, see above)."""
    for k, (w, g) in enumerate(zip(params, grads)):
        if w.numel() == 0:
            continue
        buf = bufs[k] if bufs else None
        shape = tuple(shapes[3 * k: 3 * k + 3])
        # dynamic shapes still specialize sizes of 1 (the row layout's N): they are part of the kind
        kind = (p, momentum, nesterov, buf is None, found_inf is None, w.dtype, w.device.type,
                tuple(n == 1 for n in shape))
        if kind not in _failed:
            try:
                # detached: dynamo keeps a Parameter's sizes static (one compile per shape, past its recompile
                # limit on a transformer); the same storage, so the step still lands in the parameter
                compiled_step()(w.detach(), g, None if buf is None else buf.detach(), found_inf, shape,
                                float(scales[k]), float(p), float(momentum), nesterov, float(decay))
                continue
            except compile_errors() as e:
                _failed[kind] = why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                warnings.warn(f"moga: the compiled {w.device.type} step failed for p={p}, momentum={momentum}, "
                              f"{w.dtype}, shape {shape} ({why}); these tensors step in plain torch",
                              RuntimeWarning, stacklevel=2)
        reference.tensor_step_(w, g, buf, found_inf, shape, scales[k], p, momentum, nesterov, decay)
