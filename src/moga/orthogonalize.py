"""The polar factor U V^T of a (batch of) matrices: Newton-Schulz iteration, with exact SVD as the reference.

The default Newton-Schulz coefficients and step count are torch.optim.Muon's (Keller Jordan's quintic,
tuned to raise small singular values fast; it leaves them in a band around 1 instead of converging).
For 2-D inputs the operations are the same as torch.optim.Muon's, so the two agree in the same dtype.
"""

from __future__ import annotations

import torch

from moga.hardware import facts

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
NS_EPS = 1e-7
# The cubic Newton-Schulz map x -> 1.5x - 0.5x^3 converges to 1 for every singular value in (0, sqrt(3)).
CONVERGENT_NS_COEFFICIENTS = (1.5, -0.5, 0.0)


def compute_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on accelerators and on CPUs with bfloat16 matrix units (AMX, AVX512-BF16; see
    :func:`moga.hardware.facts`), float32 on other CPUs, where bfloat16 matmuls are emulated and ~3x slower."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type != "cpu" or facts().bf16_matmul else torch.float32
    try:
        resolved = getattr(torch, dtype)
    except AttributeError:
        resolved = None
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown floating dtype {dtype!r} for Newton-Schulz; use auto, float32, bfloat16 or float64")
    return resolved


def newton_schulz(
    mat: torch.Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    dtype: str | torch.dtype = "auto",
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Approximate U V^T of ``mat`` (..., m, n), computed in ``dtype`` and returned in ``mat``'s dtype."""
    a, b, c = coefficients
    x = mat.to(compute_dtype(dtype, mat.device))
    tall = mat.size(-2) > mat.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = _rescue_extreme(x)
    if x.ndim == 2:
        # Frobenius normalization puts every singular value in [0, 1].
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        lead = x.shape[:-2]
        x = x.reshape(-1, *x.shape[-2:])
        x = x / torch.linalg.matrix_norm(x, keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
        x = x.reshape(*lead, *x.shape[-2:])
    return (x.mT if tall else x).to(mat.dtype)


def _rescue_extreme(x: torch.Tensor) -> torch.Tensor:
    """Divide by max|x| the matrices whose Frobenius norm under- or overflows in this dtype, so that a
    gradient of 1e-30s is still orthogonalized. Others are multiplied by exactly 1 (no host sync)."""
    fro = torch.linalg.matrix_norm(x.float(), keepdim=True)
    info = torch.finfo(x.dtype)
    ok = (fro > info.tiny**0.5 * 1e4) & (fro < info.max**0.5 * 1e-4)
    peak = torch.amax(x.abs(), dim=(-2, -1), keepdim=True).float()
    scale = torch.where(ok | (peak == 0), torch.ones_like(peak), peak.reciprocal())
    return x * scale.to(x.dtype)


def svd_polar(mat: torch.Tensor) -> torch.Tensor:
    """Exact U V^T, dropping directions of (numerically) zero singular values so that 0 maps to 0."""
    work = mat if mat.dtype in (torch.float32, torch.float64) else mat.float()
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    tol = s.amax(dim=-1, keepdim=True) * max(mat.shape[-2:]) * torch.finfo(work.dtype).eps
    keep = (s > tol).to(work.dtype).unsqueeze(-2)
    return (u * keep) @ vh


def orthogonalize(
    mat: torch.Tensor,
    method: str = "newton_schulz",
    steps: int = DEFAULT_NS_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    dtype: str | torch.dtype = "auto",
    eps: float = NS_EPS,
) -> torch.Tensor:
    if method == "svd":
        return svd_polar(mat)
    if method == "newton_schulz":
        return newton_schulz(mat, steps, coefficients, dtype, eps)
    raise ValueError(f"unknown orthogonalization method {method!r}; use 'newton_schulz' or 'svd'")
