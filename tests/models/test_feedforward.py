"""The convergence paper's feedforward and shared-weights nets."""

import pytest
import torch
from torch.nn import functional as F

from moga.models import FeedForward, SharedWeightsNet
from moga.roles import build_plan


@pytest.mark.parametrize("act,fn", [("tanh", torch.tanh), ("sigmoid", torch.sigmoid), ("softplus", F.softplus),
                                    ("gelu", F.gelu), ("silu", F.silu)])
def test_feedforward_is_the_papers_formula(act, fn):
    model = FeedForward(6, 8, depth=3, out_features=2, activation=act, seed=0)
    w1, w2, w3 = (layer.weight for layer in model.layers if isinstance(layer, torch.nn.Linear))
    x = torch.randn(4, 6)
    torch.testing.assert_close(model(x), fn(fn(x @ w1.T) @ w2.T) @ w3.T)
    literal = FeedForward(6, 8, depth=3, activation=act, output_activation=act, seed=0)
    torch.testing.assert_close(literal(x), fn(literal.layers[:-1](x)))  # s on every layer, if asked


def test_feedforward_has_no_biases_and_scalar_output():
    model = FeedForward(5, 7, depth=4)
    assert [tuple(p.shape) for p in model.parameters()] == [(7, 5), (7, 7), (7, 7), (1, 7)]
    assert model(torch.randn(3, 5)).shape == (3, 1)
    assert FeedForward(5, 7, depth=1)(torch.randn(3, 5)).shape == (3, 1)
    with pytest.raises(ValueError, match="tanh"):  # only smooth activations, and the message lists them
        FeedForward(5, 7, depth=2, activation="relu")


def test_feedforward_plan():
    roles = build_plan(FeedForward(5, 7, depth=4)).roles()
    assert roles == {"layers.0.weight": "input", "layers.2.weight": "hidden", "layers.4.weight": "hidden",
                     "layers.6.weight": "readout"}


def test_shared_weights_net_is_the_papers_construction():
    d, h = 12, 8
    model = SharedWeightsNet(d, width=h, depth=4, activation="tanh", seed=0)
    w = model.shared.weight
    x = torch.randn(3, d)
    h1 = torch.tanh(x @ w.T)
    h3 = torch.tanh(torch.tanh(h1 @ w[:, :h].T) @ w[:, :h].T)  # two hidden layers: the H x H slice
    torch.testing.assert_close(model(x), h3 @ w[:1, :h].T)  # output: the 1 x H slice


def test_shared_weights_parameter_count_is_fixed_and_every_use_trains_the_one_tensor():
    counts = {sum(p.numel() for p in SharedWeightsNet(12, 8, depth).parameters()) for depth in (2, 3, 8)}
    assert counts == {12 * 8}
    model = SharedWeightsNet(12, width=8, depth=4, activation="tanh")
    x = torch.randn(4, 12)
    model(x).sum().backward()
    # The same net with each use as its own leaf: the shared gradient is the sum of the uses' gradients.
    w = model.shared.weight.detach()
    w_in, w_hidden, w_out = (t.clone().requires_grad_() for t in (w, w[:, :8], w[:1, :8]))
    torch.tanh(torch.tanh(torch.tanh(x @ w_in.T) @ w_hidden.T) @ w_hidden.T).matmul(w_out.T).sum().backward()
    expected = w_in.grad.clone()
    expected[:, :8] += w_hidden.grad
    expected[:1, :8] += w_out.grad
    torch.testing.assert_close(model.shared.weight.grad, expected)


def test_shared_weights_plan_sees_one_tensor():
    model = SharedWeightsNet(12, width=8, depth=6)
    plan = build_plan(model)
    assert len(plan) == 1 and next(iter(plan)).param is model.shared.weight
    assert plan.roles() == {"shared.weight": "readout"}  # its only dense layer; a matrix geometry either way


def test_shared_weights_errors():
    with pytest.raises(ValueError, match="in_features must be >= width"):
        SharedWeightsNet(8, width=12)
    with pytest.raises(ValueError, match="depth"):
        SharedWeightsNet(12, width=8, depth=1)
