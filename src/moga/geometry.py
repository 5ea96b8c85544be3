"""Norms, dual norms and linear minimisation oracles: one small object per row of GEOMETRY.md's table.

Every geometry works on the logical fan_out x fan_in matrix of a stored tensor, given by a
:mod:`moga.layout` string, so an embedding stored (vocab, d), a conv kernel or a stack of per-head
matrices needs no special case. Batch axes hold independent matrices: their norm is the max over the
stack and the dual norm the sum, as for the block norm (GEOMETRY.md, last note of the table).

All reductions for row, col, sign and embedding geometries stay inside one row or one column, so a
row-sharded matrix can be row-normalized without communication.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from moga.layout import Layout, resolve_layout
from moga.workspace import Workspace, scratch
from moga.orthogonalize import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, NS_EPS, orthogonalize

INF = math.inf


def dual_exponent(p: float) -> float:
    """p* with 1/p + 1/p* = 1."""
    if p == 1:
        return INF
    if p == INF:
        return 1.0
    return p / (p - 1)


def check_exponent(name: str, p: float) -> float:
    p = float(p)
    if math.isnan(p) or p < 1:
        raise ValueError(f"{name} must be a real number >= 1 (or inf), got {p}")
    return p


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    # A zero row/column has no direction: its LMO is zero, never NaN.
    return torch.where(x > 0, x.reciprocal(), torch.zeros_like(x))


def _abs_pow(a: torch.Tensor, e: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """a**e for a >= 0; the papers' exponents (p = 1.5, 2.5, 3) avoid pow, which is ~10x slower on CPUs."""
    if e == 0.5:
        return torch.sqrt(a, out=out)
    if e == 1.5:
        return torch.sqrt(a, out=out).mul_(a)
    if e == 2:
        return torch.mul(a, a, out=out)
    return torch.pow(a, e, out=out)


def _powered(
    g: torch.Tensor, p: float, dims: tuple[int, ...], workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(|g|^(p-1), ||g||_p^p along dims), for 1 < p < inf.

    Both come from one power of |g|. Where the sums under- or overflow (a float32 row of 1e-30s has
    |g|^2 = 0), ``g`` is divided by its row maximum first: callers use the pair only through the
    scale-invariant phi_p, or scale ``g`` themselves (``lp_norm``).
    """
    a = torch.abs(g, out=scratch(workspace, g, 0))
    u = _abs_pow(a, p - 1, out=scratch(workspace, g, 1))
    total = a.mul_(u).sum(dim=dims, keepdim=True)
    if g.is_floating_point():
        info = torch.finfo(g.dtype)
        if not bool(((total > info.tiny * 1e4) & (total < info.max * 1e-4)).all()):
            a = g.abs()
            a.mul_(_safe_reciprocal(torch.amax(a, dim=dims, keepdim=True)))
            u = _abs_pow(a, p - 1)
            total = (a * u).sum(dim=dims, keepdim=True)
    return u, total


def lp_norm(x: torch.Tensor, p: float, dims: tuple[int, ...]) -> torch.Tensor:
    """||x||_p along ``dims`` (kept), exact also for extreme magnitudes."""
    if p in (1, INF):
        return torch.linalg.vector_norm(x, ord=p, dim=dims, keepdim=True)
    peak = torch.amax(x.abs(), dim=dims, keepdim=True)
    scaled = x * _safe_reciprocal(peak)
    if p == 2:
        return peak * torch.linalg.vector_norm(scaled, ord=2, dim=dims, keepdim=True)
    _, total = _powered(scaled, p, dims)
    return peak * total.pow(1 / p)


def _direction(
    g: torch.Tensor, p: float, dims: tuple[int, ...], workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, s) with phi_p(g) = t * s: t = sign(g)|g|^(p-1) unnormalized, s the per-row factor."""
    if p == 2:
        if dims == (g.ndim - 1,):
            norm = torch.linalg.vector_norm(g, ord=2, dim=dims, keepdim=True)
        else:  # vector_norm over leading axes is ~30x slower on CPUs than squaring and summing
            norm = torch.mul(g, g, out=scratch(workspace, g, 0)).sum(dim=dims, keepdim=True).sqrt_()
        info = torch.finfo(g.dtype) if g.is_floating_point() else None
        if info is not None and not bool(((norm > info.tiny**0.5 * 1e4) & (norm < info.max**0.5 * 1e-4)).all()):
            norm = lp_norm(g, 2, dims)
        return g, _safe_reciprocal(norm)
    u, total = _powered(g, p, dims, workspace)
    # ||g||_p^(p-1) = total^((p-1)/p); the row maximum cancels because phi_p is scale invariant.
    return u.copysign_(g), _safe_reciprocal(total.pow((p - 1) / p))


def phi(g: torch.Tensor, p: float, dims: tuple[int, ...]) -> torch.Tensor:
    """phi_p along ``dims``: the l_{p*} unit vector maximising <g, .> (GEOMETRY.md, Notation):
    ``sign(g) |g|^(p-1) / ||g||_p^(p-1)``. phi_1 = sign; phi_inf puts all mass on the largest |g_i|
    (the first one on ties)."""
    if p == 1:
        return torch.sign(g)
    if p == INF:
        return _argmax_sign(g, dims)
    t, s = _direction(g, p, dims)
    return t * s


def _argmax_sign(g: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    keep = [d for d in range(g.ndim) if d not in dims]
    moved = g.permute(keep + list(dims))
    flat = moved.reshape(*moved.shape[: len(keep)], -1)
    idx = flat.abs().argmax(dim=-1, keepdim=True)
    out = torch.zeros_like(flat).scatter_(-1, idx, torch.sign(flat.gather(-1, idx)))
    out = out.reshape(moved.shape)
    return out.permute([(keep + list(dims)).index(d) for d in range(g.ndim)])


def _apply_normalized_(
    param: torch.Tensor, g: torch.Tensor, p: float, dims: tuple[int, ...], c: float, workspace: Workspace | None
) -> None:
    """``param += c * phi_p(g)`` along ``dims``: one pass over ``param``, temporaries in ``workspace``."""
    if p == 1:
        param.add_(torch.sign(g, out=scratch(workspace, g, 0)), alpha=c)
    elif p == INF:
        param.add_(_argmax_sign(g, dims), alpha=c)
    else:
        t, s = _direction(g, p, dims, workspace)
        param.addcmul_(t, s, value=c)


class Geometry:
    """A norm on one parameter, with its dual norm and linear minimisation oracle.

    ``lmo(G)`` returns ``D* = argmin_{||D|| <= 1} <G, D>``, so ``<G, D*> = -dual_norm(G)`` and the
    optimizer step is ``W <- (1 - lr*wd) W + lr * D*``.
    """

    name = "geometry"
    matrix = True  # needs a layout with fan_out and fan_in axes

    def norm(self, d: torch.Tensor, layout: str | Layout | None = None) -> torch.Tensor:
        raise NotImplementedError

    def dual_norm(self, g: torch.Tensor, layout: str | Layout | None = None) -> torch.Tensor:
        raise NotImplementedError

    def lmo(self, g: torch.Tensor, layout: str | Layout | None = None) -> torch.Tensor:
        raise NotImplementedError

    def sign_scale(self, shape, layout: str | Layout | None = None) -> float | None:
        """c when the LMO is ``-c * sign(G)``, else None. Rescaled AdamW swaps sign(G) for Adam's direction."""
        return None

    def apply_lmo_(self, param: torch.Tensor, g: torch.Tensor, alpha: float, layout=None,
                   workspace: Workspace | None = None) -> None:
        """``param += alpha * lmo(g)`` in place. Geometries override it with fused kernels that skip the
        temporary LMO tensor (and keep other temporaries in ``workspace``); this plain form is the
        reference they are tested against."""
        param.add_(self.lmo(g, layout), alpha=alpha)

    def _layout(self, t: torch.Tensor, layout) -> Layout:
        return resolve_layout(layout, t)

    def __str__(self) -> str:
        shown = [
            f for f in fields(self)  # type: ignore[arg-type]
            if f.name in ("p", "q") or getattr(self, f.name) != f.default
        ]
        args = ", ".join(f"{f.name}={_fmt(getattr(self, f.name))}" for f in shown)
        return f"{self.name}({args})" if args else self.name


def _fmt(v) -> str:
    if isinstance(v, float):
        return "inf" if v == INF else f"{v:g}"
    return str(v)


@dataclass(frozen=True)
class Row(Geometry):
    """``(p,mean)->inf``: each row r takes ``-n^(-1/p) phi_p(G_r)``. Hidden and readout layers."""

    p: float = 2.0
    name = "row"

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", check_exponent("row geometry p", self.p))

    def norm(self, d, layout=None):
        lay = self._layout(d, layout)
        n = lay.fan_in(d.shape)
        return n ** (1 / self.p) * lp_norm(d, dual_exponent(self.p), lay.in_dims).max()

    def dual_norm(self, g, layout=None):
        lay = self._layout(g, layout)
        n = lay.fan_in(g.shape)
        return n ** (-1 / self.p) * lp_norm(g, self.p, lay.in_dims).sum()

    def lmo(self, g, layout=None):
        lay = self._layout(g, layout)
        n = lay.fan_in(g.shape)
        return phi(g, self.p, lay.in_dims).mul_(-(n ** (-1 / self.p)))

    def sign_scale(self, shape, layout=None):
        return 1 / _dims(shape, layout)[1] if self.p == 1 else None

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None):
        lay = self._layout(g, layout)
        c = -alpha * lay.fan_in(g.shape) ** (-1 / self.p)
        _apply_normalized_(param, g, self.p, lay.in_dims, c, workspace)


@dataclass(frozen=True)
class Col(Geometry):
    """``(1,mean)->(q,mean)``: each column c takes ``-(m^(1/q)/n) phi_{q*}(G_c)``."""

    q: float = 2.0
    name = "col"

    def __post_init__(self) -> None:
        object.__setattr__(self, "q", check_exponent("col geometry q", self.q))

    def _scale(self, shape, lay: Layout) -> float:
        """m^(1/q)/n: the LMO's factor; the norm carries its inverse."""
        return lay.fan_out(shape) ** (1 / self.q) / lay.fan_in(shape)

    def norm(self, d, layout=None):
        lay = self._layout(d, layout)
        return lp_norm(d, self.q, lay.out_dims).max() / self._scale(d.shape, lay)

    def dual_norm(self, g, layout=None):
        lay = self._layout(g, layout)
        return self._scale(g.shape, lay) * lp_norm(g, dual_exponent(self.q), lay.out_dims).sum()

    def lmo(self, g, layout=None):
        lay = self._layout(g, layout)
        return phi(g, dual_exponent(self.q), lay.out_dims).mul_(-self._scale(g.shape, lay))

    def sign_scale(self, shape, layout=None):
        return 1 / _dims(shape, layout)[1] if self.q == INF else None

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None):
        lay = self._layout(g, layout)
        c = -alpha * self._scale(g.shape, lay)
        _apply_normalized_(param, g, dual_exponent(self.q), lay.out_dims, c, workspace)


@dataclass(frozen=True)
class Embedding(Col):
    """``1->(q,mean)`` for one-hot inputs: column (token) c takes ``-m^(1/q) phi_{q*}(G_c)``; no 1/n factor."""

    q: float = 2.0
    name = "embedding"

    def __post_init__(self) -> None:
        object.__setattr__(self, "q", check_exponent("embedding geometry q", self.q))

    def _scale(self, shape, lay: Layout) -> float:
        return lay.fan_out(shape) ** (1 / self.q)

    def sign_scale(self, shape, layout=None):
        return 1.0 if self.q == INF else None


@dataclass(frozen=True)
class Sign(Geometry):
    """``(1,mean)->inf`` (= row(1) = col(inf)): ``-sign(G)/n``. Adam and SignSGD with the muP factor."""

    name = "sign"

    def norm(self, d, layout=None):
        return self._layout(d, layout).fan_in(d.shape) * d.abs().max()

    def dual_norm(self, g, layout=None):
        return g.abs().sum() / self._layout(g, layout).fan_in(g.shape)

    def lmo(self, g, layout=None):
        return torch.sign(g).mul_(-self.sign_scale(g.shape, self._layout(g, layout)))

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None):
        c = -alpha * self.sign_scale(g.shape, self._layout(g, layout))
        param.add_(torch.sign(g, out=scratch(workspace, g, 0)), alpha=c)

    def sign_scale(self, shape, layout=None):
        return 1 / _dims(shape, layout)[1]


@dataclass(frozen=True)
class Vector(Geometry):
    """``l_inf`` for biases and norm gains (any shape): ``-sign(g)``."""

    name = "vector"
    matrix = False

    def norm(self, d, layout=None):
        return d.abs().max() if d.numel() else d.new_zeros(())

    def dual_norm(self, g, layout=None):
        return g.abs().sum()

    def lmo(self, g, layout=None):
        return torch.sign(g).neg_()

    def sign_scale(self, shape, layout=None):
        return 1.0


SPECTRAL_SCALES = ("mean", "torch")


@dataclass(frozen=True)
class Spectral(Geometry):
    """``(2,mean)->(2,mean)`` (Muon): ``-s(m,n) U V^T`` for ``G = U S V^T``.

    ``scale="mean"`` is GEOMETRY.md's ``s = sqrt(m/n)``; ``scale="torch"`` is torch.optim.Muon's
    ``sqrt(max(1, m/n))``, which is the same construction for the norm ``||D||_{2->2} / s``. The polar
    factor comes from a Newton-Schulz iteration (torch.optim.Muon's defaults) or, as the reference,
    an exact SVD (``method="svd"``). ``dtype="auto"`` uses bfloat16 on GPUs and float32 on CPUs,
    where bfloat16 matmuls are slow.
    """

    method: str = "newton_schulz"
    steps: int = DEFAULT_NS_STEPS
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS
    dtype: str = "auto"
    scale: str = "mean"
    eps: float = NS_EPS
    name = "spectral"

    def __post_init__(self) -> None:
        if self.method not in ("newton_schulz", "svd"):
            raise ValueError(f"spectral method must be 'newton_schulz' or 'svd', got {self.method!r}")
        if self.scale not in SPECTRAL_SCALES:
            raise ValueError(f"spectral scale must be one of {SPECTRAL_SCALES}, got {self.scale!r}")
        if int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"spectral steps must be a positive integer, got {self.steps}")
        if len(self.coefficients) != 3:
            raise ValueError(f"spectral coefficients must be three numbers (a, b, c), got {self.coefficients}")
        object.__setattr__(self, "coefficients", tuple(float(c) for c in self.coefficients))

    def factor(self, m: int, n: int) -> float:
        return math.sqrt(m / n) if self.scale == "mean" else math.sqrt(max(1.0, m / n))

    def norm(self, d, layout=None):
        lay = self._layout(d, layout)
        mat = lay.to_matrix(d)
        return torch.linalg.matrix_norm(mat, ord=2).max() / self.factor(mat.shape[-2], mat.shape[-1])

    def dual_norm(self, g, layout=None):
        lay = self._layout(g, layout)
        mat = lay.to_matrix(g)
        return self.factor(mat.shape[-2], mat.shape[-1]) * torch.linalg.matrix_norm(mat, ord="nuc").sum()

    def lmo(self, g, layout=None):
        lay = self._layout(g, layout)
        mat = lay.to_matrix(g)
        polar = orthogonalize(mat, self.method, self.steps, self.coefficients, self.dtype, self.eps)
        polar = polar.to(g.dtype).mul_(-self.factor(mat.shape[-2], mat.shape[-1]))
        return lay.from_matrix(polar, g.shape)

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None):
        lay = self._layout(g, layout)
        mat = lay.to_matrix(g)
        polar = orthogonalize(mat, self.method, self.steps, self.coefficients, self.dtype, self.eps)
        param.add_(lay.from_matrix(polar, g.shape), alpha=-alpha * self.factor(mat.shape[-2], mat.shape[-1]))


def _dims(shape, layout) -> tuple[int, int]:
    lay = layout if isinstance(layout, Layout) else None
    if lay is None:
        lay = resolve_layout(layout, torch.empty(shape, device="meta"))
    return lay.fan_out(shape), lay.fan_in(shape)


GEOMETRIES: dict[str, type[Geometry]] = {
    cls.name: cls for cls in (Row, Col, Sign, Spectral, Embedding, Vector)
}


@lru_cache(maxsize=256)
def parse_geometry(spec: str | Geometry) -> Geometry:
    """Build a geometry from its spec string, e.g. ``"row(p=2)"``, ``"row(1.5)"``, ``"col(q=inf)"``,
    ``"spectral(method=svd)"``, ``"embedding"``. ``str(geometry)`` round-trips through this."""
    if isinstance(spec, Geometry):
        return spec
    try:
        node = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse geometry spec {spec!r}: {e.msg}") from None
    name, args, kwargs = _call_parts(node, spec)
    cls = GEOMETRIES.get(name)
    if cls is None:
        raise ValueError(f"unknown geometry {name!r} in {spec!r}; known: {', '.join(GEOMETRIES)}")
    try:
        return cls(*args, **kwargs)
    except TypeError as e:
        valid = ", ".join(f.name for f in fields(cls)) or "none"  # type: ignore[arg-type]
        raise ValueError(f"bad arguments in geometry spec {spec!r} ({e}); {name} takes: {valid}") from None


def _call_parts(node: ast.AST, spec: str):
    if isinstance(node, ast.Name):
        return node.id, (), {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = tuple(_literal(a, spec) for a in node.args)
        kwargs = {k.arg: _literal(k.value, spec) for k in node.keywords}
        return node.func.id, args, kwargs
    raise ValueError(f"geometry spec {spec!r} must look like name or name(arg=value, ...)")


def _literal(node: ast.AST, spec: str):
    if isinstance(node, ast.Name):  # bare words: inf, svd, torch, ...
        return INF if node.id == "inf" else node.id
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"geometry spec {spec!r}: arguments must be literals") from None
