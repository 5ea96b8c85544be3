"""The numerics behind the geometries: ``phi_p`` and l_p norms along some axes, safe at any magnitude.

``phi_p(g) = sign(g) |g|^(p-1) / ||g||_p^(p-1)`` (GEOMETRY.md, Notation) is computed per row or per column
of a tensor, with temporaries in an optional :class:`~moga.workspace.Workspace`. Powers of ``|g|`` under-
or overflow long before ``g`` does (a float32 row of 1e-30s has ``|g|^2 = 0``), so sums that leave the
safe range are recomputed on ``g`` divided by its row maximum: ``phi_p`` is scale invariant.

Sharded tensors. Every reduction along the reduced axes (sums of ``|g|^p``, maxima, squared sums) goes
through ``reduce(partial, op)``, ``op`` in ``{"sum", "max"}``: it combines a per-row (or per-column)
partial result across the ranks that hold the other parts of that axis, and returns the combined tensor
(same shape). ``reduce=None`` means the axis is whole here, nothing to combine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from moga.workspace import Workspace, scratch

INF = math.inf

Reduce = Callable[[torch.Tensor, str], torch.Tensor]


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
    """max |x| along ``dims`` (kept)."""
    return combine(torch.amax(x.abs(), dim=dims, keepdim=True), "max", reduce)


def _powered(
    g: torch.Tensor, p: float, dims: tuple[int, ...], workspace: Workspace | None = None,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(|g|^(p-1), ||g||_p^p along dims), for 1 < p < inf.

    Both come from one power of |g|. Where the sums under- or overflow, ``g`` is divided by its row maximum
    first: callers use the pair only through the scale-invariant phi_p, or scale ``g`` themselves.
    """
    a = torch.abs(g, out=scratch(workspace, g, 0))
    u = abs_pow(a, p - 1, out=scratch(workspace, g, 1))
    total = combine(a.mul_(u).sum(dim=dims, keepdim=True), "sum", reduce)
    if g.is_floating_point():
        info = torch.finfo(g.dtype)
        if not bool(((total > info.tiny * 1e4) & (total < info.max * 1e-4)).all()):
            a = g.abs()
            a.mul_(safe_reciprocal(row_max(g, dims, reduce)))
            u = abs_pow(a, p - 1)
            total = combine((a * u).sum(dim=dims, keepdim=True), "sum", reduce)
    return u, total


def lp_norm(x: torch.Tensor, p: float, dims: tuple[int, ...], reduce: Reduce | None = None) -> torch.Tensor:
    """||x||_p along ``dims`` (kept), exact also for extreme magnitudes."""
    if p == 1:
        return combine(x.abs().sum(dim=dims, keepdim=True), "sum", reduce)
    peak = row_max(x, dims, reduce)
    if p == INF:
        return peak
    scaled = x * safe_reciprocal(peak)
    if p == 2:
        return peak * combine(scaled.square().sum(dim=dims, keepdim=True), "sum", reduce).sqrt()
    _, total = _powered(scaled, p, dims, reduce=reduce)
    return peak * total.pow(1 / p)


def _l2_norm(g: torch.Tensor, dims: tuple[int, ...], workspace: Workspace | None, reduce: Reduce | None):
    if reduce is None and dims == (g.ndim - 1,):
        norm = torch.linalg.vector_norm(g, ord=2, dim=dims, keepdim=True)
    else:  # vector_norm over leading axes is ~30x slower on CPUs than squaring and summing
        squares = torch.mul(g, g, out=scratch(workspace, g, 0)).sum(dim=dims, keepdim=True)
        norm = combine(squares, "sum", reduce).sqrt_()
    if g.is_floating_point():
        info = torch.finfo(g.dtype)
        if not bool(((norm > info.tiny**0.5 * 1e4) & (norm < info.max**0.5 * 1e-4)).all()):
            norm = lp_norm(g, 2, dims, reduce)
    return norm


def _direction(
    g: torch.Tensor, p: float, dims: tuple[int, ...], workspace: Workspace | None = None,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, s) with phi_p(g) = t * s: t = sign(g)|g|^(p-1) unnormalized, s the per-row factor."""
    if p == 2:
        return g, safe_reciprocal(_l2_norm(g, dims, workspace, reduce))
    u, total = _powered(g, p, dims, workspace, reduce)
    # ||g||_p^(p-1) = total^((p-1)/p); the row maximum cancels because phi_p is scale invariant.
    return u.copysign_(g), safe_reciprocal(total.pow((p - 1) / p))


def _peak_sign(g: torch.Tensor, dims: tuple[int, ...], reduce: Reduce | None = None) -> torch.Tensor:
    """phi_inf: sign(g) on the entries of largest |g| along ``dims``, split equally among ties."""
    a = g.abs()
    peak = row_max(g, dims, reduce)
    top = (a == peak) & (peak > 0)
    count = combine(top.sum(dim=dims, keepdim=True).to(g.dtype), "sum", reduce)
    return torch.sign(g) * top / count.clamp(min=1)


def phi(g: torch.Tensor, p: float, dims: tuple[int, ...], reduce: Reduce | None = None) -> torch.Tensor:
    """phi_p along ``dims``: the l_{p*} unit vector maximising <g, .> (GEOMETRY.md, Notation):
    ``sign(g) |g|^(p-1) / ||g||_p^(p-1)``. phi_1 = sign; phi_inf puts all mass on the largest |g_i|."""
    if p == 1:
        return torch.sign(g)
    if p == INF:
        return _peak_sign(g, dims, reduce)
    t, s = _direction(g, p, dims, reduce=reduce)
    return t * s


def add_phi_(
    param: torch.Tensor, g: torch.Tensor, p: float, dims: tuple[int, ...], c: float,
    workspace: Workspace | None = None, reduce: Reduce | None = None,
) -> None:
    """``param += c * phi_p(g)`` along ``dims``: one pass over ``param``, temporaries in ``workspace``."""
    if p == 1:
        param.add_(torch.sign(g, out=scratch(workspace, g, 0)), alpha=c)
    elif p == INF:
        param.add_(_peak_sign(g, dims, reduce), alpha=c)
    else:
        t, s = _direction(g, p, dims, workspace, reduce)
        param.addcmul_(t, s, value=c)
