"""A nanoGPT-style pre-LN decoder, with the depth paper's residual scaling and a LLaMA-style option.

Each block is ``x = x + alpha * attn(norm(x)); x = x + alpha * mlp(norm(x))``: both sub-blocks are
branches, and K = ``n_layer`` blocks, so ``alpha = residual_alpha(n_layer)`` (see ``moga.depth`` for why
blocks and not sub-blocks). Options:

- ``attention="sdpa"``: PyTorch's fused kernel; ``"math"``: :func:`causal_attention` in plain ops, which
  has a double backward (Hessian-vector products); the fused kernels have none (pytorch/pytorch#116350).
- ``logit_scale="sqrt"``: logits ``q.k / sqrt(d_head)``; ``"linear"``: ``q.k / d_head``, which keeps them
  O(1) under the width paper's row-normalized geometries (depth paper, appendix B.2).
- ``style="gpt2"``: LayerNorm, GELU MLP, learned positions, biases; ``"llama"``: RMSNorm, SwiGLU MLP,
  rotary positions, no biases. The rest of the model is the same.
- ``tie_weights``: head and token table share one tensor (off by default). The role plan then needs
  ``overrides=model.plan_overrides()`` (``{"lm_head.weight": "tied"}``), since the two uses disagree on
  orientation; ``moga.models.plan_for(model)`` passes it.

Init is nanoGPT's: every matrix and table ``N(0, init_std^2)``, biases 0, norm gains 1;
``depth_scaled_init`` adds GPT-2's ``1/sqrt(2 n_layer)`` on output projections (off by default: alpha
already handles depth). Paper scale: ``GPTConfig(n_embd=256, n_head=4, n_layer=2..128)`` with the GPT-2
vocabulary and context; CPU scale: ``n_embd`` 32-128, a character vocabulary, ``block_size`` 64-256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from moga.depth import residual_scales, scale_residual_branches
from moga.models.common import check_positive_int, seeded

ATTENTIONS = ("sdpa", "math")
LOGIT_SCALES = ("sqrt", "linear")
STYLES = ("gpt2", "llama")


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # GPT-2's BPE; a character vocabulary for CPU runs
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool | None = None  # None: the style's default (gpt2 True, llama False)
    tie_weights: bool = False
    attention: str = "sdpa"
    logit_scale: str = "sqrt"
    style: str = "gpt2"
    alpha: float = 1.0  # the initial residual scale; moga.depth can change it later (see GPT.alpha)
    init_std: float = 0.02
    depth_scaled_init: bool = False
    rope_base: float = 10000.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_positive_int(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                           n_head=self.n_head, n_embd=self.n_embd)
        for name, allowed in (("attention", ATTENTIONS), ("logit_scale", LOGIT_SCALES), ("style", STYLES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.style == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings rotate pairs of channels: the head size must be even, "
                             f"got {self.head_dim}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def has_bias(self) -> bool:
        return self.style == "gpt2" if self.bias is None else self.bias

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def causal_attention(q, k, v, scale: float, dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """``softmax(q k^T * scale + causal mask) v`` in plain ops: the reference path, twice differentiable."""
    t = q.size(-2)
    logits = (q @ k.transpose(-2, -1)) * scale
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return F.dropout(weights, dropout, training) @ v


def rotary_tables(head_dim: int, length: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * base^(-2i/head_dim)``, each (length, head_dim/2) (RoFormer, Su et al. 2021)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of ``x`` (..., T, d) by position-dependent angles."""
    t = x.size(-2)
    cos, sin = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.has_bias)  # q, k, v stacked
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.has_bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout, self.attention = config.n_head, config.dropout, config.attention
        d = config.head_dim
        self.scale = 1.0 / d if config.logit_scale == "linear" else 1.0 / math.sqrt(d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        dropout = self.dropout if self.training else 0.0
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale)
        else:
            y = causal_attention(q, k, v, self.scale, dropout, self.training)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    """GPT-2's: ``c_proj(gelu(c_fc x))``, hidden size 4 n_embd."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.has_bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.has_bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """LLaMA's: ``c_proj(silu(gate x) * (up x))``; hidden size 2/3 of 4 n_embd (rounded up to a multiple
    of 8) keeps the parameter count of the GELU MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = 8 * math.ceil(8 * config.n_embd / 3 / 8)
        self.gate = nn.Linear(config.n_embd, hidden, bias=config.has_bias)
        self.up = nn.Linear(config.n_embd, hidden, bias=config.has_bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.has_bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.silu(self.gate(x)) * self.up(x)))


def _layer_norm(config: GPTConfig) -> nn.Module:
    if config.style == "llama":
        return nn.RMSNorm(config.n_embd, eps=1e-6)
    return nn.LayerNorm(config.n_embd, bias=config.has_bias)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = _layer_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _layer_norm(config)
        self.mlp = SwiGLU(config) if config.style == "llama" else MLP(config)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        # Both branch outputs carry alpha (their residual_scale, moga.depth).
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))

    def residual_branches(self) -> list[nn.Module]:
        return [self.attn, self.mlp]


class GPT(nn.Module):
    """``GPT(GPTConfig(...))`` or ``GPT(n_layer=4, n_embd=64, ...)``."""

    def __init__(self, config: GPTConfig | None = None, **overrides):
        super().__init__()
        if config is None:
            config = GPTConfig(**overrides)
        elif overrides:
            config = replace(config, **overrides)
        self.config = config
        self.depth = config.n_layer  # K counts blocks
        with seeded(config.seed):
            # Direct attributes, not nanoGPT's ModuleDict: the role plan then reads the head as the readout.
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.style == "gpt2" else None
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = _layer_norm(config)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            if config.tie_weights:
                self.lm_head.weight = self.wte.weight
            self._init_weights()
        if config.style == "llama":  # not persistent: recomputed from the config, never trained
            cos, sin = rotary_tables(config.head_dim, config.block_size, config.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        scale_residual_branches(self, config.alpha, verify=False)  # declared branches, checked in tests

    def _init_weights(self) -> None:
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                proj = name.endswith("c_proj") and self.config.depth_scaled_init
                nn.init.normal_(module.weight, 0.0, std / math.sqrt(2 * self.config.n_layer) if proj else std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def alpha(self) -> float:
        return next(iter(residual_scales(self).values()), 1.0)

    def plan_overrides(self) -> dict[str, str]:
        """What ``moga.roles.build_plan`` needs besides the model: the tied tensor's role, if tied."""
        return {"lm_head.weight": "tied"} if self.config.tie_weights else {}

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last block (before the final norm), (batch, T, n_embd)."""
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        x = self.drop(x)
        rope = (self.rope_cos, self.rope_sin) if self.config.style == "llama" else None
        for block in self.blocks:
            x = block(x, rope)
        return x

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``(logits, loss)`` as in nanoGPT; logits for every position, loss None without targets."""
        logits = self.lm_head(self.ln_f(self.features(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss
