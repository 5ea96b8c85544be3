"""Small models and losses with known derivatives for the smoothness tests."""

import math

import torch
from torch import nn
from torch.nn import functional as F

from moga.geometry import parse_geometry
from moga.smoothness import BlockEntry, BlockGeometry


class MixedNet(nn.Module):
    """One parameter in every geometry: a table, a conv kernel, a stack of matrices, linears, gains."""

    def __init__(self, vocab=7, d=5, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.experts = nn.Parameter(torch.randn(2, d, d) / math.sqrt(d))
        self.norm = nn.LayerNorm(d)
        self.hidden = nn.Linear(d, 2 * d)
        self.mix = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + torch.tanh(self.conv(h.transpose(1, 2)).transpose(1, 2))
        h = h + torch.einsum("eoi,bti->bto", self.experts, h) / 2
        h = self.mix(F.gelu(self.hidden(self.norm(h))))
        return self.head(h.mean(1))


# Every row of docs/math.md §2's table on some parameter (biases keep the default adam:vector = l_inf).
MIXED_OVERRIDES = {
    "experts": {"role": "hidden", "layout": "boi", "geometry": "spectral(method=svd)"},
    "conv.weight": {"geometry": "col(q=2)"},
    "hidden.weight": {"geometry": "row(p=1.5)"},
    "mix.weight": {"geometry": "sign"},
    "head.weight": {"geometry": "spectral"},  # Newton-Schulz in the plan; the block makes it exact
}


def mixed_batch(seed=0, batch=6, length=4, vocab=7, classes=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen), torch.randint(0, classes, (batch,), generator=gen)


def classification_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


class Quadratic(nn.Module):
    """``f(W) = 0.5 w^T A w`` with ``w`` all parameters flattened and concatenated: H = A everywhere."""

    def __init__(self, shapes, matrix):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in shapes)
        self.register_buffer("matrix", matrix)

    def forward(self):
        w = torch.cat([p.reshape(-1) for p in self.weights])
        return 0.5 * w @ self.matrix @ w


def quadratic_loss(model, batch):
    return model()


def block_of(params, specs, layouts):
    return BlockGeometry([BlockEntry(f"w{k}", p, parse_geometry(s), lay)
                          for k, (p, s, lay) in enumerate(zip(params, specs, layouts))])
