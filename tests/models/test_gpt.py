"""The nanoGPT-style decoder: shapes, attention paths, double backward, depth stability, LLaMA style, plans."""

import math

import pytest
import torch

from moga.models import GPT, GPTConfig, plan_for
from moga.models.gpt import apply_rotary, causal_attention, rotary_tables
from moga.roles import build_plan

from .stability import block_grad_norms, check_depth_stability, rms

TINY = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=48, block_size=16, seed=0)


def tokens(batch=3, length=16, vocab=48, seed=0):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_shapes_and_initial_loss(style):
    model = GPT(**TINY, style=style)
    idx = tokens()
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 48) and model(idx)[1] is None
    # nanoGPT's N(0, 0.02) init gives near-uniform predictions: the loss starts at log(vocab).
    assert abs(loss.item() - math.log(48)) < 0.05
    with pytest.raises(ValueError, match="block_size"):
        model(tokens(length=17))


def test_config_object_or_keywords():
    config = GPTConfig(**TINY)
    assert GPT(config).config == GPT(**TINY).config
    assert GPT(config, n_layer=3).depth == 3 and config.n_layer == 2
    for bad in (dict(n_head=5), dict(attention="flash"), dict(logit_scale="cube"), dict(style="bert"),
                dict(n_layer=0), dict(style="llama", n_embd=36, n_head=4)):
        with pytest.raises(ValueError):
            GPTConfig(**{**TINY, **bad})


def test_llama_style_is_an_option_of_the_same_model():
    gpt2, llama = GPT(**TINY), GPT(**TINY, style="llama")
    assert type(gpt2.blocks[0]) is type(llama.blocks[0])
    assert llama.wpe is None and gpt2.wpe is not None  # rotary positions instead of a learned table
    assert isinstance(llama.blocks[0].ln_1, torch.nn.RMSNorm) and isinstance(gpt2.blocks[0].ln_1, torch.nn.LayerNorm)
    assert not any(name.endswith("bias") for name, _ in llama.named_parameters())
    switched = GPT(GPTConfig(**TINY), style="llama")  # the style's bias default follows the style
    assert not any(name.endswith("bias") for name, _ in switched.named_parameters())
    assert {"gate", "up", "c_proj"} <= {n for n, _ in llama.blocks[0].mlp.named_children()}
    assert "rope_cos" not in llama.state_dict()  # recomputed from the config, never saved


def test_rotary_logits_depend_only_on_relative_position():
    cos, sin = rotary_tables(8, 12)
    q, k = torch.randn(8), torch.randn(8)
    rq, rk = apply_rotary(q.expand(12, 8), cos, sin), apply_rotary(k.expand(12, 8), cos, sin)
    logits = rq @ rk.T
    torch.testing.assert_close(logits[1:, 1:], logits[:-1, :-1])  # constant along diagonals: m - n only
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(12))  # a rotation keeps norms


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("logit_scale", ["sqrt", "linear"])
def test_math_attention_equals_sdpa(style, logit_scale):
    idx = tokens()
    sdpa = GPT(**TINY, style=style, logit_scale=logit_scale, attention="sdpa")
    math_path = GPT(**TINY, style=style, logit_scale=logit_scale, attention="math")
    torch.testing.assert_close(sdpa(idx)[0], math_path(idx)[0], atol=1e-5, rtol=1e-4)


def test_attention_is_causal_and_logit_scale_is_selectable():
    q, k, v = torch.randn(3, 1, 2, 6, 8).unbind(0)
    out = causal_attention(q, k, v, scale=1 / 8)
    k2, v2 = k.clone(), v.clone()
    k2[..., 4:, :] += 1.0  # change the future: earlier positions must not see it
    v2[..., 4:, :] -= 1.0
    torch.testing.assert_close(causal_attention(q, k2, v2, scale=1 / 8)[..., :4, :], out[..., :4, :])
    head = 32 // 4
    assert GPT(**TINY, logit_scale="linear").blocks[0].attn.scale == 1 / head
    assert GPT(**TINY).blocks[0].attn.scale == 1 / math.sqrt(head)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_double_backward_through_math_attention(style):
    """Hessian-vector products on the math path equal central differences of the gradient."""
    model = GPT(**TINY, style=style, attention="math", logit_scale="linear").double()
    idx = tokens(batch=2, length=8)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    direction = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]

    def grad(create_graph=False):
        return torch.autograd.grad(model(idx, idx)[1], params, create_graph=create_graph)

    g = grad(create_graph=True)
    hvp = torch.autograd.grad(sum((gi * d).sum() for gi, d in zip(g, direction)), params)
    eps = 1e-6  # the difference's error is O(eps^2): about 1e-8 relative here
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.add_(eps * d)
    g_plus = grad()
    with torch.no_grad():
        for p, d in zip(params, direction):
            p.sub_(2 * eps * d)
    g_minus = grad()
    fd = torch.cat([((a - b) / (2 * eps)).flatten() for a, b in zip(g_plus, g_minus)])
    exact = torch.cat([h.flatten() for h in hvp])
    assert exact.norm() > 0
    assert (exact - fd).norm() / exact.norm() < 1e-6


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_forward_stability_and_gradient_scaling_across_depth(style):
    idx = tokens(batch=4, length=16, vocab=32)

    def measure(depth, alpha):
        model = GPT(n_layer=depth, n_embd=32, n_head=4, vocab_size=32, block_size=16, alpha=alpha, style=style, seed=0)
        model(idx, idx)[1].backward()
        with torch.no_grad():
            h = model.features(idx)
        return rms(h), block_grad_norms(model.blocks).mean().item()

    check_depth_stability(measure)


def test_alpha_scales_both_sublayers():
    """alpha on attention and MLP equals the unscaled model with both c_proj layers multiplied by alpha."""
    scaled = GPT(**TINY, alpha=0.5)
    reference = GPT(**TINY)
    with torch.no_grad():
        for block in reference.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.mul_(0.5)
                proj.bias.mul_(0.5)
    idx = tokens()
    assert scaled.alpha == 0.5 and reference.alpha == 1.0
    torch.testing.assert_close(scaled(idx)[0], reference(idx)[0])


def test_untied_head_by_default_and_its_plan():
    model = GPT(**TINY)
    assert model.lm_head.weight is not model.wte.weight and model.plan_overrides() == {}
    roles = build_plan(model).roles()
    assert roles["wte.weight"] == "embedding" and roles["wpe.weight"] == "embedding"
    assert roles["lm_head.weight"] == "readout"
    matrices = [n for n in roles if n.startswith("blocks.") and n.endswith("weight") and ".ln_" not in n]
    assert {roles[n] for n in matrices} == {"hidden"}
    assert {r for n, r in roles.items() if ".ln_" in n or "ln_f" in n or n.endswith("bias")} == {"vector"}


def test_tied_head_is_one_tensor_with_the_tied_role():
    model = GPT(**TINY, tie_weights=True)
    assert model.lm_head.weight is model.wte.weight
    assert build_plan(model)["lm_head.weight"].role == "tied"  # by default, as for Hugging Face's GPT-2
    plan = plan_for(model)
    tied = plan["lm_head.weight"]
    assert tied.role == "tied" and tied.param is model.wte.weight
    assert {tied.name, *tied.aliases} == {"wte.weight", "lm_head.weight"}
    assert sum(e.param is model.wte.weight for e in plan) == 1
    assert build_plan(model, overrides=model.plan_overrides()).roles() == plan.roles()


def test_llama_plan_needs_no_overrides():
    roles = build_plan(GPT(**TINY, style="llama")).roles()
    assert roles["wte.weight"] == "embedding" and roles["lm_head.weight"] == "readout"
    assert roles["blocks.0.mlp.gate.weight"] == "hidden" and roles["blocks.1.ln_2.weight"] == "vector"
