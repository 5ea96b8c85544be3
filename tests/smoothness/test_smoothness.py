"""Block-norm smoothness by alternating LMO ascent, against quadratics whose smoothness is known exactly,
and Hessian-vector products through real models."""

import itertools

import pytest
import torch

from moga.models import GPT, ResidualMLP
from moga.roles import build_plan
from moga.smoothness import (
    BlockGeometry,
    HessianOperator,
    gradient,
    inner,
    measure,
    smoothness,
)

from .nets import Quadratic, block_of, classification_loss, quadratic_loss


def _symmetric(n, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=gen)
    return (a + a.T) / 2


def _check_ascent(est):
    """What every estimate promises: nondecreasing traces, HVPs counted, value = best start."""
    for run in est.runs:
        assert all(b >= a - 1e-12 * abs(b) for a, b in zip(run.trace, run.trace[1:]))
        assert run.value == max(run.trace) and run.iterations == len(run.trace) - 1
    assert est.hvps == sum(r.iterations + 1 for r in est.runs)
    assert est.value == max(est.per_start) and est.lower_bound
    assert sum(est.contributions.values()) == pytest.approx(est.value, rel=1e-12)
    assert "lower bound" in str(est) and "lower bound" in est.note


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sign_and_vector_geometry_by_vertex_enumeration(seed):
    # A 2x3 matrix in the sign geometry (ball: the cube of radius 1/n = 1/3) and a 3-vector in l_inf
    # (radius 1): the block ball is a box, so sup |u^T A v| is reached at vertices u = D s, v = D t,
    # and max_t s^T (D A D) t = ||D A D s||_1.
    A = _symmetric(9, seed)
    model = Quadratic([(2, 3), (3,)], A)
    block = block_of(list(model.weights), ["sign", "vector"], ["oi", None])
    D = torch.diag(torch.tensor([1 / 3] * 6 + [1.0] * 3))
    M = D @ A @ D
    exact = max(float((M @ torch.tensor(s)).abs().sum()) for s in itertools.product([-1.0, 1.0], repeat=9))

    est = smoothness(model, quadratic_loss, None, block, starts=8, max_iters=50, tol=0, seed=seed)
    _check_ascent(est)
    assert max(est.per_start) <= exact * (1 + 1e-12)  # a lower bound, start by start
    assert est.value == pytest.approx(exact, rel=1e-12)  # and the best start finds the vertex pair
    assert all(r.converged for r in est.runs)  # finitely many vertices: the ascent stops moving


def test_row_geometry_closed_form():
    # f(W) = 0.5 ||W X||_F^2: <H U, V> = sum_r U_r X X^T V_r^T. Rows are independent, each in the l2 ball
    # of radius n^(-1/2) (row(2): ||D|| = sqrt(n) max_r ||D_r||_2), so L = (m/n) lambda_max(X X^T).
    m, n = 4, 6
    X = torch.randn(n, 10, generator=torch.Generator().manual_seed(0))
    model = Quadratic([(m, n)], torch.kron(torch.eye(m), X @ X.T))  # w = vec(W) row-major
    block = block_of(list(model.weights), ["row(p=2)"], ["oi"])
    exact = m / n * float(torch.linalg.eigvalsh(X @ X.T)[-1])
    est = smoothness(model, quadratic_loss, None, block, starts=3, max_iters=300, tol=1e-12)
    _check_ascent(est)
    assert est.value <= exact * (1 + 1e-10)
    assert est.value == pytest.approx(exact, rel=1e-8)


def test_col_geometry_closed_form():
    # f(W) = 0.5 ||B W||_F^2: <H U, V> = sum_c U_c^T B^T B V_c; columns in the l2 ball of radius sqrt(m)/n
    # (col(2): ||D|| = n m^(-1/2) max_c ||D_c||_2), so L = (m/n) lambda_max(B^T B).
    m, n = 5, 3
    B = torch.randn(7, m, generator=torch.Generator().manual_seed(1))
    N = B.T @ B
    model = Quadratic([(m, n)], torch.kron(N, torch.eye(n)))  # vec(W) row-major: (B^T B W)_{rc}
    block = block_of(list(model.weights), ["col(q=2)"], ["oi"])
    exact = m / n * float(torch.linalg.eigvalsh(N)[-1])
    est = smoothness(model, quadratic_loss, None, block, starts=3, max_iters=300, tol=1e-12)
    _check_ascent(est)
    assert est.value == pytest.approx(exact, rel=1e-8) and est.value <= exact * (1 + 1e-10)


def test_spectral_geometry_closed_form():
    # f(W) = 0.5 ||W X||_F^2 with W m x n, m < n: <H U, V> = tr(V^T U M), M = X X^T. With ||U||_2, ||V||_2
    # <= sqrt(m/n), V^T U ranges over (m/n) times the rank-m contractions, so by Ky Fan
    # L = (m/n) * (sum of the m largest eigenvalues of M). The ascent is a subspace iteration.
    m, n = 3, 6
    X = torch.randn(n, 9, generator=torch.Generator().manual_seed(2))
    model = Quadratic([(m, n)], torch.kron(torch.eye(m), X @ X.T))
    block = block_of(list(model.weights), ["spectral(method=svd)"], ["oi"])
    exact = m / n * float(torch.linalg.eigvalsh(X @ X.T)[-m:].sum())
    est = smoothness(model, quadratic_loss, None, block, starts=3, max_iters=300, tol=1e-12)
    _check_ascent(est)
    assert est.value == pytest.approx(exact, rel=1e-8) and est.value <= exact * (1 + 1e-10)


def _tiny_gpt(attention):
    return GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8, attention=attention, seed=0)


def _gpt_loss(model, batch):
    return model(batch, batch)[1]


def test_gpt_hvp_is_symmetric_and_matches_finite_differences():
    model = _tiny_gpt("sdpa")  # the fused kernel has no double backward: the operator switches it
    batch = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(0))
    block = BlockGeometry.from_model(model)
    hess = HessianOperator(model, _gpt_loss, batch, block.params)
    assert all(m.attention == "sdpa" for m in model.modules() if hasattr(m, "attention"))  # restored
    gen = torch.Generator().manual_seed(1)
    u, v = block.random_unit(gen), block.random_unit(gen)
    hu, hv = hess(u), hess(v)
    assert inner(v, hu) == pytest.approx(inner(u, hv), rel=1e-9)
    # H v against the central difference of gradients.
    w0, h = block.snapshot(), 1e-5
    grads = []
    for sign in (1, -1):
        with torch.no_grad():
            for p, w, d in zip(block.params, w0, v):
                p.copy_(w + sign * h * d)
        grads.append(gradient(model, _gpt_loss, batch, block.params)[1])
    with torch.no_grad():
        for p, w in zip(block.params, w0):
            p.copy_(w)
    fd = [(a - b) / (2 * h) for a, b in zip(*grads)]
    err = max(float((x - y).abs().max()) for x, y in zip(fd, hv))
    assert err <= 1e-6 * max(float(x.abs().max()) for x in hv)
    assert hess.calls == 2


def test_residual_mlp_measurement_with_the_optimizers_plan():
    model = ResidualMLP(5, 3, width=8, depth=3, alpha=2 / 3, seed=0)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randn(16, 5, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    plan = build_plan(model)  # MOGA's: row(2) matrices, adam:vector biases (l_inf norms)
    result = measure(model, classification_loss, batch, plan, starts=3, max_iters=30, eigen_iters=40)
    _check_ascent(result.smoothness)
    again = smoothness(model, classification_loss, batch, plan, starts=3, max_iters=30)
    assert again.value == pytest.approx(result.smoothness.value, rel=1e-12)  # seeded: reproducible
    assert result.lipschitz == pytest.approx(sum(result.grad_dual_norms.values()))
    assert result.step == pytest.approx(result.lipschitz / result.smoothness.value)
    assert result.eigenvalue.hvps <= 40 and result.smoothness.value > 0
    # The matrices alone: a sub-block, with the biases held fixed.
    hidden = BlockGeometry.from_plan(plan).select(lambda e: e.role == "hidden")
    assert len(hidden) == 6
    part = smoothness(model, classification_loss, batch, hidden, starts=3, max_iters=30)
    _check_ascent(part)
    assert set(part.contributions) == set(hidden.names)
    d = result.as_dict()
    assert d["smoothness"]["lower_bound"] is True and len(d["smoothness"]["per_start"]) == 3


class _FusedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12)

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).split(4, dim=-1)  # (batch, heads, time, dim)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()


def test_no_double_backward_is_a_clear_error_and_frozen_params_are_zero():
    model = _FusedAttention().float()  # in float64 the CPU picks the math kernel, which has a double backward
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    hess = HessianOperator(model, lambda m, b: m(b), x, list(model.parameters()))
    with pytest.raises(RuntimeError, match="attention='math'"):
        hess([torch.ones_like(p) for p in model.parameters()])

    quad = Quadratic([(2, 2), (3,)], _symmetric(7, 0))
    quad.weights[1].requires_grad_(False)
    hess = HessianOperator(quad, quadratic_loss, None, list(quad.weights))
    assert torch.equal(hess.grad[1], torch.zeros(3))
    hv = hess([torch.ones(2, 2), torch.ones(3)])
    assert torch.equal(hv[1], torch.zeros(3)) and torch.allclose(hv[0].reshape(-1), quad.matrix[:4, :4].sum(1))
