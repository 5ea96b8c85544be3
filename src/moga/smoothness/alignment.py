"""How close row normalization is to orthogonalization on a momentum matrix (docs/math.md §3.6).

Row(2) steps each row of the momentum ``M`` (m x n, rows = fan_out) along ``M_r / ||M_r||``; the spectral
geometry steps along the polar factor ``U V^T`` of ``M = U S V^T``. When the rows are orthogonal (the Gram
matrix ``M M^T`` is diagonal) the two directions coincide, so how far the Gram matrix is from diagonal says
how far the two steps are apart. Three numbers per matrix:

- ``gram_dominance``: the mean over rows of ``|G_ii| / sum_{j != i} |G_ij|`` (Gershgorin's ratio: above 1 a
  row is strictly diagonally dominant; for i.i.d. Gaussian entries it falls like ``sqrt(n) / m``);
- ``gram_coherence``: the root mean square over pairs ``i != j`` of the rows' cosine ``G_ij / sqrt(G_ii G_jj)``
  (0 for orthogonal rows; about ``1 / sqrt(n)`` for i.i.d. Gaussian entries);
- ``cosine``: the Frobenius cosine between the row-normalized ``M`` and its exact polar factor (from an SVD,
  on M's range), the two directions' agreement itself (1 when they coincide); the geometries' scale factors
  do not change it.

Rows that are zero (a token never seen, a dead unit) have no direction and are left out of all three.
"""

from __future__ import annotations

import math

import torch

from moga.layout import resolve_layout
from moga.orthogonalize import svd_polar


def row_polar_alignment(m: torch.Tensor, dtype: torch.dtype = torch.float64) -> dict[str, float]:
    """``gram_dominance``, ``gram_coherence`` and ``cosine`` of one matrix, computed in ``dtype``."""
    if m.ndim != 2:
        raise ValueError(f"row_polar_alignment takes one matrix, got shape {tuple(m.shape)}")
    m = m.detach().to(dtype)
    norms = m.norm(dim=1)
    m = m[norms > 0]
    if m.shape[0] == 0:
        return {"gram_dominance": math.nan, "gram_coherence": math.nan, "cosine": math.nan}
    gram = m @ m.T
    diag = gram.diagonal()
    off = gram.abs().sum(dim=1) - diag.abs()
    rows = m.shape[0]
    dominance = (diag.abs() / off).mean().item() if rows > 1 else math.inf
    corr = gram / torch.sqrt(diag[:, None] * diag[None, :])
    coherence = math.sqrt(((corr ** 2).sum() - rows).clamp_min(0).item() / (rows * (rows - 1))) if rows > 1 else 0.0
    polar = svd_polar(m)  # on M's range, as Newton-Schulz makes it (zero singular values stay zero)
    row_dir = m / m.norm(dim=1, keepdim=True)
    cosine = ((row_dir * polar).sum() / (row_dir.norm() * polar.norm())).item()
    return {"gram_dominance": dominance, "gram_coherence": coherence, "cosine": cosine}


def hidden_alignment(optimizer, role: str = "hidden", buffer: str = "momentum_buffer",
                     dtype: torch.dtype = torch.float64) -> dict:
    """:func:`row_polar_alignment` of every ``role`` matrix's momentum buffer in a geometry optimizer (its
    param groups carry ``role`` and ``layout``); a stack of matrices counts each. Returns the per-matrix rows
    (``shape`` and the three numbers) and their means; empty when no such buffer exists yet."""
    layers = []
    for group in optimizer.param_groups:
        if group.get("role") != role:
            continue
        for p in group["params"]:
            buf = optimizer.state.get(p, {}).get(buffer)
            if buf is None or buf.ndim < 2:
                continue
            for mat in resolve_layout(group.get("layout"), buf).to_matrix(buf):
                layers.append({"shape": list(mat.shape), **row_polar_alignment(mat, dtype)})
    keys = ("gram_dominance", "gram_coherence", "cosine")
    means = {k: _finite_mean([r[k] for r in layers]) for k in keys}
    return {**means, "matrices": len(layers), "layers": layers}


def _finite_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan
