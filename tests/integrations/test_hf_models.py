"""Hugging Face models as users build them: tied embeddings get the `tied` role by default, every preset
optimizer builds a plan and takes a step, and an override still wins."""

import pytest
import torch

from moga.geometry import parse_geometry
from moga.optim import MOGA, Muon, ScaledAdamW
from moga.roles import build_plan
from tests.integrations.hf_zoo import FAMILIES, TIED, batch, build


@pytest.mark.parametrize("name", FAMILIES)
def test_plan_ties_by_default_and_says_why(name):
    model = build(name)
    plan = build_plan(model)
    tied = TIED[name]
    if tied is None:
        assert "tied" not in plan.roles().values() and "note:" not in str(plan)
        return
    entry = plan[tied]
    assert entry.role == "tied" and entry.layout == "oi" and entry.matrix_shape == (64, 32)
    assert entry.geometry == "row(p=2)"
    notes = [line for line in str(plan).splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and tied in notes[0] and "row(p=2)" in notes[0] and "64x32" in notes[0]
    # Only the head is a matrix after the blocks: no other layer is called the readout.
    assert "readout" not in plan.roles().values()


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("optimizer", [MOGA, Muon, ScaledAdamW], ids=lambda c: c.__name__)
def test_one_step(name, optimizer):
    model = build(name)
    opt = optimizer(model, lr=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(**batch(name)).loss
    loss.backward()
    tied = TIED[name] and dict(model.named_parameters())[TIED[name]]
    grad = tied.grad.clone() if tied is not None else None
    opt.step()
    assert torch.isfinite(loss) and opt.skipped_steps == 0
    after = dict(model.named_parameters())
    moved = [n for n, p in after.items() if not torch.equal(p, before[n])]
    assert len(moved) == len(after)  # every parameter (shared ones once) took its step
    if tied is not None and optimizer is MOGA:
        # One update for both uses: the head's row(2) LMO of the summed gradient, with lr 0.01.
        expected = before[TIED[name]] + 0.01 * parse_geometry("row(p=2)").lmo(grad, "oi")
        torch.testing.assert_close(tied.detach(), expected)


def test_overrides_still_win():
    model = build("gpt2")
    plan = build_plan(model, overrides={"lm_head.weight": "embedding"})
    entry = plan["transformer.wte.weight"]
    assert (entry.role, entry.layout, entry.geometry) == ("embedding", "io", "embedding(q=2)")
    assert "note:" not in str(plan)
    plan = build_plan(model, overrides={"transformer.wte.weight": {"geometry": "spectral"}})
    assert plan["lm_head.weight"].role == "tied" and plan["lm_head.weight"].geometry.startswith("spectral")
    assert "the override's geometry spectral" in str(plan)
