"""An unmodified Hugging Face ``LlamaForCausalLM``, built from a config, as a moga language model.

``model.name: moga.integrations.llama:llama`` in a training or sweep config (the ``[hf]`` extra). It takes the
built-in GPT's size keys, so one sweep can put both models on one axis: ``n_embd`` is the hidden size, the MLP
is ``4 x n_embd`` wide, ``n_head`` defaults to ``n_embd / 32`` (heads of 32), and the head is untied.
The wrapper only adapts the call: ``forward(x, targets=None)`` returns the logits, and moga's text task takes
the cross entropy. The role plan sees the transformers modules themselves (``embed_tokens``, the decoder
layers, ``lm_head``, the RMSNorm gains).

``model.name: moga.integrations.llama:hf_causal_lm`` builds any LLaMA-style Hugging Face config (``model.config``,
a dict: LLaMA, Mistral, Qwen2, ...) at another ``width`` and ``depth`` (:func:`scale_hf_config`), as ``moga tune``
does for its proxies and its target.
"""

from __future__ import annotations

import torch
from torch import nn

# Deferred on purpose, imported where used: transformers (the optional `hf` extra, seconds to import).


class LlamaLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaForCausalLM

        self.model = (LlamaForCausalLM(config) if config.model_type == "llama"
                      else AutoModelForCausalLM.from_config(config))

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


# The knobs a LLaMA-style config scales by; intermediate sizes keep their ratio to the hidden size.
HF_KNOBS = ("hidden_size", "num_hidden_layers", "num_attention_heads")
HF_RATIO_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
HF_DROPPED = ("torch_dtype", "dtype", "architectures", "transformers_version", "_name_or_path")


class HFScaleError(ValueError):
    """A Hugging Face config that moga cannot scale to another width or depth."""


def hf_head_dim(config: dict) -> tuple[int, int]:
    """(head dimension, query heads per key-value head) of a LLaMA-style config; raises HFScaleError."""
    missing = [k for k in HF_KNOBS if not isinstance(config.get(k), int)]
    if missing:
        raise HFScaleError(f"cannot scale this Hugging Face config (model_type {config.get('model_type', '?')!r}): "
                           f"it has no {', '.join(missing)}; moga scales LLaMA-style configs (hidden_size, "
                           "intermediate_size, num_attention_heads, num_key_value_heads, num_hidden_layers)")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None or heads % kv:
        raise HFScaleError(f"cannot scale this Hugging Face config: hidden_size {hidden}, {heads} attention heads "
                           f"and {kv} key-value heads give no whole head dimension and query groups")
    return int(head_dim), heads // kv


def scale_hf_config(config: dict, width: int, depth: int) -> dict:
    """``config`` at hidden size ``width`` and ``depth`` layers: the head dimension and the query heads per
    key-value head stay, so the heads follow the width; intermediate sizes keep their ratio to the hidden size;
    a per-layer list (``layer_types``) of one kind is resized. Raises HFScaleError for what cannot be scaled."""
    c = {k: v for k, v in dict(config).items() if k not in HF_DROPPED}
    head_dim, group = hf_head_dim(c)
    if width % (head_dim * group) or depth < 1:
        raise HFScaleError(f"width {width} is not a multiple of head_dim x query groups = {head_dim} x {group} "
                           f"(or depth {depth} < 1): the heads could not keep their size")
    for key, value in c.items():
        if isinstance(value, list) and len(value) == c["num_hidden_layers"] and key != "architectures":
            if len({repr(v) for v in value}) > 1:
                raise HFScaleError(f"cannot scale this Hugging Face config: its per-layer {key} mixes kinds "
                                   f"({sorted({repr(v) for v in value})}), so another depth has no one answer")
            c[key] = value[:1] * depth
    hidden = c["hidden_size"]
    for key in HF_RATIO_KEYS:
        if isinstance(c.get(key), int):
            c[key] = max(1, round(c[key] * width / hidden))
    heads = width // head_dim
    c.update(hidden_size=width, num_hidden_layers=depth, num_attention_heads=heads,
             num_key_value_heads=heads // group)
    if "head_dim" in c:
        c["head_dim"] = head_dim
    return c


def hf_causal_lm(vocab_size: int, block_size: int, config: dict, width: int | None = None,
                 depth: int | None = None, attention: str = "sdpa") -> LlamaLM:
    """A causal LM from a LLaMA-style Hugging Face ``config`` (a dict) at ``width`` and ``depth`` (default: the
    config's own), with the data's vocabulary and context; token ids outside that vocabulary are dropped."""
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ImportError("moga.integrations.llama needs transformers: pip install 'moga[hf]'") from e
    c = scale_hf_config(config, width or config["hidden_size"], depth or config["num_hidden_layers"])
    c.update(vocab_size=vocab_size, max_position_embeddings=block_size)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(c.get(key), int) and c[key] >= vocab_size:
            c[key] = None
    model_type = c.pop("model_type", "llama")
    return LlamaLM(AutoConfig.for_model(model_type, attn_implementation=attention, **c))
