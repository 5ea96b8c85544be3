"""build_model by name, seeded init for every model, and every model's role plan."""

import pytest
import torch

from moga.models import MODELS, build_model, plan_for

TINY = {
    "residual_mlp": dict(in_features=12, out_features=3, width=8, depth=2),
    "gpt": dict(n_layer=2, n_embd=16, n_head=2, vocab_size=20, block_size=8),
    "resnet": dict(stages=(1, 1), base_channels=4),
    "feedforward": dict(in_features=12, width=8, depth=3),
    "shared_weights": dict(in_features=12, width=8, depth=3),
}
GPT_VARIANTS = {"gpt_tied": dict(TINY["gpt"], tie_weights=True), "gpt_llama": dict(TINY["gpt"], style="llama")}


def test_registry_names_and_error():
    assert set(MODELS) == set(TINY)
    with pytest.raises(ValueError, match="residual_mlp, gpt, resnet, feedforward, shared_weights"):
        build_model("transformer")


@pytest.mark.parametrize("name", list(TINY))
def test_same_seed_same_init_and_global_rng_untouched(name):
    state = torch.random.get_rng_state()
    a = build_model(name, **TINY[name], seed=7).state_dict()
    b = build_model(name, **TINY[name], seed=7).state_dict()
    c = build_model(name, **TINY[name], seed=8).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    weights = [k for k, v in a.items() if torch.is_tensor(v) and v.ndim >= 2]
    assert weights and all(torch.equal(a[k], b[k]) for k in weights)
    assert not any(torch.equal(a[k], c[k]) for k in weights)


@pytest.mark.parametrize("name", list(TINY) + list(GPT_VARIANTS))
def test_every_model_has_a_plan_covering_each_tensor_once(name):
    model = build_model("gpt", **GPT_VARIANTS[name]) if name in GPT_VARIANTS else build_model(name, **TINY[name])
    plan = plan_for(model)
    tensors = {id(p): p for p in model.parameters()}
    assert sorted(id(e.param) for e in plan) == sorted(tensors)
    assert all(e.layout is not None for e in plan if e.param.ndim >= 2)
