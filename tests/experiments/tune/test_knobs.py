"""The knobs moga tune scales: a Hugging Face config keeps its head dimension and ratios; bad models get one line."""

import pytest

from moga.experiments.tune.knobs import TuneError, model_section, resolve_knobs, target_size
from moga.integrations.llama import scale_hf_config

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 32000, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("width,depth", [(64, 2), (128, 4), (1024, 32)])
def test_hf_config_keeps_head_dim_groups_and_mlp_ratio(width, depth):
    c = scale_hf_config(LLAMA, width, depth)
    assert c["hidden_size"] == width and c["num_hidden_layers"] == depth
    assert c["hidden_size"] // c["num_attention_heads"] == 32  # head_dim kept
    assert c["num_attention_heads"] // c["num_key_value_heads"] == 2  # query heads per kv head kept
    assert abs(c["intermediate_size"] / width - 688 / 256) <= 0.5 / width  # the ratio, up to rounding
    assert c["rms_norm_eps"] == 1e-6 and LLAMA["hidden_size"] == 256  # the rest kept, the input untouched


def test_hf_config_builds_at_the_scaled_size():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from moga.integrations.llama import hf_causal_lm
    hf = LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})  # a PretrainedConfig works too
    section = model_section({"name": "gpt"}, hf)
    assert resolve_knobs(section).multiple == 64  # head_dim 32 x 2 query groups
    model = hf_causal_lm(65, 16, section["config"], width=128, depth=2).model
    attn = model.model.layers[0].self_attn
    assert len(model.model.layers) == 2 and attn.head_dim == 32
    assert attn.k_proj.out_features == 64 and attn.q_proj.out_features == 128  # 4 heads, 2 kv heads
    assert model.model.layers[0].mlp.up_proj.out_features == round(688 * 128 / 256)


def test_gpt_heads_follow_the_width():
    knobs = resolve_knobs({"name": "gpt", "n_embd": 128, "n_head": 4})
    assert knobs.keys(64, 2) == {"n_embd": 64, "n_layer": 2, "n_head": 2}


@pytest.mark.parametrize("section,model,message", [
    ({"name": "resnet"}, None, "model 'resnet' has no width and depth knobs"),
    ({"name": "gpt"}, {"model_type": "gpt2", "n_embd": 768, "n_layer": 12}, "cannot scale this Hugging Face config"),
    ({"name": "gpt"}, {**LLAMA, "num_key_value_heads": 3}, "cannot scale this Hugging Face config"),
    ({"name": "gpt"}, {**LLAMA, "layer_types": ["full"] * 4 + ["sliding"] * 4}, "mixes kinds"),
])
def test_a_model_moga_cannot_scale_gets_one_line(section, model, message):
    with pytest.raises(TuneError, match=message) as e:
        s = model_section(section, model)
        target_size(s, resolve_knobs(s), 512, 4)
    assert "\n" not in str(e.value)
