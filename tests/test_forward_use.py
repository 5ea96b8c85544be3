"""How the forward uses a parameter, followed through its views to the op that consumes it."""

import torch
from torch import nn
from torch.nn import functional as F

from moga.forward_use import agreed_use, observe_uses


class Uses(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Parameter(torch.randn(6, 4))  # F.linear: (out, in)
        self.right = nn.Parameter(torch.randn(4, 6))  # x @ W: (in, out)
        self.left_t = nn.Parameter(torch.randn(4, 6))  # F.linear(x, W.T): (in, out)
        self.stack = nn.Parameter(torch.randn(3, 4, 6))  # x @ W[k] for each k: batch, in, out
        self.heads = nn.Parameter(torch.randn(3, 6, 4))  # einsum per head: batch, out, in
        self.bias = nn.Parameter(torch.randn(3, 6))  # baddbmm's added term
        self.gate = nn.Parameter(torch.randn(2, 6))  # a cast, a scale, then broadcast: elementwise
        self.reshaped = nn.Parameter(torch.randn(6, 4))  # reshaped: not followed
        self.unused = nn.Parameter(torch.randn(2, 2))

    def forward(self, x):  # x: (n, 4)
        a = F.linear(x, self.linear) + x @ self.right + F.linear(x, self.left_t.T)
        b = sum(x @ self.stack[k] for k in range(3))
        c = torch.einsum("hni,hoi->hno", [x.expand(3, -1, -1), self.heads])  # operands as a list
        d = torch.baddbmm(self.bias[:, None, :], x.expand(3, -1, -1), self.stack)
        e = a[:, None, :] * (2 * self.gate.float()).sigmoid()
        f = x @ self.reshaped.reshape(4, 6)
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum()


def test_each_use_is_read_from_the_op_that_consumes_the_tensor():
    model = Uses()
    uses = observe_uses(model, list(model.parameters()), torch.randn(5, 4))
    got = {n: uses[id(p)] for n, p in model.named_parameters()}
    assert got["linear"] == {"oi"} and got["right"] == {"io"} and got["left_t"] == {"io"}
    assert got["stack"] == {"bio"}  # indexed and batched alike
    assert got["heads"] == {"boi"} and got["bias"] == {"vector"} and got["gate"] == {"vector"}
    assert got["reshaped"] == {"unknown: reshape"} and got["unused"] == set()
    assert agreed_use(got["stack"]) == "bio" and agreed_use(got["reshaped"]) is None and agreed_use(set()) is None
    assert agreed_use({"oi", "io"}) is None  # two orientations: no single answer


def test_a_forward_that_fails_is_reported_not_guessed_and_state_is_kept():
    model = nn.Sequential(nn.BatchNorm1d(4), Uses())
    model.train()
    before = model[0].running_mean.clone()
    said = observe_uses(model, [model[1].stack], torch.randn(5, 3))  # the wrong width
    assert isinstance(said, str) and said.startswith("the forward on the example inputs failed (RuntimeError")
    observe_uses(model, [model[1].stack], torch.randn(5, 4))
    torch.testing.assert_close(model[0].running_mean, before)  # run in eval mode: no statistics moved
    assert model.training and model[0].training


def test_uses_do_not_depend_on_the_batch():
    model = Uses()
    first = observe_uses(model, [model.stack, model.bias], torch.randn(2, 4))
    assert first == observe_uses(model, [model.stack, model.bias], torch.randn(7, 4))
