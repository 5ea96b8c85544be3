"""An unmodified Hugging Face ``LlamaForCausalLM``, built from a config, as a moga language model.

``model.name: moga.integrations.llama:llama`` in a training or sweep config (the ``[hf]`` extra). It takes the
built-in GPT's size keys, so one sweep can put both models on one axis: ``n_embd`` is the hidden size, the MLP
is ``4 x n_embd`` wide, ``n_head`` defaults to ``n_embd / 32`` (heads of 32), and the head is untied.
The wrapper only adapts the call: ``forward(x, targets=None)`` returns the logits, and moga's text task takes
the cross entropy. The role plan sees the transformers modules themselves (``embed_tokens``, the decoder
layers, ``lm_head``, the RMSNorm gains).
"""

from __future__ import annotations

import torch
from torch import nn

# Deferred on purpose, imported where used: transformers (the optional `hf` extra, seconds to import).


class LlamaLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM(config)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=x, use_cache=False).logits


def llama(vocab_size: int, block_size: int, n_layer: int = 2, n_embd: int = 64, n_head: int | None = None,
          head_dim: int = 32, mlp_ratio: int = 4, attention: str = "sdpa") -> LlamaLM:
    """A LLaMA of ``n_layer`` decoder layers at width ``n_embd`` (``n_head`` heads, default ``n_embd / head_dim``)."""
    try:
        from transformers import LlamaConfig
    except ImportError as e:
        raise ImportError("moga.integrations.llama needs transformers: pip install 'moga[hf]'") from e
    heads = n_head if n_head is not None else max(1, n_embd // head_dim)
    if n_embd % heads:
        raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={heads}")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=mlp_ratio * n_embd,
                         num_hidden_layers=n_layer, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=block_size, tie_word_embeddings=False,
                         attn_implementation=attention)
    return LlamaLM(config)
