"""The convergence paper's networks: ``f(x) = s(w_L s(... s(w_1 x)))``, no biases, smooth activations.

``depth`` is L, the number of weight matrices (the paper's L-layer net, whose smoothness polynomial has
degree 2L - 2; docs/math.md §6.1). The last activation ``s_L`` defaults to the
identity (the paper allows a linear ``s_L``; its CIFAR-10 runs feed logits to cross-entropy); pass
``output_activation=activation`` for the formula with ``s`` on every layer. Outputs are ``(batch,
out_features)``; images are flattened. Layers keep PyTorch's default init.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moga.models.common import SMOOTH_ACTIVATIONS, activation, check_positive_int, seeded


class FeedForward(nn.Module):
    def __init__(
        self,
        in_features: int,
        width: int,
        depth: int,
        out_features: int = 1,
        activation: str = "gelu",
        output_activation: str = "identity",
        seed: int | None = None,
    ):
        super().__init__()
        check_positive_int(in_features=in_features, width=width, depth=depth, out_features=out_features)
        self.depth = depth
        sizes = [in_features] + [width] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        with seeded(seed):
            for k in range(depth):
                layers.append(nn.Linear(sizes[k], sizes[k + 1], bias=False))
                layers.append(_smooth(activation if k < depth - 1 else output_activation))
        # A plain Sequential: the role plan reads its first Linear as the input, its last as the readout.
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1))


class SharedWeightsNet(nn.Module):
    """The convergence paper's shared-weights net: one ``H x d`` tensor, any depth (its section 5).

    For input ``x`` in R^d and ``W`` the ``H x d`` input weights (``shared.weight``):

    - layer 1:            ``h_1 = s(W x)``
    - layers 2 .. L-1:    ``h_l = s(W[:, :H] h_{l-1})``  (the leading ``H x H`` block of ``W``)
    - layer L (output):   ``f = s_L(W[:out_features, :H] h_{L-1})``  (its first row(s): the ``1 x H`` slice)

    The paper says only "a fixed 512 x 512 subset" and "a 1 x 512 subset"; we take the leading entries,
    so ``d >= H`` is required. The parameter count is ``H * d`` at every depth, and the role plan sees the
    one tensor (its only dense layer, so the rules call it the readout).
    """

    def __init__(
        self,
        in_features: int,
        width: int = 512,
        depth: int = 3,
        activation: str = "gelu",
        output_activation: str = "identity",
        out_features: int = 1,
        seed: int | None = None,
    ):
        super().__init__()
        check_positive_int(in_features=in_features, width=width, out_features=out_features)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"depth (L, counting the input and output layers) must be an integer >= 2, got {depth!r}")
        if in_features < width:
            raise ValueError(f"the hidden layers are the slice W[:, :width] of the width x in_features input "
                             f"weights, so in_features must be >= width; got {in_features} < {width}")
        if out_features > width:
            raise ValueError("the output is the slice W[:out_features, :width], so out_features must be <= width")
        self.depth, self.width, self.out_features = depth, width, out_features
        with seeded(seed):
            self.shared = nn.Linear(in_features, width, bias=False)
        self.act = _smooth(activation)
        self.output_act = _smooth(output_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.shared.weight
        h = self.act(self.shared(x.flatten(1)))
        hidden = w[:, : self.width]
        for _ in range(self.depth - 2):
            h = self.act(F.linear(h, hidden))
        return self.output_act(F.linear(h, w[: self.out_features, : self.width]))


def _smooth(name: str) -> nn.Module:
    return activation(name, SMOOTH_ACTIVATIONS)
