"""muP's Adam written out by hand (the reference ScaledAdamW is checked against) and a tiny language model."""

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=20, width=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, 2 * width)
        self.out_proj = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.out_proj(torch.tanh(self.hidden(h)))
        return self.head(self.norm(h))


def mup_adam_groups(model, lr, wd):
    """muP's Adam rule (Tensor Programs V, Table 3), written out directly: hidden and output weights
    take lr/fan_in; embeddings, biases and gains take lr. Decay is rescaled so lr*wd is the same, and
    skips biases and gains."""
    groups = []
    for name, p in model.named_parameters():
        if p.ndim == 2 and not name.startswith("embed"):
            scale = 1 / p.shape[1]
        else:
            scale = 1.0
        decay = 0.0 if p.ndim < 2 else wd / scale  # biases and gains are not decayed
        groups.append({"params": [p], "lr": lr * scale, "weight_decay": decay})
    return groups
