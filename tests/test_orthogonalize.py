"""Newton-Schulz against the exact polar factor from an SVD."""

import pytest
import torch

from moga.hardware import assume, detected
from moga.orthogonalize import CONVERGENT_NS_COEFFICIENTS, compute_dtype, newton_schulz, orthogonalize, svd_polar


def well_conditioned(m, n, cond=20.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    k = min(m, n)
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:, :k].T


@pytest.mark.parametrize("m,n", [(32, 32), (24, 40), (40, 24)])
def test_convergent_coefficients_reach_the_svd_polar_factor(m, n):
    g = well_conditioned(m, n)
    ns = newton_schulz(g, steps=40, coefficients=CONVERGENT_NS_COEFFICIENTS, dtype=torch.float64)
    torch.testing.assert_close(ns, svd_polar(g), atol=1e-8, rtol=0)
    k = min(m, n)
    gram = ns.T @ ns if m >= n else ns @ ns.T
    torch.testing.assert_close(gram, torch.eye(k, dtype=torch.float64), atol=1e-8, rtol=0)


@pytest.mark.parametrize("m,n", [(64, 64), (48, 96), (96, 48)])
def test_tuned_coefficients_leave_singular_values_in_a_band(m, n):
    # torch.optim.Muon's quintic trades convergence for speed: singular values end near 1, not at 1.
    g = well_conditioned(m, n, cond=100.0).float()
    s = torch.linalg.svdvals(orthogonalize(g, dtype=torch.float32))
    assert s.min() > 0.6 and s.max() < 1.25, (s.min().item(), s.max().item())
    # The singular vectors are the SVD's: the factor has the same polar part.
    torch.testing.assert_close(svd_polar(orthogonalize(g, dtype=torch.float32)), svd_polar(g), atol=1e-4, rtol=0)


def test_batched_equals_per_matrix():
    g = torch.randn(3, 16, 24)
    batched = newton_schulz(g, dtype=torch.float32)
    for k in range(3):
        torch.testing.assert_close(batched[k], newton_schulz(g[k], dtype=torch.float32), atol=1e-5, rtol=1e-5)


def test_svd_polar_drops_null_directions():
    g = torch.randn(6, 1, dtype=torch.float64) @ torch.randn(1, 5, dtype=torch.float64)  # rank one
    polar = svd_polar(g)
    assert torch.linalg.matrix_rank(polar).item() == 1
    assert torch.equal(svd_polar(torch.zeros(4, 3)), torch.zeros(4, 3))


@pytest.mark.parametrize("bf16_units", [False, True], ids=["no-bf16-units", "bf16-units"])
def test_auto_dtype_follows_the_cpus_bf16_matrix_units(bf16_units):
    with assume(bf16_matmul=bf16_units):
        assert compute_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if bf16_units else torch.float32)
        assert compute_dtype("auto", torch.device("meta")) == torch.bfloat16
        g = torch.randn(8, 12, dtype=torch.float64)
        ns = newton_schulz(g)  # computed in the dtype "auto" picks, returned in the input's
        assert ns.dtype == torch.float64
        assert torch.equal(ns, newton_schulz(g, dtype=compute_dtype("auto", g.device)).double())
        assert torch.equal(ns, newton_schulz(g, dtype=torch.bfloat16).double()) is bf16_units


def test_bf16_matmul_is_read_from_the_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    assert detected().bf16_matmul is bool(flags & {"amx_bf16", "avx512_bf16"})


def test_a_bad_dtype_is_an_error():
    with pytest.raises(ValueError, match="dtype"):
        newton_schulz(torch.randn(4, 4), dtype="int8")
