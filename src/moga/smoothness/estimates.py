"""Lipschitz and smoothness constants of the loss at one point, in the block norm and in l2.

docs/math.md §5.1-5.3:

- Lipschitz constant ``sup_{||U||_block <= 1} <grad, U> = ||grad||_block,*``: exact, attained at
  ``U = -lmo(grad)``.
- Smoothness ``sup_{||U||,||V|| <= 1} |<H U, V>|``: a lower bound from alternating ascent, see
  :func:`smoothness`.
- Euclidean top eigenvalue of H, by power iteration or Lanczos, for comparison with standard tools.

Costs (an HVP is about two backwards; building a :class:`HessianOperator` is one forward and backward):

============================  ==============================================================
``lipschitz``                 1 forward + 1 backward, no HVP
``smoothness``                ``starts * (iterations + 1)`` HVPs, at most ``starts * (max_iters + 1)``;
                              plus one block LMO and one dual norm per HVP
``euclidean_top_eigenvalue``  one HVP per iteration (at most ``iters``); Lanczos also keeps
                              ``iters`` flat copies of the parameters
``measure``                   the sum of the above, on one shared operator
============================  ==============================================================
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from moga.smoothness.block import BlockGeometry
from moga.smoothness.diagnostics import depth_paper_step
from moga.smoothness.hessian import HessianOperator, LossFn, gradient

LOWER_BOUND_NOTE = ("a lower bound: the best local maximum reached by alternating ascent on the nonconvex "
                    "problem sup |<H U, V>| over the block unit ball")


def lipschitz(model: nn.Module, loss_fn: LossFn, batch, block) -> float:
    """``||grad||_block,* = sum_k ||grad_k||_k*``: the exact Lipschitz constant of the loss at the current
    parameters in the block norm (the largest directional derivative over the unit ball)."""
    block = BlockGeometry.of(block)
    _, grads = gradient(model, loss_fn, batch, block.params)
    return block.dual_norm(grads)


# --- block-norm smoothness ------------------------------------------------------------------------------


@dataclass
class AscentRun:
    """One start of the alternating ascent: its value after every HVP (nondecreasing), and how it ended."""

    value: float
    iterations: int
    converged: bool
    trace: list[float] = field(default_factory=list)


@dataclass
class SmoothnessEstimate:
    """``sup_{||U||,||V|| <= 1} |<H U, V>|`` in the block norm: ``value`` is a lower bound (see ``note``)."""

    value: float
    runs: list[AscentRun]
    hvps: int
    contributions: dict[str, float] = field(default_factory=dict)  # each parameter's share of ``value``
    lower_bound: bool = True

    @property
    def per_start(self) -> list[float]:
        return [r.value for r in self.runs]

    @property
    def iterations(self) -> list[int]:
        return [r.iterations for r in self.runs]

    @property
    def note(self) -> str:
        return LOWER_BOUND_NOTE

    def as_dict(self) -> dict:
        return {"value": self.value, "lower_bound": self.lower_bound, "note": self.note, "hvps": self.hvps,
                "per_start": self.per_start, "iterations": self.iterations,
                "contributions": self.contributions, "runs": [asdict(r) for r in self.runs]}

    def __str__(self) -> str:
        return (f"block smoothness >= {self.value:.6g} (best of {len(self.runs)} starts, "
                f"iterations {self.iterations}, {self.hvps} HVPs; {LOWER_BOUND_NOTE})")


def block_smoothness(hessian: HessianOperator, block: BlockGeometry, starts: int = 4, max_iters: int = 50,
                     tol: float = 1e-4, seed: int = 0) -> SmoothnessEstimate:
    """Alternating ascent on ``<H U, V>`` over the block unit ball, with an existing operator.

    Each iteration is one HVP: ``V <- argmax_{||V|| <= 1} <H U, V> = -lmo(H U)``, then the roles swap
    (H is symmetric). The value after a product with ``U`` is ``max_V <H U, V> = ||H U||_* / ||U||``,
    computed exactly by the dual norm; since the ball is symmetric this is also ``max_V |<H U, V>|``, so
    no sign needs trying separately. It never decreases: ``||H V||_* >= <H V, U> = ||H U||_*`` for the V
    built from U. It stops when an iteration gains less than ``tol`` (relative) or after ``max_iters``
    iterations. Starts are ``U_0 = -lmo(Z)`` for Gaussian Z: extreme points of the ball.

    Every value is attained by feasible U and V, so it is a lower bound on the smoothness constant: a local
    maximum of a nonconvex problem, not the supremum. ``contributions`` splits the best value by parameter:
    ``||(H U)_k||_k* / ||U||``, the part of ``<H U, V>`` that parameter k's block of V collects.
    """
    if starts < 1 or max_iters < 0:
        raise ValueError(f"need starts >= 1 and max_iters >= 0, got {starts}, {max_iters}")
    params = block.params
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    calls0 = hessian.calls
    runs, best = [], [-1.0]
    for _ in range(starts):
        u = block.ascent([torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
                          for p in params])
        shares, hu = _ascent_value(hessian, block, u)
        trace, converged = [sum(shares)], False
        best = max(best, shares, key=sum)
        for _ in range(max_iters):
            shares, hu = _ascent_value(hessian, block, block.ascent(hu))
            trace.append(sum(shares))
            best = max(best, shares, key=sum)
            if trace[-1] - trace[-2] <= tol * abs(trace[-1]):
                converged = True
                break
        runs.append(AscentRun(max(trace), len(trace) - 1, converged, trace))
    return SmoothnessEstimate(max(r.value for r in runs), runs, hessian.calls - calls0, dict(zip(block.names, best)))


def _ascent_value(hessian: HessianOperator, block: BlockGeometry, u: list[torch.Tensor]):
    """(the terms of ``max_{||V|| <= 1} <H U, V> / ||U|| = sum_k ||(H U)_k||_k* / ||U||``, H U). Dividing by
    ``||U||`` (1 up to rounding) keeps the value a lower bound even if an LMO lands a hair outside the ball."""
    hu = hessian(u)
    size = block.norm(u)
    return [d / size if size > 0 else 0.0 for d in block.dual_norms(hu)], hu


def smoothness(model: nn.Module, loss_fn: LossFn, batch, block, starts: int = 4, max_iters: int = 50,
               tol: float = 1e-4, seed: int = 0) -> SmoothnessEstimate:
    """A lower bound on the block-norm smoothness ``sup_{||U||,||V|| <= 1} |d2 loss[U, V]|`` at the current
    parameters, on ``batch``: see :func:`block_smoothness`. Costs ``starts * (iterations + 1)`` HVPs."""
    block = BlockGeometry.of(block)
    hessian = HessianOperator(model, loss_fn, batch, block.params)
    return block_smoothness(hessian, block, starts, max_iters, tol, seed)


# --- Euclidean top eigenvalue ---------------------------------------------------------------------------

EIGEN_METHODS = ("power", "lanczos")


@dataclass
class EigenEstimate:
    """The Hessian eigenvalue of largest magnitude (signed), ``|value| = ||H||_2``, the l2 smoothness.

    Lanczos also gives the largest and smallest eigenvalue (extreme Ritz values); power iteration
    leaves them None.
    """

    value: float
    method: str
    iterations: int
    hvps: int
    converged: bool
    largest: float | None = None
    smallest: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def hessian_top_eigenvalue(hessian: HessianOperator, iters: int = 100, method: str = "power", tol: float = 1e-6,
                           seed: int = 0) -> EigenEstimate:
    """Power iteration or Lanczos (full reorthogonalization) on an existing operator; one HVP per iteration."""
    if method not in EIGEN_METHODS:
        raise ValueError(f"method must be one of {EIGEN_METHODS}, got {method!r}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    ref = hessian.params[0]
    generator = torch.Generator(device=ref.device).manual_seed(seed)
    n = hessian.numel
    v = torch.randn(n, generator=generator, dtype=ref.dtype, device=ref.device)
    v /= torch.linalg.vector_norm(v)
    calls0 = hessian.calls
    if method == "power":
        return _power(hessian, v, iters, tol, calls0)
    return _lanczos(hessian, v, min(iters, n), tol, calls0)


def _power(hessian, v, iters, tol, calls0) -> EigenEstimate:
    value, converged, k = 0.0, False, 0
    for k in range(1, iters + 1):
        hv = hessian.matvec(v)
        new = float(torch.dot(v.double(), hv.double()))  # Rayleigh quotient, signed
        norm = torch.linalg.vector_norm(hv)
        if norm == 0:
            value, converged = 0.0, True
            break
        v = hv / norm
        if k > 1 and abs(new - value) <= tol * abs(new):
            value, converged = new, True
            break
        value = new
    return EigenEstimate(value, "power", k, hessian.calls - calls0, converged)


def _lanczos(hessian, v, iters, tol, calls0) -> EigenEstimate:
    basis = [v]
    alphas: list[float] = []
    betas: list[float] = []
    top = bottom = 0.0
    converged = False
    for k in range(iters):
        w = hessian.matvec(basis[-1])
        alphas.append(float(torch.dot(w.double(), basis[-1].double())))
        # Full reorthogonalization (twice is enough): loses nothing at the sizes we measure.
        stack = torch.stack(basis)
        for _ in range(2):
            w = w - stack.T @ (stack @ w)
        ritz = torch.linalg.eigvalsh(_tridiagonal(alphas, betas))
        new_top, new_bottom = float(ritz[-1]), float(ritz[0])
        scale = max(abs(new_top), abs(new_bottom))
        if k > 0 and max(abs(new_top - top), abs(new_bottom - bottom)) <= tol * scale:
            converged = True
        top, bottom = new_top, new_bottom
        beta = float(torch.linalg.vector_norm(w))
        if converged or beta <= 1e-10 * max(scale, 1e-30) or k == iters - 1:
            # An invariant subspace (beta ~ 0) or the whole space: the Ritz values are eigenvalues.
            converged = converged or beta <= 1e-10 * max(scale, 1e-30) or len(basis) == hessian.numel
            break
        betas.append(beta)
        basis.append(w / beta)
    value = top if abs(top) >= abs(bottom) else bottom
    return EigenEstimate(value, "lanczos", len(alphas), hessian.calls - calls0, converged, top, bottom)


def _tridiagonal(alphas: list[float], betas: list[float]) -> torch.Tensor:
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas[: len(alphas) - 1], dtype=torch.float64)
        t += torch.diag(off, 1) + torch.diag(off, -1)
    return t


def euclidean_top_eigenvalue(model: nn.Module, loss_fn: LossFn, batch, params=None, iters: int = 100,
                             method: str = "power", tol: float = 1e-6, seed: int = 0) -> EigenEstimate:
    """The Hessian's eigenvalue of largest magnitude in l2 (what PyHessian reports); one HVP per iteration.

    ``params`` is a list of tensors, or anything :meth:`BlockGeometry.of` takes; all of the model's
    trainable parameters by default.
    """
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    elif not isinstance(params, (list, tuple)):
        params = BlockGeometry.of(params).params
    return hessian_top_eigenvalue(HessianOperator(model, loss_fn, batch, params), iters, method, tol, seed)


# --- everything at one point ------------------------------------------------------------------------------


@dataclass
class Measurement:
    """The constants of the loss at one point, on one batch; what a ``moga smoothness`` run records."""

    loss: float
    lipschitz: float
    smoothness: SmoothnessEstimate
    eigenvalue: EigenEstimate | None
    grad_dual_norms: dict[str, float]
    step: float  # the depth paper's eta* = lipschitz / smoothness

    def as_dict(self) -> dict:
        return {"loss": self.loss, "lipschitz": self.lipschitz, "smoothness": self.smoothness.as_dict(),
                "eigenvalue": self.eigenvalue.as_dict() if self.eigenvalue else None,
                "grad_dual_norms": self.grad_dual_norms, "step": self.step}


def measure(model: nn.Module, loss_fn: LossFn, batch, block, starts: int = 4, max_iters: int = 50,
            tol: float = 1e-4, seed: int = 0, eigen_iters: int = 0, eigen_method: str = "lanczos") -> Measurement:
    """Loss, exact block Lipschitz constant, block smoothness lower bound and (if ``eigen_iters``) the l2
    top eigenvalue, all from one :class:`HessianOperator` (one graph, one gradient)."""
    block = BlockGeometry.of(block)
    hessian = HessianOperator(model, loss_fn, batch, block.params)
    duals = block.dual_norms(hessian.grad)
    smooth = block_smoothness(hessian, block, starts, max_iters, tol, seed)
    eigen = hessian_top_eigenvalue(hessian, eigen_iters, eigen_method, seed=seed) if eigen_iters else None
    lip = sum(duals)
    step = depth_paper_step(lip, smooth.value) if smooth.value > 0 else math.inf
    return Measurement(hessian.loss, lip, smooth, eigen, dict(zip(block.names, duals)), step)
