"""Fused optimizer steps: one pass per row for the row, col, sign and embedding geometries.

``kernel="cpp"`` runs the C++ kernel (``lmo_step.cpp``, JIT-built on first use) on CPU tensors, the
local shards of FSDP2 parameters included (rows or columns split over ranks step in two calls around an
all-reduce: :func:`fused_split_step_`), and a ``torch.compile``'d step on CUDA tensors; ``"torch"`` the
plain path of :mod:`moga.geometry`; ``"auto"`` the fused kernel where it can be had, else the plain path
with a one-line warning. ``reference.py`` is the same step in plain torch, tested equal to both.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from moga.geometry import Col, Geometry, Row, Sign
from moga.hardware import facts
from moga.layout import Layout
from moga.numerics import Reduce, dual_exponent

KERNELS = ("auto", "cpp", "torch")
DTYPES = (torch.float32, torch.float64, torch.bfloat16)

_unavailable: dict[str, str] = {}  # device type -> why the fused kernel cannot run there


def check_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def _why_unavailable(device_type: str) -> str | None:
    missing = _missing_tool(device_type)
    if missing:  # not cached: tests set hardware facts either way
        return missing
    if device_type not in _unavailable:
        try:
            if device_type == "cpu":
                from moga.kernels.build import load_extension

                load_extension()
            elif device_type == "cuda":
                import triton  # noqa: F401  (torch.compile's CUDA backend)
            else:
                raise RuntimeError(f"no fused kernel for {device_type} tensors")
            _unavailable[device_type] = ""
        except Exception as e:  # no compiler, a failed build, no triton: all mean "use the plain path"
            _unavailable[device_type] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return _unavailable[device_type] or None


def _missing_tool(device_type: str) -> str | None:
    have = facts()
    if device_type == "cpu" and not have.compiler:
        return "no C++ compiler: install g++ or set $CXX"
    if device_type == "cuda" and not have.triton:
        return "triton is not installed"
    return None


def fused_available(kernel: str, device: torch.device) -> bool:
    """Whether the fused kernel runs for tensors on ``device`` under ``kernel``. ``"cpp"`` raises when it
    cannot; ``"auto"`` warns once per device type and returns False."""
    if kernel == "torch":
        return False
    why = _why_unavailable(device.type)
    if why is None:
        return True
    if kernel == "cpp":
        raise RuntimeError(f"kernel='cpp': the fused kernel is not available for {device.type} tensors ({why})")
    if device.type in ("cpu", "cuda") and not getattr(fused_available, f"_warned_{device.type}", False):
        setattr(fused_available, f"_warned_{device.type}", True)
        warnings.warn(f"moga: fused {device.type} kernel unavailable ({why}); using the plain torch path", RuntimeWarning,
                      stacklevel=3)
    return False


@torch.compiler.assume_constant_result  # depends on static facts only: traced as a constant
def plan(geometry: Geometry, layout: Layout, shape: torch.Size) -> tuple[tuple[int, int, int], float, float] | None:
    """``((B, K, N), p, factor)`` such that the geometry's LMO is ``-factor * phi_p`` along K of the
    tensor's (B, K, N) view; None when the kernel does not cover it (spectral, vector, p = inf, or
    normalized axes that are not adjacent)."""
    if math.prod(shape) == 0:  # nothing to do, whatever the geometry
        return (0, 0, 0), 1.0, 0.0
    return _plan(geometry, layout, shape)


def _plan(geometry: Geometry, layout: Layout, shape: torch.Size) -> tuple[tuple[int, int, int], float, float] | None:
    if isinstance(geometry, Sign):
        p, factor, dims = 1.0, 1 / layout.fan_in(shape), None
    elif isinstance(geometry, Row):
        p, factor, dims = geometry.p, layout.fan_in(shape) ** (-1 / geometry.p), layout.in_dims
    elif isinstance(geometry, Col):  # also Embedding, which only changes the factor
        p, factor, dims = dual_exponent(geometry.q), geometry._scale(shape, layout), layout.out_dims
    else:
        return None
    if p == math.inf:
        return None
    if p == 1:  # elementwise: any rows will do
        last = shape[-1] if len(shape) else 1
        return (math.prod(shape) // last, last, 1), 1.0, factor
    if list(dims) != list(range(dims[0], dims[-1] + 1)):
        return None
    return (math.prod(shape[: dims[0]]), math.prod(shape[dims[0]: dims[-1] + 1]), math.prod(shape[dims[-1] + 1:])), p, factor


def covers(geometry: Geometry) -> bool:
    """Whether the fused kernel can take a group of this geometry (p = inf aside)."""
    return isinstance(geometry, (Row, Col, Sign))


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


def fused_lmo_step_(
    geometry: Geometry, layouts: list[Layout | None], params: list[torch.Tensor], grads: list[torch.Tensor],
    bufs: list[torch.Tensor] | None, lr: float, momentum: float, nesterov: bool, weight_decay: float,
    found_inf: torch.Tensor | None = None,
) -> list[int]:
    """One fused step (momentum EMA, Nesterov, decoupled decay, LMO) for the parameters the kernel
    covers, all on ``params[0]``'s device; returns the indices of those it left to the plain path."""
    device = params[0].device
    done, shapes, scales = [], [], []
    p_common = None
    for k, (w, g) in enumerate(zip(params, grads)):
        buf = bufs[k] if bufs else None
        if w.device != device or not fits(w, g, buf):
            continue
        if w.numel() == 0:  # nothing to update
            done.append(k)
            continue
        planned = plan(geometry, layouts[k], w.shape)
        if planned is None or (p_common is not None and planned[1] != p_common):
            continue
        shape, p_common, factor = planned
        done.append(k)
        shapes.extend(shape)
        scales.append(-lr * factor)
    work = [k for k in done if params[k].numel()]
    if work:
        _op("lmo_step", device)(
            [params[k] for k in work], [grads[k] for k in work], [bufs[k] for k in work] if bufs else [],
            found_inf, shapes, scales, p_common, momentum if bufs else 0.0, nesterov, 1 - lr * weight_decay,
        )
    skipped = set(done)
    return [k for k in range(len(params)) if k not in skipped]


def fused_split_step_(
    geometry: Geometry, layouts: list[Layout], params: list[torch.Tensor], grads: list[torch.Tensor],
    bufs: list[torch.Tensor] | None, lr: float, momentum: float, nesterov: bool, weight_decay: float,
    reduce: Reduce, found_inf: torch.Tensor | None = None,
) -> list[int]:
    """The fused step for CPU shards whose normalized axis is split over ranks (col on a row-sharded
    matrix): the C++ kernel updates m and sums ``|d|^p`` and ``max |d|`` per row or column, ``reduce(x, op)``
    combines them over the ranks (one sum and one max for all the tensors), and the kernel updates W. Rows
    or columns whose combined sums are out of range take an exact step here, with one more sum. Every rank
    must pass the same tensors, empty shards included. Returns the indices left to the plain path."""
    work, shapes, scales, p_common = [], [], [], None
    for k, (w, g) in enumerate(zip(params, grads)):
        buf = bufs[k] if bufs else None
        planned = _plan(geometry, layouts[k], w.shape) if w.device.type == "cpu" and fits(w, g, buf) else None
        if planned is None or planned[1] == 1 or (p_common is not None and planned[1] != p_common):
            continue
        shape, p_common, factor = planned
        work.append(k)
        shapes.extend(shape)
        scales.append(-lr * factor)
    if not work:
        return list(range(len(params)))
    lib = _library()
    ws, gs = [params[k] for k in work], [grads[k] for k in work]
    ms = [bufs[k] for k in work] if bufs else []
    beta = momentum if bufs else 0.0
    parts = lib.lmo_partials(gs, ms, found_inf, shapes, p_common, beta, nesterov)
    sums, tops = (torch.cat([x[i].reshape(-1) for x in parts]) for i in (0, 1))  # float64 if dtypes mix
    reduce(sums, "sum")
    reduce(tops, "max")
    sizes = [x[0].numel() for x in parts]
    combined = [torch.stack([s, t]).to(x.dtype).view_as(x)
                for s, t, x in zip(sums.split(sizes), tops.split(sizes), parts)]
    flags = lib.lmo_apply(ws, gs, ms, found_inf, shapes, scales, combined, p_common, beta, nesterov,
                          1 - lr * weight_decay)
    for i, k in enumerate(work):  # rare; the flags come from combined sums, so every rank agrees
        if bool(flags[i].any()):
            _exact_split_(ws[i], gs[i], ms[i] if ms else None, shapes[3 * i: 3 * i + 3], p_common, scales[i],
                          1 - lr * weight_decay, beta, nesterov, combined[i][1], flags[i], reduce)
    done = set(work)
    return [k for k in range(len(params)) if k not in done]


def _exact_split_(w, g, m, shape, p, c, decay, momentum, nesterov, tops, flags, reduce) -> None:
    """The flagged rows or columns of a split step, in float64: divided by their (combined) maximum first,
    so no power under- or overflows, with their sums combined over the ranks (as ``exact_update`` in C++)."""
    math_dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    b, k, n = shape
    gt = g.to(math_dtype)
    d = gt if m is None else (torch.lerp(gt, m.to(math_dtype), momentum) if nesterov else m.to(math_dtype))
    d = d.double().view(b, k, n)
    peak = tops.double().view(b, 1, n)
    a = d.abs() / torch.where(peak > 0, peak, 1.0)
    total = reduce(a.pow(p).sum(dim=1), "sum")
    f = c * torch.where(total > 0, total, 1.0).pow(-(p - 1) / p)
    wv = w.view(b, k, n)
    new = (wv.to(math_dtype) * decay).double() + f[:, None, :] * a.pow(p - 1).copysign(d)
    wv.copy_(torch.where(flags.view(b, 1, n), new.to(w.dtype), wv))


def _library():
    from moga.kernels.build import load_extension

    return load_extension()


def fused_ready(device: torch.device) -> bool:
    """The fused kernel is already built and loaded for this device (never starts a build)."""
    return _unavailable.get(device.type) == "" and device.type == "cpu" and not _missing_tool("cpu")


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool on the CPU: no element of the (CPU) tensors is NaN or inf. One exact read-only pass."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    return _op("found_nonfinite", tensors[0].device)(tensors) == 0


_PUBLIC_OPS = {"lmo_step": "lmo_step_", "found_nonfinite": "found_nonfinite"}  # library op -> custom op


class FusedCalls(TorchDispatchMode):
    """``with FusedCalls() as calls: opt.step()``; then ``calls.ops`` lists the fused kernel's ops called,
    as ``(name, tensors)``, and ``calls.stepped`` counts the tensors the kernel stepped. Sees the C++ library
    and the public custom ops alike (what ran, not what was meant to)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket._qualified_op_name
        if name.startswith(("moga_kernels::", "moga::")):
            self.ops.append((name, len(args[0])))
        return func(*args, **(kwargs or {}))

    @property
    def stepped(self) -> int:
        return sum(n for name, n in self.ops if name.endswith(("::lmo_step", "::lmo_step_", "::lmo_apply")))


def _op(name: str, device: torch.device):
    """The public custom op (``torch.ops.moga``) where torch.compile must see it; in eager on the CPU the
    library's own op, which skips the custom op's Python layers (about 0.1 ms a call)."""
    from moga.kernels import ops  # registers torch.ops.moga.* on first use, for callers of the public ops

    if device.type == "cpu" and not torch.compiler.is_compiling():
        from moga.kernels.build import load_extension

        return getattr(load_extension(), name)
    return getattr(ops, _PUBLIC_OPS[name])
