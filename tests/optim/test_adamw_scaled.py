"""Rescaled AdamW is muP's Adam: torch.optim.AdamW with lr/fan_in on hidden and output matrices."""

import pytest
import torch
from torch import nn

from moga.optim import ScaledAdamW
from tests.optim.mup_reference import TinyLM, mup_adam_groups


def train_side_by_side(*pairs, steps: int):
    """``steps`` next-token steps of each (model, optimizer) pair on the same random batches (logits in float32)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 20, (4, 7), generator=gen)
        for model, o in pairs:
            o.zero_grad()
            nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            o.step()


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_equals_mup_adam(wd):
    torch.manual_seed(0)
    ours, ref = TinyLM(), TinyLM()
    ref.load_state_dict(ours.state_dict())
    opt = ScaledAdamW(ours, lr=0.05, weight_decay=wd)
    ref_opt = torch.optim.AdamW(mup_adam_groups(ref, 0.05, wd), betas=(0.9, 0.999), eps=1e-8, foreach=False)
    train_side_by_side((ours, opt), (ref, ref_opt), steps=8)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_plan_puts_the_factor_on_matrices_only():
    opt = ScaledAdamW(TinyLM())
    by_role = {e.role: (e.geometry, e.update) for e in opt.plan}
    assert by_role["hidden"] == ("sign", "adam")
    assert by_role["readout"] == ("sign", "adam")
    assert by_role["embedding"] == ("embedding(q=inf)", "adam")
    assert by_role["vector"] == ("vector", "adam")


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_bfloat16_with_bfloat16_state_steps_in_torchs_fused_kernel(wd):
    """bf16 parameters and moments (state_dtype=torch.bfloat16): torch's fused AdamW, one launch per sign
    factor instead of about six per tensor, bit for bit torch.optim.AdamW(fused=True) under muP's rule."""
    torch.manual_seed(0)
    ours, ref = TinyLM().bfloat16(), TinyLM().bfloat16()
    ref.load_state_dict(ours.state_dict())
    opt = ScaledAdamW(ours, lr=0.05, weight_decay=wd, state_dtype=torch.bfloat16)
    ref_opt = torch.optim.AdamW(mup_adam_groups(ref, 0.05, wd), betas=(0.9, 0.999), eps=1e-8, fused=True)
    train_side_by_side((ours, opt), (ref, ref_opt), steps=4)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
