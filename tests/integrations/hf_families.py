"""More tiny Hugging Face models from their configs (no downloads): one per architecture shape that
depth scaling must handle (pre-, post- and sandwich norms, parallel blocks, residuals added inside a
module, MoE, encoder-decoders, two towers, state-space blocks)."""

from __future__ import annotations

import torch

from tests.integrations.hf_zoo import VOCAB, WIDTH, transformers_or_skip

HEADS, FFN = 4, 64


def _decoder(layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=layers,
                num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32)


def _moe(layers: int) -> dict:
    return dict(_decoder(layers), num_experts_per_tok=2, moe_intermediate_size=FFN)


BUILDERS = {
    "phi3": lambda T, n: T.Phi3ForCausalLM(T.Phi3Config(**_decoder(n), pad_token_id=0)),
    "phi": lambda T, n: T.PhiForCausalLM(T.PhiConfig(**_decoder(n))),
    "gemma2": lambda T, n: T.Gemma2ForCausalLM(T.Gemma2Config(**_decoder(n), head_dim=8)),
    "bloom": lambda T, n: T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=n,
                                                           n_head=HEADS)),
    "falcon": lambda T, n: T.FalconForCausalLM(T.FalconConfig(vocab_size=VOCAB, hidden_size=WIDTH,
                                                              num_hidden_layers=n, num_attention_heads=HEADS)),
    "gpt_neox": lambda T, n: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_decoder(n))),
    "gptj": lambda T, n: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=VOCAB, n_embd=WIDTH, n_layer=n, n_head=HEADS,
                                                        rotary_dim=4, n_positions=32)),
    "opt": lambda T, n: T.OPTForCausalLM(T.OPTConfig(vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=FFN,
                                                     num_hidden_layers=n, num_attention_heads=HEADS,
                                                     max_position_embeddings=32, word_embed_proj_dim=WIDTH)),
    "mixtral": lambda T, n: T.MixtralForCausalLM(T.MixtralConfig(**_decoder(n), num_local_experts=4,
                                                                 num_experts_per_tok=2)),
    "qwen2_moe": lambda T, n: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**_moe(n), num_experts=4,
                                                                     shared_expert_intermediate_size=FFN)),
    "qwen3_moe": lambda T, n: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**_moe(n), num_experts=4, head_dim=8)),
    "modernbert": lambda T, n: T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=n, num_attention_heads=HEADS,
        max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    "deberta_v2": lambda T, n: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=n, num_attention_heads=HEADS,
        max_position_embeddings=32, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])),
    "whisper": lambda T, n: T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=n, decoder_layers=n, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, num_mel_bins=8,
        max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)),
    "clip": lambda T, n: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=n,
                         num_attention_heads=HEADS, max_position_embeddings=16),
        vision_config=dict(hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=n, num_attention_heads=HEADS,
                           image_size=16, patch_size=8), projection_dim=16)),
    "mamba": lambda T, n: T.MambaForCausalLM(T.MambaConfig(vocab_size=VOCAB, hidden_size=WIDTH, state_size=4,
                                                           num_hidden_layers=n, expand=2, conv_kernel=2)),
}
NEW_FAMILIES = tuple(BUILDERS)


def build_family(name: str, seed: int = 0, layers: int = 2):
    T = transformers_or_skip()
    torch.manual_seed(seed)
    return BUILDERS[name](T, layers)
