"""The block Lipschitz constant is the dual norm of the gradient: the largest directional derivative over
the unit ball, attained by the LMO direction."""

import pytest
import torch

from moga.smoothness import BlockGeometry, gradient, inner, lipschitz

from .nets import MIXED_OVERRIDES, MixedNet, classification_loss, mixed_batch


def _loss_at(model, params, point, batch):
    with torch.no_grad():
        for p, w in zip(params, point):
            p.copy_(w)
        return float(classification_loss(model, batch))


def test_dual_norm_is_the_largest_directional_derivative():
    torch.manual_seed(0)
    model, batch = MixedNet(), mixed_batch()
    block = BlockGeometry.from_model(model, overrides=MIXED_OVERRIDES)
    L = lipschitz(model, classification_loss, batch, block)
    loss, g = gradient(model, classification_loss, batch, block.params)
    assert L == pytest.approx(sum(block.dual_norms(g)))

    gen = torch.Generator().manual_seed(3)
    # Random feasible directions: uniform-ish on the sphere, and perturbed ascent directions near the optimum.
    sphere = [block.random_unit(gen) for _ in range(200)]
    near = []
    for scale in (1.0, 0.3, 0.1, 0.01):
        noisy = [gk + scale * gk.abs().mean() * torch.randn(gk.shape, generator=gen) for gk in g]
        near.append(block.ascent(noisy))
    slopes = [inner(g, u) for u in sphere + near]
    assert max(block.norm(u) for u in sphere + near) <= 1 + 1e-9
    assert max(slopes) <= L * (1 + 1e-9)
    assert max(inner(g, u) for u in near) == pytest.approx(L, rel=1e-2)  # approached as the noise vanishes
    assert max(inner(g, u) for u in sphere) < L

    # The LMO direction attains it, and a finite difference of the loss confirms the slope.
    best = block.ascent(g)
    assert inner(g, best) == pytest.approx(L, rel=1e-10)
    w0 = block.snapshot()
    h = 1e-5
    up = _loss_at(model, block.params, [w + h * d for w, d in zip(w0, best)], batch)
    down = _loss_at(model, block.params, [w - h * d for w, d in zip(w0, best)], batch)
    _loss_at(model, block.params, w0, batch)
    assert (up - down) / (2 * h) == pytest.approx(L, rel=1e-6)
    assert loss == pytest.approx(_loss_at(model, block.params, w0, batch))
