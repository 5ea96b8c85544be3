"""Depth scaling on Hugging Face families it was never told about: branches found from the forward,
verified by the probe, and equal to a reference whose branch-ending weights are scaled by hand."""

from __future__ import annotations

import fnmatch

import pytest
import torch

from moga.depth import residual_scales, scale_residual_branches
from moga.depth.probe import example_call
from tests.integrations.hf_families import NEW_FAMILIES, build_family


def _gemma_norm(alpha):  # Gemma's RMSNorm multiplies by (1 + weight)
    return lambda p: p.copy_(alpha * (1 + p) - 1)


# family -> (blocks K, the branch modules found (relative to their block, all blocks together; "a|b": a on
# transformers 5, b on 4.x), the parameters that end each branch (relative to their block; "a|b": either)
# and how to scale them by hand (None: times alpha))
CASES = {
    "phi3": (2, {"self_attn", "mlp"}, {"self_attn.o_proj.*": None, "mlp.down_proj.*": None}),
    "phi": (2, {"self_attn", "mlp"}, {"self_attn.dense.*": None, "mlp.fc2.*": None}),
    # Sandwich norms: the branch ends after the post-norm.
    "gemma2": (2, {"post_attention_layernorm", "post_feedforward_layernorm"},
               {"post_attention_layernorm.weight": _gemma_norm, "post_feedforward_layernorm.weight": _gemma_norm}),
    # The residual is added inside self_attention and mlp: the branches are their last dense layers.
    "bloom": (2, {"self_attention.dense", "mlp.dense_4h_to_h"},
              {"self_attention.dense.*": None, "mlp.dense_4h_to_h.*": None}),
    # Parallel attention and MLP, one add of their sum.
    "falcon": (2, {"self_attention", "mlp"}, {"self_attention.dense.*": None, "mlp.dense_4h_to_h.*": None}),
    "gpt_neox": (2, {"attention", "mlp"}, {"attention.dense.*": None, "mlp.dense_4h_to_h.*": None}),
    "gptj": (2, {"attn", "mlp"}, {"attn.out_proj.*": None, "mlp.fc_out.*": None}),
    "opt": (2, {"self_attn", "fc2"}, {"self_attn.out_proj.*": None, "fc2.*": None}),
    # MoE: every expert's down projection (fused 3-D on transformers 5) and the shared expert.
    "mixtral": (2, {"self_attn", "mlp|block_sparse_moe"},
                {"self_attn.o_proj.*": None, "mlp.experts.down_proj|block_sparse_moe.experts.*.w2.*": None}),
    "qwen2_moe": (2, {"self_attn", "mlp"}, {"self_attn.o_proj.*": None,
                                            "mlp.experts.down_proj|mlp.experts.*.down_proj.*": None,
                                            "mlp.shared_expert.down_proj.*": None}),
    "qwen3_moe": (2, {"self_attn", "mlp"},
                  {"self_attn.o_proj.*": None, "mlp.experts.down_proj|mlp.experts.*.down_proj.*": None}),
    "modernbert": (2, {"attn", "mlp"}, {"attn.Wo.*": None, "mlp.Wo.*": None}),
    # Post-norm: the add sits inside the output modules, before their LayerNorm.
    "deberta_v2": (2, {"attention.output.dense", "output.dense"},
                   {"attention.output.dense.*": None, "output.dense.*": None}),
    # Encoder and decoder blocks together; decoders add cross-attention.
    "whisper": (4, {"self_attn", "encoder_attn", "fc2"},
                {"self_attn.out_proj.*": None, "encoder_attn.out_proj.*": None, "fc2.*": None}),
    # Two towers: text and vision blocks together.
    "clip": (4, {"self_attn", "mlp"}, {"self_attn.out_proj.*": None, "mlp.fc2.*": None}),
    "mamba": (2, {"mixer"}, {"mixer.out_proj.*": None}),
}


def _output(model, args, kwargs) -> torch.Tensor:
    out = model(*args, **kwargs)
    return out.logits_per_image if hasattr(out, "logits_per_image") else out.logits


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_branches_are_found_verified_and_equal_hand_scaling(family):
    depth, relative, hand = CASES[family]
    model, reference = build_family(family).eval(), build_family(family).eval()
    handle = scale_residual_branches(model, k_base=1)  # alpha = 1/K: not 1 at K = 2
    alpha = 1 / depth
    assert handle.depth == depth and handle.alpha == alpha and len(handle.blocks) == depth
    found = {name[len(block) + 1:] for block in handle.blocks for name in handle.branches
             if name.startswith(block + ".")}
    assert found in ({r.split("|")[0] for r in relative}, {r.split("|")[-1] for r in relative})
    assert set(residual_scales(model).values()) == {alpha}
    assert all(0.5 <= r <= 2 for r in handle.measured.values()) and len(handle.measured) == depth

    scaled = set()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            block = next((b for b in handle.blocks if name.startswith(b + ".")), None)
            pattern = next((k for k in hand if block and any(fnmatch.fnmatchcase(name[len(block) + 1:], alt)
                                                            for alt in k.split("|"))), None)
            if pattern is not None:
                (hand[pattern] or (lambda a: lambda t: t.mul_(a)))(alpha)(p)
                scaled.add(pattern)
        assert scaled == set(hand)  # every pattern scaled something
        args, kwargs = example_call(model)
        expected = _output(reference, args, kwargs)
        torch.testing.assert_close(_output(model, args, kwargs), expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(_output(build_family(family).eval(), args, kwargs), expected)  # alpha mattered


@pytest.mark.parametrize("family,wrong,says", [
    # The README's by-analogy names: Bloom adds the residual inside these modules ...
    ("bloom", ["transformer.h.*.self_attention", "transformer.h.*.mlp"],
     r"block transformer\.h\.0: transformer\.h\.0\.\w+ returns the residual stream itself.*"
     r"self_attention\.dense"),
    # ... and Gemma2's post-norms undo a scale on self_attn and mlp.
    ("gemma2", ["model.layers.*.self_attn", "model.layers.*.mlp"],
     r"block model\.layers\.0: a residual add takes the output of post_\w+_layernorm, which is not a linear "
     r"function of the scaled modules"),
    # One branch of two: the other still adds at full size.
    ("gptj", ["transformer.h.*.mlp"], r"block transformer\.h\.0: a residual add takes the output of attn"),
])
def test_wrong_branches_raise_and_change_nothing(family, wrong, says):
    model = build_family(family).eval()
    args, kwargs = example_call(model)
    with torch.no_grad():
        before = _output(model, args, kwargs)
    for alpha in (1e-4, 0.5):
        with pytest.raises(ValueError, match=says):
            scale_residual_branches(model, alpha, branches=wrong)
    assert residual_scales(model) == {}
    with torch.no_grad():
        torch.testing.assert_close(_output(model, args, kwargs), before, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["bloom", "deberta_v2"])
def test_bfloat16_models_are_probed_above_their_rounding(family):
    """Their branches are small next to the stream at init: at alpha 2^-4 bf16 rounding took a third of
    the measured ratio; the probe uses 2^-2 for 16-bit models."""
    model = build_family(family).to(torch.bfloat16)
    handle = scale_residual_branches(model, k_base=1)
    assert handle.probe_alpha == 0.25 and all(0.9 < r < 1.1 for r in handle.measured.values())
    assert set(residual_scales(model).values()) == {0.5}
