"""Norms, dual norms and linear minimisation oracles: one small object per row of docs/math.md §2.

Every geometry works on the logical fan_out x fan_in matrix of a stored tensor, given by a
:mod:`moga.layout` string, so an embedding stored (vocab, d), a conv kernel or a stack of per-head
matrices needs no special case. Batch axes hold independent matrices: their norm is the max over the
stack and the dual norm the sum, as for the block norm (docs/math.md §1.5).

Each geometry has ``lmo(g)`` (the reference) and ``apply_lmo_(param, g, alpha)``, ``param += alpha *
lmo(g)`` without the temporary, and both read as the table's formula; the numerics (powers, safe
magnitudes, scratch memory) live in :mod:`moga.numerics`.

Sharded tensors. ``reduced_dims(layout)`` names the tensor dims a geometry's step reduces over: row(p)
reduces within a row (the fan_in dims), col(q) and embedding(q) within a column (fan_out dims), sign and
vector over nothing, spectral over the whole matrix. A shard that splits none of those dims steps alone.
When one is split, pass ``reduce(partial, op) -> Tensor`` (``op`` in ``{"sum", "max"}``) to ``lmo``,
``apply_lmo_``, ``norm`` and ``dual_norm``: it combines each per-row or per-column partial result across
the ranks holding the rest of that axis (an all-reduce of a vector, never of the matrix). ``norm`` and
``dual_norm`` take their outer max or sum over the rows (columns) this rank holds: when rows are split
too, the caller combines those. ``reduce=None`` (the default) means the axis is whole here. Spectral takes
no ``reduce``: it needs whole matrices. A shard also passes ``shape=``, the whole tensor's shape: the
factors (``n^(-1/p)``, ``m^(1/q)/n``, ``1/n``) count the whole matrix's fan_in and fan_out.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from moga.layout import LINEAR, Layout, as_layout, resolve_layout
from moga.geometry_base import Geometry, KernelPlan, check_exponent
from moga.numerics import INF, add_phi_, add_scaled_, dual_exponent, lp_norm, phi
from moga.orthogonalize import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS, NS_EPS, orthogonalize
from moga.workspace import scratch

__all__ = [
    "INF", "Col", "Embedding", "Geometry", "KernelPlan", "Row", "RowSpectral", "Sign", "Spectral", "SpectralRow",
    "Vector", "dual_exponent",
    "parse_geometry", "phi",
]


@dataclass(frozen=True)
class Row(Geometry):
    """``(p,mean)->inf``: each row r takes ``-n^(-1/p) phi_p(G_r)``. Hidden and readout layers."""

    p: float = 2.0
    name = "row"

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", check_exponent("row geometry p", self.p))

    def _scale(self, shape, lay: Layout) -> float:
        """n^(-1/p): the LMO's factor."""
        return lay.fan_in(shape) ** (-1 / self.p)

    def reduced_dims(self, layout=None):
        return _as_layout(layout).in_dims

    def norm(self, d, layout=None, reduce=None, shape=None):  # n^(1/p) max_r ||D_r||_{p*}
        lay = self._layout(d, layout)
        return lay.fan_in(shape or d.shape) ** (1 / self.p) * lp_norm(d, dual_exponent(self.p), lay.in_dims, reduce).max()

    def dual_norm(self, g, layout=None, reduce=None, shape=None):  # n^(-1/p) sum_r ||G_r||_p
        lay = self._layout(g, layout)
        return lay.fan_in(shape or g.shape) ** (-1 / self.p) * lp_norm(g, self.p, lay.in_dims, reduce).sum()

    def lmo(self, g, layout=None, reduce=None, shape=None):  # row r: -n^(-1/p) phi_p(G_r)
        lay = self._layout(g, layout)
        return phi(g, self.p, lay.in_dims, reduce).mul_(-self._scale(shape or g.shape, lay))

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None, reduce=None, shape=None):
        lay = self._layout(g, layout)
        add_phi_(param, g, self.p, lay.in_dims, -alpha * self._scale(shape or g.shape, lay), workspace, reduce)

    def sign_scale(self, shape, layout=None):
        return 1 / max(_dims(shape, layout)[1], 1) if self.p == 1 else None

    def kernel_plan(self, shape, layout):
        return KernelPlan.along(shape, layout.in_dims, self.p, self._scale(shape, layout))


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

    def reduced_dims(self, layout=None):
        return _as_layout(layout).out_dims

    def norm(self, d, layout=None, reduce=None, shape=None):  # (n / m^(1/q)) max_c ||D_c||_q
        lay = self._layout(d, layout)
        return lp_norm(d, self.q, lay.out_dims, reduce).max() / self._scale(shape or d.shape, lay)

    def dual_norm(self, g, layout=None, reduce=None, shape=None):  # (m^(1/q)/n) sum_c ||G_c||_{q*}
        lay = self._layout(g, layout)
        return self._scale(shape or g.shape, lay) * lp_norm(g, dual_exponent(self.q), lay.out_dims, reduce).sum()

    def lmo(self, g, layout=None, reduce=None, shape=None):  # column c: -(m^(1/q)/n) phi_{q*}(G_c)
        lay = self._layout(g, layout)
        return phi(g, dual_exponent(self.q), lay.out_dims, reduce).mul_(-self._scale(shape or g.shape, lay))

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None, reduce=None, shape=None):
        lay = self._layout(g, layout)
        add_phi_(param, g, dual_exponent(self.q), lay.out_dims, -alpha * self._scale(shape or g.shape, lay), workspace, reduce)

    def sign_scale(self, shape, layout=None):
        return 1 / max(_dims(shape, layout)[1], 1) if self.q == INF else None

    def kernel_plan(self, shape, layout):  # also Embedding's, whose _scale drops the 1/n
        return KernelPlan.along(shape, layout.out_dims, dual_exponent(self.q), self._scale(shape, layout))


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

    def reduced_dims(self, layout=None):
        return ()

    def norm(self, d, layout=None, reduce=None, shape=None):  # n max |D_ij|
        return self._layout(d, layout).fan_in(shape or d.shape) * d.abs().max()

    def dual_norm(self, g, layout=None, reduce=None, shape=None):  # ||G||_1 / n
        return g.abs().sum() / self._layout(g, layout).fan_in(shape or g.shape)

    def lmo(self, g, layout=None, reduce=None, shape=None):  # -sign(G) / n
        return torch.sign(g).mul_(-self.sign_scale(shape or g.shape, self._layout(g, layout)))

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None, reduce=None, shape=None):
        c = -alpha * self.sign_scale(shape or g.shape, self._layout(g, layout))
        add_scaled_(param, torch.sign(g, out=scratch(workspace, g, 0)), c)

    def sign_scale(self, shape, layout=None):
        return 1 / max(_dims(shape, layout)[1], 1)

    def kernel_plan(self, shape, layout):
        return KernelPlan.along(shape, (), 1.0, self.sign_scale(shape, layout))


@dataclass(frozen=True)
class Vector(Geometry):
    """``l_inf`` for biases and norm gains (any shape): ``-sign(g)``."""

    name = "vector"
    matrix = False

    def reduced_dims(self, layout=None):
        return ()

    def norm(self, d, layout=None, reduce=None, shape=None):  # max |d_i|
        return d.abs().max() if d.numel() else d.new_zeros(())

    def dual_norm(self, g, layout=None, reduce=None, shape=None):  # ||g||_1
        return g.abs().sum()

    def lmo(self, g, layout=None, reduce=None, shape=None):  # -sign(g)
        return torch.sign(g).neg_()

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None, reduce=None, shape=None):
        add_scaled_(param, torch.sign(g, out=scratch(workspace, g, 0)), -alpha)

    def sign_scale(self, shape, layout=None):
        return 1.0


SPECTRAL_SCALES = ("mean", "torch", "match_rms_adamw")


@dataclass(frozen=True)
class Spectral(Geometry):
    """``(2,mean)->(2,mean)`` (Muon): ``-s(m,n) U V^T`` for ``G = U S V^T``.

    ``scale="mean"`` is docs/math.md §3.5's ``s = sqrt(m/n)``; ``scale="torch"`` is torch.optim.Muon's
    ``sqrt(max(1, m/n))`` and ``"match_rms_adamw"`` Moonlight's ``0.2 sqrt(max(m, n))`` (torch's
    ``adjust_lr_fn="match_rms_adamw"``), each the same construction for the norm ``||D||_{2->2} / s``. The polar
    factor comes from a Newton-Schulz iteration (torch.optim.Muon's defaults) or, as the reference,
    an exact SVD (``method="svd"``). ``dtype="auto"`` uses bfloat16 on GPUs and on CPUs with bfloat16
    matrix units, float32 on other CPUs, where bfloat16 matmuls are slow.
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
        object.__setattr__(self, "steps", int(self.steps))
        if len(self.coefficients) != 3:
            raise ValueError(f"spectral coefficients must be three numbers (a, b, c), got {self.coefficients}")
        object.__setattr__(self, "coefficients", tuple(float(c) for c in self.coefficients))

    def factor(self, m: int, n: int) -> float:
        if self.scale == "match_rms_adamw":
            return 0.2 * math.sqrt(max(m, n))  # torch's expression, so that lr x factor rounds as torch's
        return math.sqrt(m / n) if self.scale == "mean" else math.sqrt(max(1.0, m / n))

    @property
    def batched(self) -> bool:
        """Whether same-shape matrices may share one batched Newton-Schulz call. Not under torch's scale or an
        explicit bfloat16, which promise torch.optim.Muon's numbers: a batched bfloat16 product can round
        differently from torch's per-matrix one on some CPUs."""
        return self.scale != "torch" and self.dtype != "bfloat16"

    def reduced_dims(self, layout=None):
        lay = _as_layout(layout)
        return tuple(sorted(lay.out_dims + lay.in_dims))

    def norm(self, d, layout=None, reduce=None, shape=None):  # sqrt(n/m) ||D||_{2->2}
        mat = _whole_matrices(self._layout(d, layout), d, reduce)
        return torch.linalg.matrix_norm(mat, ord=2).max() / self.factor(mat.shape[-2], mat.shape[-1])

    def dual_norm(self, g, layout=None, reduce=None, shape=None):  # sqrt(m/n) ||G||_nuclear
        mat = _whole_matrices(self._layout(g, layout), g, reduce)
        return self.factor(mat.shape[-2], mat.shape[-1]) * torch.linalg.matrix_norm(mat, ord="nuc").sum()

    def lmo(self, g, layout=None, reduce=None, shape=None):  # -sqrt(m/n) U V^T
        lay = self._layout(g, layout)
        return lay.from_matrix(self._polar(lay, g, reduce).to(g.dtype), g.shape).mul(-self._factor(lay, g))

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None, reduce=None, shape=None):
        lay = self._layout(g, layout)
        add_scaled_(param, lay.from_matrix(self._polar(lay, g, reduce), g.shape), -alpha * self._factor(lay, g))

    def _polar(self, lay: Layout, g: torch.Tensor, reduce) -> torch.Tensor:
        mat = _whole_matrices(lay, g, reduce)
        return orthogonalize(mat, self.method, self.steps, self.coefficients, self.dtype, self.eps)

    def _factor(self, lay: Layout, g: torch.Tensor) -> float:
        return self.factor(lay.fan_out(g.shape), lay.fan_in(g.shape))


@dataclass(frozen=True)
class RowSpectral(Spectral):
    """Rows normalized, then orthogonalized (MuonEq's R form, arXiv 2603.28254): ``-s(m,n) polar(N(G))`` with
    ``N(G)_r = G_r / ||G_r||_2`` (a zero row stays zero), docs/math.md §2.9.

    The last operation is the polar factor, so the step has unit norm in the spectral geometry (norm and dual
    norm are Spectral's) and one lr serves every width for the same reason as Muon's. It is not that norm's LMO
    for ``G`` itself: the equilibration changes the direction, so ``<G, D> >= -dual_norm(G)``."""

    name = "row_spectral"

    def _polar(self, lay: Layout, g: torch.Tensor, reduce) -> torch.Tensor:
        mat = _whole_matrices(lay, g, reduce)
        return orthogonalize(phi(mat, 2.0, (-1,)), self.method, self.steps, self.coefficients, self.dtype, self.eps)


NORMUON_EPS = 1e-10  # NorMuon's, added to the square root of the rows' second moment


@dataclass(frozen=True)
class SpectralRow(Spectral):
    """Orthogonalized, then rows normalized (NorMuon's order, arXiv 2510.05491), docs/math.md §2.9:
    ``O = polar(G)``, each row divided by its RMS (``beta2 = 0``) or by the square root of an EMA of its mean
    square (``beta2 > 0``: NorMuon's second moment), then rescaled to ``s(m,n) ||O||_F``, NorMuon's norm
    preservation. With ``beta2 = 0`` every row gets the same norm ``s(m,n) ||O||_F / sqrt(m)``, and the update's
    Frobenius norm, so its RMS, is Muon's at every shape.

    The second moment is optimizer state (``moment``, one number per row, shape :meth:`state_shape`), updated
    in place by :meth:`apply_lmo_` with weight ``moment_weight`` (``1 - beta2``; 0 on a skipped step). ``lmo``
    and ``apply_lmo_`` without it take a first step from a zero moment, which is the ``beta2 = 0`` step (the
    rescaling cancels the EMA's factor)."""

    beta2: float = 0.0
    name = "spectral_row"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= float(self.beta2) < 1:
            raise ValueError(f"spectral_row beta2 must be in [0, 1), got {self.beta2}")
        object.__setattr__(self, "beta2", float(self.beta2))

    @property
    def stateful(self) -> bool:
        return self.beta2 > 0

    def state_shape(self, shape, layout: str | Layout | None = None) -> tuple[int, ...] | None:
        """One second moment per row of each logical matrix, (batch, m); None without a second moment."""
        if not self.stateful:
            return None
        lay = _as_layout(layout)
        return math.prod(shape[d] for d in lay.batch_dims), lay.fan_out(shape)

    def lmo(self, g, layout=None, reduce=None, shape=None):
        lay = self._layout(g, layout)
        return lay.from_matrix(self._step(lay, g, reduce, None, None).to(g.dtype), g.shape)

    def apply_lmo_(self, param, g, alpha, layout=None, workspace=None, reduce=None, shape=None, moment=None,
                   moment_weight=None):
        lay = self._layout(g, layout)
        add_scaled_(param, lay.from_matrix(self._step(lay, g, reduce, moment, moment_weight), g.shape), alpha)

    def _step(self, lay: Layout, g: torch.Tensor, reduce, moment, weight) -> torch.Tensor:
        """The step ``D`` as (batch, m, n), in the polar factor's dtype; updates ``moment`` in place."""
        polar = self._polar(lay, g, reduce)
        if moment is None:
            rows = polar.norm(dim=-1, keepdim=True)  # beta2 = 0: each row's RMS, up to the factor sqrt(n)
        else:
            weight = 1 - self.beta2 if weight is None else weight
            moment.lerp_(polar.square().mean(dim=-1).to(moment.dtype),
                         weight.to(moment.dtype) if isinstance(weight, torch.Tensor) else weight)
            rows = moment.to(polar.dtype).sqrt().unsqueeze(-1)
        equal = polar / (rows + NORMUON_EPS)
        frob = lambda t: torch.linalg.matrix_norm(t, keepdim=True)  # noqa: E731
        return equal.mul_(frob(polar) / (frob(equal) + NORMUON_EPS) * -self._factor(lay, g))


def _whole_matrices(lay: Layout, t: torch.Tensor, reduce) -> torch.Tensor:
    if reduce is not None:
        raise ValueError("the spectral geometry needs whole matrices: gather the shards before its step")
    return lay.to_matrix(t)


def _as_layout(layout: str | Layout | None) -> Layout:
    """The layout of a plain matrix when none is given (as :func:`resolve_layout` does)."""
    return layout if isinstance(layout, Layout) else as_layout(layout or LINEAR)


def _dims(shape, layout) -> tuple[int, int]:
    lay = layout if isinstance(layout, Layout) else None
    if lay is None:
        lay = resolve_layout(layout, torch.empty(shape, device="meta"))
    return lay.fan_out(shape), lay.fan_in(shape)


GEOMETRIES: dict[str, type[Geometry]] = {
    cls.name: cls for cls in (Row, Col, Sign, Spectral, RowSpectral, SpectralRow, Embedding, Vector)
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


def spec_fields(spec: str) -> set[str]:
    """The fields a geometry spec string sets itself, by position or by name; the others take the class's
    defaults. The spec must parse (:func:`parse_geometry`)."""
    names = [f.name for f in fields(parse_geometry(spec))]  # type: ignore[arg-type]
    _, args, kwargs = _call_parts(ast.parse(spec.strip(), mode="eval").body, spec)
    return set(names[:len(args)]) | set(kwargs)


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
