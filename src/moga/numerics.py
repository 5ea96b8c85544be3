"""The numerics behind the geometries: ``phi_p``, l_p norms along some axes and the momentum direction,
at any magnitude, sync-free. Each is written once here; the optimizers' readable core
(:mod:`moga.optim.functional`) and the compiled kernel (:mod:`moga.kernels.reference`) call these.

``phi_p(g) = sign(g) |g|^(p-1) / ||g||_p^(p-1)`` (docs/math.md §1.1) is computed per row or per column
of a tensor, with temporaries in an optional :class:`~moga.workspace.Workspace`. Powers of ``|g|`` under-
or overflow long before ``g`` does (a float32 row of 1e-30s has ``|g|^2 = 0``; ``|g|^3`` overflows at
7e12), and a reciprocal of a subnormal row maximum overflows. So ``phi_p`` divides each row by its maximum
first (``phi_p`` is scale invariant): then every power lies in [0, 1], every sum in [1, n], and the result
is exact from the smallest subnormal to the largest float. Nothing here reads a tensor's value on the
host: the step never waits for the device.

The one exception is the fast l2 step (:func:`add_phi_` with ``p = 2`` on CPU tensors, the speed-critical
row(2) step), which squares ``g`` directly, saving two passes. Its squares are exact for row norms in
``[l2_safe_low(dtype), sqrt(max float))`` (float32 and bfloat16: 1.1e-16 to 1.8e19); the rows (columns)
outside that range are then stepped again by the exact path, as the C++ kernel redoes them. Whether
there are any is read on the host, which for CPU tensors waits for nothing; on other devices (and inside
torch.compile) ``p = 2`` takes the exact path directly.

Sharded tensors. Every reduction along the reduced axes (sums of ``|g|^p``, maxima, squared sums) goes
through ``reduce(partial, op)``, ``op`` in ``{"sum", "max"}``: it combines a per-row (or per-column)
partial result across the ranks that hold the other parts of that axis, and returns the combined tensor
(same shape). ``reduce=None`` means the axis is whole here, nothing to combine.

Step sizes. ``c`` in :func:`add_phi_` and :func:`add_scaled_` is a number or a 0-d tensor: a tensor lets
the optimizer make a step a no-op on the device (``c = 0``) without a host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from moga.workspace import Workspace, scratch

INF = math.inf

Reduce = Callable[[torch.Tensor, str], torch.Tensor]
Scalar = float | torch.Tensor


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a step computes in: float64 for float64 tensors, float32 for the rest (16-bit ones too)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dual_exponent(p: float) -> float:
    """p* with 1/p + 1/p* = 1."""
    if p == 1:
        return INF
    if p == INF:
        return 1.0
    return p / (p - 1)


def combine(partial: torch.Tensor, op: str, reduce: Reduce | None) -> torch.Tensor:
    """``partial`` combined across the ranks holding the rest of the reduced axes (itself when whole)."""
    return partial if reduce is None else reduce(partial, op)


def safe_divisor(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros replaced by 1: a zero row divided by it stays zero, never NaN."""
    return torch.where(x > 0, x, torch.ones_like(x))


def safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    # A zero row/column has no direction: its LMO is zero, never NaN.
    return torch.where(x > 0, x.reciprocal(), torch.zeros_like(x))


def abs_pow(a: torch.Tensor, e: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """a**e for a >= 0; the papers' exponents (p = 1.5, 2.5, 3) avoid pow, which is ~10x slower on CPUs."""
    if e == 0.5:
        return torch.sqrt(a, out=out)
    if e == 1.5:
        return torch.sqrt(a, out=out).mul_(a)
    if e == 2:
        return torch.mul(a, a, out=out)
    return torch.pow(a, e, out=out)


def row_max(x: torch.Tensor, dims: tuple[int, ...], reduce: Reduce | None = None) -> torch.Tensor:
    """max |x| along ``dims`` (kept). Two reductions of ``x`` cost less than materializing ``|x|``, and
    far less than ``vector_norm(ord=inf)`` on CPUs."""
    if x.numel() == 0:
        return combine(x.new_zeros([1 if d in dims else s for d, s in enumerate(x.shape)]), "max", reduce)
    peak = torch.maximum(torch.amax(x, dim=dims, keepdim=True), torch.amin(x, dim=dims, keepdim=True).neg_())
    return combine(peak, "max", reduce)


def _normalized_powers(
    g: torch.Tensor, p: float, dims: tuple[int, ...], workspace: Workspace | None, reduce: Reduce | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a^(p-1), sum a^p along dims) for a = |g| / max|g| (per row), 1 < p < inf.

    a is in [0, 1] with a 1 in every nonzero row, so the sum is in [1, n]: nothing under- or overflows.
    Division (not a reciprocal) keeps subnormal maxima exact. A zero row gives zeros."""
    a = torch.abs(g, out=scratch(workspace, g, 0)).div_(safe_divisor(row_max(g, dims, reduce)))
    u = abs_pow(a, p - 1, out=scratch(workspace, g, 1))
    return u, combine(a.mul_(u).sum(dim=dims, keepdim=True), "sum", reduce)


def lp_norm(x: torch.Tensor, p: float, dims: tuple[int, ...], reduce: Reduce | None = None) -> torch.Tensor:
    """||x||_p along ``dims`` (kept), exact also for extreme magnitudes."""
    if p == 1:
        return combine(x.abs().sum(dim=dims, keepdim=True), "sum", reduce)
    peak = row_max(x, dims, reduce)
    if p == INF:
        return peak
    _, total = _normalized_powers(x, p, dims, None, reduce)
    return peak * total.pow(1 / p)


def _phi_parts(
    g: torch.Tensor, p: float, dims: tuple[int, ...], workspace: Workspace | None, reduce: Reduce | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, s) with phi_p(g) = t * s, both finite: t = sign(g) a^(p-1), s = (sum a^p)^(-(p-1)/p)."""
    u, total = _normalized_powers(g, p, dims, workspace, reduce)
    return u.copysign_(g), safe_reciprocal(total.pow((p - 1) / p))


def l2_safe_low(dtype: torch.dtype) -> float:
    """The smallest l2 norm whose squares the fast l2 step sums exactly: sqrt(smallest normal) * 2^10."""
    return math.sqrt(torch.finfo(dtype).tiny) * 2**10


def _fast_l2_phi_parts(
    g: torch.Tensor, dims: tuple[int, ...], workspace: Workspace | None, reduce: Reduce | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g, 1/||g||_2, outside) per row from plain squares; rows whose squares are not exact (zero rows
    among them) get 0 and are flagged in ``outside`` (module doc)."""
    if reduce is None and dims == (g.ndim - 1,):
        norm = torch.linalg.vector_norm(g, ord=2, dim=dims, keepdim=True)
    else:  # vector_norm over leading axes is ~30x slower on CPUs than squaring and summing
        squares = torch.mul(g, g, out=scratch(workspace, g, 0)).sum(dim=dims, keepdim=True)
        norm = combine(squares, "sum", reduce).sqrt_()
    inside = (norm >= l2_safe_low(g.dtype)) & torch.isfinite(norm)
    return g, torch.where(inside, norm.reciprocal(), torch.zeros_like(norm)), ~inside


def _fast_l2_applies(g: torch.Tensor) -> bool:
    """The fast l2 step needs to see on the host whether a row fell outside its range: free for CPU tensors."""
    return g.device.type == "cpu" and not torch.compiler.is_compiling()


def _add_l2_phi_(
    param: torch.Tensor, g: torch.Tensor, dims: tuple[int, ...], c: Scalar, workspace: Workspace | None,
    reduce: Reduce | None,
) -> None:
    """``param += c * phi_2(g)``: the fast pass, then the rows it could not step (tiny or huge norms) again by
    the exact path. Zero rows are outside too but have nothing to add; telling them from rows whose squares
    underflowed takes their maxima, only when some row is outside. Every rank sharing a row combines the
    same sums, so all of them take the same branches (and make the same reductions)."""
    t, s, outside = _fast_l2_phi_parts(g, dims, workspace, reduce)
    param.addcmul_(t, s.mul_(c))
    if not bool(outside.any()):
        return
    outside &= row_max(g, dims, reduce) > 0
    if not bool(outside.any()):
        return
    t, s = _phi_parts(g, 2.0, dims, workspace, reduce)
    param.addcmul_(t, torch.where(outside, s.mul_(c), torch.zeros_like(s)))


def _peak_sign(g: torch.Tensor, dims: tuple[int, ...], reduce: Reduce | None = None) -> torch.Tensor:
    """phi_inf: sign(g) on the entries of largest |g| along ``dims``, split equally among ties."""
    peak = row_max(g, dims, reduce)
    top = (g.abs() == peak) & (peak > 0)
    count = combine(top.sum(dim=dims, keepdim=True).to(g.dtype), "sum", reduce)
    return torch.sign(g) * top / count.clamp(min=1)


def phi(g: torch.Tensor, p: float, dims: tuple[int, ...], reduce: Reduce | None = None) -> torch.Tensor:
    """phi_p along ``dims``: the l_{p*} unit vector maximising <g, .> (docs/math.md §1.1):
    ``sign(g) |g|^(p-1) / ||g||_p^(p-1)``. phi_1 = sign; phi_inf splits it equally among the largest |g_i|.
    Exact at every magnitude."""
    if p == 1:
        return torch.sign(g)
    if p == INF:
        return _peak_sign(g, dims, reduce)
    t, s = _phi_parts(g, p, dims, None, reduce)
    return t * s


def direction(g: torch.Tensor, m: torch.Tensor | None, beta: float, nesterov: bool,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The step's direction from the gradient ``g`` and its momentum EMA ``m`` (already updated,
    ``m <- lerp(m, g, 1 - beta)``): ``lerp(g, m, beta)`` with Nesterov, else ``m``; ``g`` without momentum
    (``m`` None). ``out`` receives a Nesterov direction (the other two are ``m`` or ``g`` themselves)."""
    if m is None:
        return g
    return torch.lerp(g, m, beta, out=out) if nesterov else m


def add_scaled_(param: torch.Tensor, t: torch.Tensor, c: Scalar) -> None:
    """``param += c * t``; with a tensor ``c`` the same single pass (``addcmul`` with a 0-d factor)."""
    if isinstance(c, torch.Tensor):
        param.addcmul_(t, c)
    else:
        param.add_(t, alpha=c)


def add_phi_(
    param: torch.Tensor, g: torch.Tensor, p: float, dims: tuple[int, ...], c: Scalar,
    workspace: Workspace | None = None, reduce: Reduce | None = None,
) -> None:
    """``param += c * phi_p(g)`` along ``dims``: one pass over ``param``, temporaries in ``workspace``."""
    if p == 1:
        add_scaled_(param, torch.sign(g, out=scratch(workspace, g, 0)), c)
    elif p == INF:
        add_scaled_(param, _peak_sign(g, dims, reduce), c)
    elif p == 2 and _fast_l2_applies(g):
        _add_l2_phi_(param, g, dims, c, workspace, reduce)
    else:
        t, s = _phi_parts(g, p, dims, workspace, reduce)
        param.addcmul_(t, s.mul_(c))
