"""One optimizer step traced on fake CUDA tensors, on a CPU-only torch: which ops run, on which device.

``FakeTensorMode`` makes ``device="cuda"`` tensors without a GPU; no kernel runs, so a trace is cheap and
exact about what a step asks of the device. :class:`StepTrace` records every aten op and flags the three
things that make a GPU step wait or fail: a read of a device value on the host (``_local_scalar_dense``, a
copy to the CPU), a copy from the host to the device, and an op whose tensors live on different devices.

A CPU build of torch has no CUDA device guard, which a few ``Tensor`` methods enter in their Python
binding before dispatch (``copy_``, indexing, ``contiguous``, ``.to``, ``~``, ``float()``): :class:`CudaMethods` sends
those to their aten ops, as a CUDA build's binding would after the guard.
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import ExitStack, contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
CUDA = torch.device("cuda")


class HostSync(AssertionError):
    """The step read a device value on the host."""


def _where() -> str:
    """The innermost moga frame of the current Python stack (where the flagged op was asked for)."""
    frames = [f for f in traceback.extract_stack() if "/moga/" in f.filename and "/tests/" not in f.filename]
    return f"{frames[-1].filename.rsplit('/moga/', 1)[1]}:{frames[-1].lineno}" if frames else "?"


class StepTrace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.host_to_device: list[str] = []
        self.mixed: list[str] = []
        self.syncs: list[str] = []
        self.cpu_reads: list[str] = []  # host reads of CPU tensors: no device waits for them
        self.collectives: list[tuple[str, set[str]]] = []  # (c10d op, devices of the tensors passed to it)

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in inputs}
        if func is aten._local_scalar_dense.default:
            if args[0].device.type == "cpu":  # no device waits for it (a CPU-offloaded step); FakeKernels answers
                self.cpu_reads.append(f"{name} at {_where()}")
                return func(*args, **kwargs)
            self.syncs.append(f"{name} at {_where()}")
            raise HostSync(f"host sync: {name} at {_where()}")
        if func.namespace == "c10d":
            self.collectives.append((name, devices))
        elif len(devices) > 1 and func not in COPIES:  # before running it: fake tensors refuse most of these
            self.mixed.append(f"{name} on {sorted(devices)} at {_where()}")
        out = func(*args, **kwargs)
        if func in COPIES:
            ends = devices | {t.device.type for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
            if ends == {"cpu", "cuda"}:
                source = (args[1] if func in (aten.copy_.default, aten.copy.default) else args[0])
                sources = source if isinstance(source, (list, tuple)) else [source]
                if any(t.device.type == "cpu" for t in sources):
                    self.host_to_device.append(f"{name} at {_where()}")
                else:
                    self.syncs.append(f"{name} to the host at {_where()}")
        return out


# In-place ops torch ships no fake kernel for (torch 2.13); the trace records them and runs nothing.
NO_FAKE_KERNEL = {aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr}
COPIES = {aten._to_copy.default, aten.copy_.default, aten.copy.default, aten._foreach_copy_.default}


class FakeKernels(TorchDispatchMode):
    """Runs nothing for the in-place ops of NO_FAKE_KERNEL (shapes and devices stay those of the inputs), and
    answers 0 to a host read of a CPU tensor (a fake one has no value; 0 takes the common branch: no row out
    of range, nothing to redo)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in NO_FAKE_KERNEL:
            return None
        if func is aten._local_scalar_dense.default and args[0].device.type == "cpu":
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


class CudaMethods(TorchFunctionMode):
    """``Tensor`` methods whose Python binding enters the (absent) CUDA device guard, as their aten ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            return aten.copy_.default(*args, **kwargs)
        if func is torch.Tensor.contiguous:
            t = args[0]
            return t if t.is_contiguous() else aten.clone.default(t, memory_format=torch.contiguous_format)
        if func is torch.Tensor.__getitem__:
            return _index(*args)
        if func is torch.Tensor.__setitem__:
            t, key, value = args
            view = _index(t, key)
            aten.copy_.default(view, value) if isinstance(value, torch.Tensor) else aten.fill_.Scalar(view, value)
            return None
        if func is torch.Tensor.to:
            return _to(*args, **kwargs)
        if func in (torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.item):
            return aten._local_scalar_dense.default(args[0])  # a host read, which StepTrace refuses
        if func is torch.Tensor.__invert__:
            return aten.bitwise_not.default(args[0])
        return func(*args, **kwargs)


def _device(d) -> torch.device:
    d = torch.device(d)
    return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d


def _to(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    device, dtype = t.device, t.dtype
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = _device(a)
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
    dtype = kwargs.get("dtype") or dtype
    device = device if kwargs.get("device") is None else _device(kwargs["device"])
    if device == t.device and dtype == t.dtype and not kwargs.get("copy"):
        return t
    return aten._to_copy.default(t, dtype=dtype, device=device,
                                 memory_format=kwargs.get("memory_format", torch.preserve_format))


def _index(t: torch.Tensor, key):
    keys = key if isinstance(key, tuple) else (key,)
    dim = 0
    for k in keys:
        if isinstance(k, int):
            t = aten.select.int(t, dim, k)
        elif isinstance(k, slice) and k.step in (None, 1):
            t = aten.slice.Tensor(t, dim, k.start, k.stop)
            dim += 1
        else:
            raise NotImplementedError(f"fake CUDA indexing by {k!r}")
    return t


@contextmanager
def fake_cuda():
    """Fake tensors with ``device="cuda"`` work inside: ``torch.empty(3, device="cuda")``."""
    with ExitStack() as stack:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        stack.enter_context(FakeKernels())
        stack.enter_context(CudaMethods())
        yield


def trace(fn) -> StepTrace:
    """Run ``fn()`` (inside :func:`fake_cuda`) and return what it asked of the device."""
    with StepTrace() as recorded:
        fn()
    return recorded
