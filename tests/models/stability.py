"""The depth paper's forward-stability measurements at initialization, shared by the MLP and GPT tests."""

import itertools

import torch

DEPTHS = (2, 4, 8, 16, 32, 64)


def block_grad_norms(blocks) -> torch.Tensor:
    """The Frobenius norm of each block's gradient (all its parameters together)."""
    return torch.stack([torch.sqrt(sum(p.grad.square().sum() for p in b.parameters())) for b in blocks])


def rms(x: torch.Tensor) -> float:
    return x.square().mean().sqrt().item()


def check_depth_stability(measure):
    """``measure(depth, alpha) -> (final hidden RMS, mean block gradient norm)``.

    With alpha = K_base/K (K_base = 2) the final hidden state stays bounded and each block's gradient
    shrinks like 1/K (depth paper: Corollary 1, and the O(1/K) sensitivity bound in the proof of
    Theorem 1); with alpha = 1 the hidden state grows with K. Returns the measurements for reporting.
    """
    scaled = {k: measure(k, 2 / k) for k in DEPTHS}
    unscaled = {k: measure(k, 1.0) for k in DEPTHS}
    base_rms, base_grad = scaled[2]
    for k, (h, g) in scaled.items():
        assert 0.67 < h / base_rms < 1.5, f"scaled K={k}: final RMS {h:.4g} vs {base_rms:.4g} at K=2"
        # K * (block gradient) is about constant, i.e. the gradient scales like 1/K.
        assert 0.5 < (k * g) / (2 * base_grad) < 2, f"scaled K={k}: block grad {g:.4g}, K=2: {base_grad:.4g}"
    rms_unscaled = [unscaled[k][0] for k in DEPTHS]
    assert all(a < b for a, b in itertools.pairwise(rms_unscaled)), rms_unscaled
    assert rms_unscaled[-1] > 2 * rms_unscaled[0], rms_unscaled
    return scaled, unscaled
