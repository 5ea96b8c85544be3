"""Sixteen more Hugging Face families, unmodified: a role plan without overrides, each odd parameter placed
with its reason, and three steps of MOGA and of Muon that lower the loss."""

import ast

import pytest
import torch

from moga.layout import as_layout
from moga.optim import MOGA, Muon
from moga.roles import PlanError, build_plan
from tests.integrations.hf_families import NEW_FAMILIES as FAMILIES
from tests.integrations.hf_families import build_family as build
from tests.integrations.hf_zoo import VOCAB


def batch(name: str, seed: int = 1) -> dict:
    """Forward keyword arguments with which ``model(**batch).loss`` is the training loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    if name == "whisper":
        return {"input_features": torch.randn(2, 8, 16, generator=g), "labels": ids}
    if name == "clip":  # four (text, image) pairs: CLIP's contrastive loss is its training loss
        ids = torch.randint(3, VOCAB, (4, 8), generator=g)
        return {"input_ids": ids, "pixel_values": torch.randn(4, 3, 16, 16, generator=g), "return_loss": True}
    return {"input_ids": ids, "labels": ids}

# The parameters no torch layer declares, and where the plan must put them: (role, layout, reason words).
ODD = {
    "mamba": {"backbone.layers.1.mixer.A_log": ("vector", None, "elementwise"),
              "backbone.layers.1.mixer.D": ("vector", None, None)},
    "clip": {"logit_scale": ("vector", None, "logit_scale")},
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def transformers_with(config: str, family: str):
    """transformers, when it is installed and has ``config``; else the test skips saying which is missing."""
    T = pytest.importorskip("transformers", reason="transformers is not installed (pip install moga[hf])",
                            exc_type=ImportError)
    if not hasattr(T, config):
        pytest.skip(f"this transformers has no {family}")
    return T


def _noted(notes: list[str], name: str, reason: str) -> bool:
    """Some note line gives ``reason`` for ``name`` (block indices written as '*')."""
    glob = ".".join("*" if part.isdigit() else part for part in name.split("."))
    return any(reason in line and (name in line or glob in line) for line in notes)


@pytest.mark.parametrize("name", FAMILIES)
def test_plan_without_overrides_places_and_explains_every_parameter(name):
    model = build(name)
    plan = build_plan(model)
    assert len(plan) == len(list(model.parameters()))  # every distinct tensor, none guessed away
    notes = [line for line in str(plan).splitlines() if line.startswith("note:")]
    for pname, (role, layout, reason) in ODD.get(name, {}).items():
        entry = plan[pname]
        assert (entry.role, entry.layout) == (role, layout)
        if reason is not None:
            assert reason in entry.reason and _noted(notes, pname, reason), notes
    if name in MOE:
        (router,) = [e for e in plan if e.name.startswith("model.layers.1.") and e.name.endswith(".gate.weight")
                     and ".experts." not in e.name]  # Mixtral on 4.x: block_sparse_moe.gate
        assert (router.role, router.layout, router.matrix_shape) == ("hidden", "oi", (4, 32))
        experts = [e for e in plan if ".experts." in e.name]
        assert experts and all(e.role == "hidden" for e in experts)
        if any(e.param.ndim == 3 for e in experts):  # transformers 5: fused (E, out, in) stacks
            assert "router" in router.reason and _noted(notes, router.name, "router")
            for e in experts:
                # stepped per expert: the expert axis is a batch axis
                assert e.layout == "boi" and e.matrix_shape == e.shape[1:] and _noted(notes, e.name, "expert stack")
        else:  # transformers 4.x: a ModuleList of nn.Linear experts, and the router an nn.Linear
            assert all(e.layout == "oi" and e.owner == "Linear" for e in experts) and router.owner == "Linear"


def _losses(model, optimizer, data, steps=3):
    losses = []
    for _ in range(steps):
        loss = model(**data).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        losses.append(model(**data).loss.item())
    return losses


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("optimizer", [MOGA, Muon], ids=lambda c: c.__name__)
def test_three_default_steps_lower_the_loss(name, optimizer):
    model = build(name)
    opt = optimizer(model)  # default lr and plan, no overrides
    losses = _losses(model, opt, batch(name))
    assert opt.skipped_steps == 0 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0], losses


def test_expert_stacks_step_per_expert():
    """Each expert of a fused stack takes its own row(2) step: the same update as that expert's matrix alone."""
    from moga.geometry import parse_geometry

    model = build("qwen3_moe")
    if not hasattr(model.model.layers[0].mlp.experts, "gate_up_proj"):
        pytest.skip("transformers 4.x stores the experts as separate nn.Linear modules")
    opt = MOGA(model, lr=0.1, momentum=0.0)
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    before = stack.detach().clone()
    model(**batch("qwen3_moe")).loss.backward()
    grad = stack.grad.clone()
    opt.step()
    row = parse_geometry("row(p=2)")
    for e in range(stack.shape[0]):
        torch.testing.assert_close(stack[e].detach(), before[e] + 0.1 * row.lmo(grad[e], "oi"))


def test_transposed_expert_stacks_and_expert_biases():
    """GPT-OSS stores its experts (E, in, out) and says so (is_transposed): layout bio, and per-expert biases
    (E, d) are vectors; the router has a bias too."""
    T = transformers_with("GptOssConfig", "GPT-OSS")
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(T.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    experts = model.model.layers[0].mlp.experts
    overrides = None
    if not hasattr(experts, "is_transposed"):
        # transformers 4.x: the module does not say how its stacks are stored, so the plan refuses to guess,
        # listing both stacks (the biases need no orientation), and the override places them.
        with pytest.raises(PlanError, match=r"(?s)cannot place 4 parameter.*experts.gate_up_proj.*experts.down_proj'"):
            build_plan(model)
        overrides = {"*.experts.*_proj": "hidden:bio"}
    plan = build_plan(model, overrides=overrides)
    up, down = plan["model.layers.0.mlp.experts.gate_up_proj"], plan["model.layers.0.mlp.experts.down_proj"]
    assert (up.layout, down.layout) == ("bio", "bio")
    assert up.matrix_shape == (32, 32) and down.matrix_shape == (32, 16)  # (out, in) of x @ W[e]
    assert plan["model.layers.0.mlp.experts.down_proj_bias"].role == "vector"
    assert (plan["model.layers.0.mlp.router.weight"].layout, plan["model.layers.0.mlp.router.bias"].role) == (
        "oi", "vector")
    data = {"input_ids": torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))}
    losses = _losses(model, MOGA(model, overrides=overrides), {**data, "labels": data["input_ids"]})
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("optimizer", [MOGA, Muon], ids=lambda c: c.__name__)
def test_clip_learns_under_default_steps_over_seeds(optimizer):
    """A contrastive model: at the full lr, steps on the vectors and tables every sample shares pulled all
    embeddings onto one direction (the loss rose on some seeds and stuck near log(4) = 1.39). The plan steps
    them at 1/8 of the lr, so every seed's loss goes down, well below chance."""
    finals = []
    for seed in range(3):
        for data_seed in (1, 2):
            model = build("clip", seed=seed)
            opt = optimizer(model)  # default lr and plan, no overrides
            assert opt.plan.lr_multipliers == {"embedding": 0.125, "vector": 0.125}
            data = batch("clip", data_seed)
            losses = _losses(model, opt, data, steps=6)
            assert opt.skipped_steps == 0 and losses[3] < losses[0] and losses[-1] < losses[0], (seed, losses)
            finals.append(losses[-1])
    assert sum(finals) / len(finals) < 1.0, finals  # well below chance, log(4)


def test_recurrent_gemma_suggestions_follow_the_forward():
    """RecurrentGemma's RG-LRU gates are per-head matrices stored (heads, in, out) and applied as
    ``baddbmm(bias, x, W)``, the bias added elementwise. The PlanError suggests what the forward does (bio and
    vector; it used to suggest boi and hidden:oi), and the suggestions, pasted as printed, train."""
    T = transformers_with("RecurrentGemmaConfig", "RecurrentGemma")
    torch.manual_seed(0)
    model = T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
        num_hidden_layers=2, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, lru_width=32, attention_window_size=16, conv1d_width=4,
        block_types=["recurrent", "attention"]))
    with pytest.raises(PlanError) as err:
        build_plan(model)
    text = str(err.value)
    assert "run once on the model's dummy_inputs" in text and "?" not in text
    overrides = ast.literal_eval(text[text.index("{", text.index("overrides=")):])
    assert overrides == {"model.layers.*.temporal_block.rg_lru.input_gate_weight": "hidden:bio",
                         "model.layers.*.temporal_block.rg_lru.input_gate_bias": "vector",
                         "model.layers.*.temporal_block.rg_lru.recurrent_gate_weight": "hidden:bio",
                         "model.layers.*.temporal_block.rg_lru.recurrent_gate_bias": "vector"}
    plan = build_plan(model, overrides=overrides)
    lru = model.model.layers[0].temporal_block.rg_lru
    entry = plan["model.layers.0.temporal_block.rg_lru.input_gate_weight"]
    # The plan's (out, in) matrices are the maps the module applies: baddbmm(0, x, W)[h] = x[h] @ M[h].T.
    x = torch.randn(4, 5, 8)
    matrices = as_layout(entry.layout).to_matrix(lru.input_gate_weight.detach())
    torch.testing.assert_close(torch.baddbmm(torch.zeros(4, 5, 8), x, lru.input_gate_weight.detach()),
                               x @ matrices.transpose(1, 2))
    assert plan["model.layers.0.temporal_block.rg_lru.input_gate_bias"].role == "vector"
    data = {"input_ids": torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))}
    losses = _losses(model, MOGA(model, overrides=overrides), {**data, "labels": data["input_ids"]})
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0], losses
