"""Tiny Hugging Face models built from their configs (no downloads), with a batch each takes a loss on."""

from __future__ import annotations

import pytest
import torch

VOCAB, WIDTH = 64, 32
# name -> the tensor that is tied between the embedding and the head (None: untied)
TIED = {
    "gpt2": "transformer.wte.weight", "llama_tied": "model.embed_tokens.weight", "llama": None,
    "bert": "bert.embeddings.word_embeddings.weight", "t5": "shared.weight", "vit": None,
    "mistral": None, "qwen2_tied": "model.embed_tokens.weight",
}
FAMILIES = tuple(TIED)


def transformers_or_skip():
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install moga[hf])",
                               exc_type=ImportError)


def build(name: str, seed: int = 0, layers: int = 2):
    T = transformers_or_skip()
    torch.manual_seed(seed)
    decoder = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, n_embd=WIDTH, n_head=4, vocab_size=VOCAB,
                                              n_positions=32, bos_token_id=0, eos_token_id=0))
    if name in ("llama", "llama_tied"):
        return T.LlamaForCausalLM(T.LlamaConfig(**decoder, tie_word_embeddings=name == "llama_tied"))
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**decoder, tie_word_embeddings=False))
    if name == "qwen2_tied":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**decoder, tie_word_embeddings=True))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=layers,
                                              num_attention_heads=4, intermediate_size=64, max_position_embeddings=32))
    if name == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64,
                                                       num_layers=layers, num_heads=4, decoder_start_token_id=0,
                                                       pad_token_id=0, tie_word_embeddings=True))
    if name == "vit":
        return T.ViTForImageClassification(T.ViTConfig(hidden_size=WIDTH, num_hidden_layers=layers,
                                                       num_attention_heads=4, intermediate_size=64, image_size=16,
                                                       patch_size=4, num_labels=3))
    raise ValueError(name)


def batch(name: str, seed: int = 1) -> dict:
    """Forward keyword arguments, labels included, so that ``model(**batch).loss`` is the training loss."""
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.randint(0, 3, (2,), generator=g)}
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (2, 6), generator=g)}
    return {"input_ids": ids, "labels": ids}
