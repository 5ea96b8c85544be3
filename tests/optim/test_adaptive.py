"""The convergence paper's adaptive step: the formula in float64 without overflow, and descent."""

import math
from decimal import Decimal, getcontext

import pytest
import torch
from torch.nn import functional as F

from moga.models import FeedForward
from moga.optim.adaptive import AdaptiveGD, adaptive_step, global_norm, log_adaptive_step, log_geometric_sum


def reference_eta(alpha, layers, w0, w, loss):
    """The formula term by term in 60-digit decimals: no overflow there, so it is the ground truth."""
    getcontext().prec = 60
    w0, w = Decimal(w0), Decimal(w)
    geometric = Decimal(1) + sum(w**j for j in range(1, 2 * layers - 1))
    eta = Decimal(alpha) * w0 ** (2 * layers - 2) / ((1 + Decimal(loss).sqrt()) * geometric)
    return eta


@pytest.mark.parametrize("r", [0.0, 1e-9, 0.3, 1 - 1e-12, 1.0, 1 + 1e-12, 1.7, 40.0, 1e6])
@pytest.mark.parametrize("n", [1, 2, 7, 31, 199])
def test_log_geometric_sum_matches_the_sum(r, n):
    getcontext().prec = 60
    exact = Decimal(1) + sum(Decimal(r) ** j for j in range(1, n))
    log_r = math.log(r) if r > 0 else -math.inf
    assert log_geometric_sum(log_r, n) == pytest.approx(float(exact.ln()), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("layers", [2, 4, 16, 100])
@pytest.mark.parametrize("w0,w", [(5.0, 5.0), (20.0, 35.0), (40.0, 1.0), (1e12, 3e12), (0.5, 0.7)])
def test_adaptive_step_matches_exact_arithmetic_without_overflow(layers, w0, w):
    loss = 0.37
    exact = reference_eta(2.0, layers, w0, w, loss)
    log_eta = log_adaptive_step(2.0, layers, w0, w, loss)
    assert math.isfinite(log_eta)
    assert log_eta == pytest.approx(float(exact.ln()), rel=1e-10, abs=1e-10)
    if exact < Decimal("1e300"):
        assert adaptive_step(2.0, layers, w0, w, loss) == pytest.approx(float(exact), rel=1e-10)


def test_naive_float_arithmetic_would_overflow_at_depth_16():
    # Sanity check that the test above is meaningful: r^(2L-2) at L=16 leaves float64 for r ~ 1e12.
    with pytest.raises(OverflowError):
        (1e12) ** 30
    assert math.isfinite(adaptive_step(1.0, 16, 1e12, 1e12, 1.0))


def test_global_norm_is_the_frobenius_norm_of_everything_and_survives_huge_entries():
    ts = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    assert global_norm(ts) == pytest.approx(float(torch.cat([t.flatten() for t in ts]).double().norm()), rel=1e-12)
    huge = [torch.full((4,), 1e300, dtype=torch.float64), torch.ones(2, dtype=torch.float64)]
    assert global_norm(huge) == pytest.approx(2e300, rel=1e-12)


def full_batch_problem(seed=0, n=128, d=8):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = torch.tanh(x @ torch.randn(d, 1, generator=gen) / d**0.5) * 2
    return x, y


def train_adaptive(model, x, y, alpha, layers, steps):
    opt = AdaptiveGD(model.parameters(), alpha=alpha, layers=layers)
    losses, etas, norms = [], [], []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step(loss=loss.item())
        losses.append(loss.item())
        etas.append(opt.last["eta"])
        norms.append(opt.last["w_norm"])
    return losses, etas, norms, opt


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_decreases_monotonically_under_full_batch_gd(seed):
    x, y = full_batch_problem(seed)
    torch.manual_seed(seed)
    model = FeedForward(8, 32, depth=4, out_features=1, activation="gelu")
    losses, etas, norms, opt = train_adaptive(model, x, y, alpha=0.5, layers=4, steps=150)
    assert all(b <= a for a, b in zip(losses, losses[1:])), "the loss went up"
    assert losses[-1] < 0.2 * losses[0]
    assert all(e > 0 and math.isfinite(e) for e in etas)
    # eta_0 is the formula at W_0 with the first loss.
    assert etas[0] == pytest.approx(adaptive_step(0.5, 4, norms[0], norms[0], losses[0]), rel=1e-12)
    assert opt.w0_norm == norms[0]


def test_nothing_overflows_at_depth_16():
    x, y = full_batch_problem(0, d=64)
    torch.manual_seed(0)
    model = FeedForward(64, 64, depth=16, out_features=1, activation="tanh")
    with torch.no_grad():  # inflate the weights: ||W||^30 is then far beyond float32 (and 1e+45 in float64)
        for p in model.parameters():
            p.mul_(1.5)
    losses, etas, norms, _ = train_adaptive(model, x, y, alpha=1.0, layers=16, steps=25)
    assert norms[0] ** 30 > torch.finfo(torch.float32).max
    assert all(math.isfinite(v) for v in losses + etas + norms)
    assert all(e > 0 for e in etas)
    assert losses[-1] <= losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_step_needs_the_loss_and_accepts_a_closure():
    model = torch.nn.Linear(3, 1, bias=False)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = AdaptiveGD(model.parameters(), alpha=0.1, layers=1)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="needs the loss"):
        opt.step()

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = F.mse_loss(model(x), y).item()
    opt.step(closure)
    # L = 1: eta = alpha / (1 + sqrt(loss)), whatever the norm.
    assert opt.last["eta"] == pytest.approx(0.1 / (1 + math.sqrt(before)), rel=1e-6)
    with pytest.raises(FloatingPointError):
        AdaptiveGD(model.parameters(), alpha=0.1, layers=1, nonfinite="raise").step(loss=float("nan"))


@pytest.mark.parametrize("where", ["gradient", "loss"])
def test_a_non_finite_step_is_skipped_or_raises_and_writes_nothing(where):
    """AdaptiveGD wrote NaN into the weights on a NaN gradient; now it has the others' policy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def backward():
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if where == "gradient":
            model[1].weight.grad[0, 2] = float("nan")
        return loss.item() if where == "gradient" else float("inf")

    opt = AdaptiveGD(model.parameters(), alpha=0.1, layers=2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(loss=backward())
    assert opt.skipped_steps == 1 and opt.w0_norm is None
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    restored = AdaptiveGD(model.parameters(), alpha=0.1, layers=2)
    restored.load_state_dict(opt.state_dict())
    assert restored.skipped_steps == 1
    strict = AdaptiveGD(model.parameters(), alpha=0.1, layers=2, nonfinite="raise")
    with pytest.raises(FloatingPointError, match="group 0 param 2" if where == "gradient" else "loss inf"):
        strict.step(loss=backward())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="nonfinite"):
        AdaptiveGD(model.parameters(), nonfinite="warn")


def test_state_dict_keeps_w0_and_schedulers_scale_alpha():
    model = torch.nn.Linear(4, 2, bias=False)
    opt = AdaptiveGD(model.parameters(), alpha=0.3, layers=2)
    model(torch.randn(5, 4)).square().mean().backward()
    opt.step(loss=1.0)
    state = opt.state_dict()
    fresh = AdaptiveGD(model.parameters(), alpha=0.3, layers=2)
    fresh.load_state_dict(state)
    assert fresh.w0_norm == opt.w0_norm
    with pytest.raises(ValueError, match="L=2"):
        AdaptiveGD(model.parameters(), alpha=0.3, layers=3).load_state_dict(state)
    fresh.param_groups[0]["lr"] = 0.15  # what a schedule does: eta halves with alpha
    expected = adaptive_step(0.15, 2, opt.w0_norm, global_norm(list(model.parameters())), 1.0)
    fresh.step(loss=1.0)
    assert fresh.last["eta"] == pytest.approx(expected, rel=1e-9)


def test_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError):
        AdaptiveGD(p, alpha=-1.0)
    with pytest.raises(ValueError):
        AdaptiveGD(p, alpha=1.0, layers=0)


def test_zero_initial_weights_are_refused_with_the_reason():
    """eta_t is proportional to ||W_0||^(2L-2): zero weights at L >= 2 would never move (it was a bare
    'math domain error'). At L = 1 the power is 0 and gradient descent from zero is fine."""
    assert log_adaptive_step(1.0, 3, 0.0, 1.0, 0.5) == -math.inf  # the formula itself: a zero step
    model = torch.nn.Linear(4, 2)
    torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)
    loss = model(torch.ones(3, 4)).sub(1).square().mean()
    loss.backward()
    with pytest.raises(ValueError, match=r"\|\|W_0\|\| = 0 and L = 2: every step would be zero"):
        AdaptiveGD(model.parameters(), layers=2).step(loss=loss)
    assert model.weight.abs().sum() == 0  # nothing was touched
    with pytest.raises(ValueError, match="every step would be zero"):
        AdaptiveGD(model.parameters(), layers=3, w0_norm=0.0)
    opt = AdaptiveGD(model.parameters(), layers=1)
    opt.step(loss=loss)
    assert opt.last["eta"] > 0 and model.weight.abs().sum() > 0


def test_a_step_reads_the_device_once():
    """The loss, ||W_t|| and the gradients' finiteness come to the host together: one read per step, not
    two per parameter (a device sync each on a GPU)."""
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__,
                                   torch.Tensor.__bool__, torch.Tensor.cpu)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = AdaptiveGD(model.parameters(), alpha=0.1, layers=2)
    x = torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        before = global_norm(list(model.parameters()))
        with Reads() as reads:
            opt.step(loss=loss)
        assert reads.count == 1
        assert opt.last["w_norm"] == pytest.approx(before, rel=1e-12) and opt.last["loss"] == loss.item()
