"""Sixteen more Hugging Face families, unmodified: a role plan without overrides, each odd parameter placed
with its reason, and three steps of MOGA and of Muon that lower the loss."""

import pytest
import torch

from moga.optim import MOGA, Muon
from moga.roles import build_plan
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
    "mixtral": {"model.layers.1.mlp.gate.weight": ("hidden", "oi", "router"),
                "model.layers.1.mlp.experts.gate_up_proj": ("hidden", "boi", "expert stack"),
                "model.layers.1.mlp.experts.down_proj": ("hidden", "boi", "expert stack")},
    "qwen2_moe": {"model.layers.0.mlp.gate.weight": ("hidden", "oi", "router"),
                  "model.layers.0.mlp.experts.down_proj": ("hidden", "boi", "expert stack")},
    "qwen3_moe": {"model.layers.0.mlp.gate.weight": ("hidden", "oi", "router"),
                  "model.layers.0.mlp.experts.gate_up_proj": ("hidden", "boi", "expert stack")},
    "mamba": {"backbone.layers.1.mixer.A_log": ("vector", None, "elementwise"),
              "backbone.layers.1.mixer.D": ("vector", None, None)},
    "clip": {"logit_scale": ("vector", None, "logit_scale")},
}


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
            assert reason in entry.reason
            assert any(reason in line and (pname in line or pname.replace(".1.", ".*.").replace(".0.", ".*.")
                                           in line) for line in notes), notes
    if "experts.gate_up_proj" in str(plan):
        stack = next(e for e in plan if e.name.endswith("experts.gate_up_proj"))
        experts, out, inp = stack.shape
        assert stack.matrix_shape == (out, inp)  # stepped per expert: the expert axis is a batch axis


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
    opt = MOGA(model, lr=0.1, momentum=0.0)
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    before = stack.detach().clone()
    model(**batch("qwen3_moe")).loss.backward()
    grad = stack.grad.clone()
    opt.step()
    row = parse_geometry("row(p=2)")
    for e in range(stack.shape[0]):
        torch.testing.assert_close(stack[e].detach(), before[e] + 0.1 * row.lmo(grad[e], "oi"))
