"""Muon against torch.optim.Muon (and its AdamW parts against torch.optim.AdamW), and the geometry's own scale."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from moga.models import GPT, GPTConfig
from moga.optim import Muon
from moga.optim.muon import ADAMW, MUON_PRESETS
from moga.orthogonalize import DEFAULT_NS_STEPS, newton_schulz


def quadratic_grads(params, targets):
    loss = sum(((p @ t) ** 2).sum() for p, t in zip(params, targets))
    loss.backward()


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_bit_for_bit(nesterov):
    torch.manual_seed(0)
    shapes = [(32, 32), (16, 48), (48, 16)]
    ours = [nn.Parameter(torch.randn(s) / math.sqrt(s[1])) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    targets = [torch.randn(s[1], 8) for s in shapes]
    opt = Muon(ours, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1, scale="torch", ns_dtype="bfloat16")
    ref = torch.optim.Muon(theirs, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=0.1)
    for _ in range(10):
        for o, params in ((opt, ours), (ref, theirs)):
            o.zero_grad()
            quadratic_grads(params, targets)
            o.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)  # the same operations in the same dtype: bit for bit


def test_mean_scale_is_sqrt_fan_out_over_fan_in():
    for m, n in [(64, 16), (16, 64)]:
        w = nn.Parameter(torch.zeros(m, n))
        w.grad = torch.randn(m, n)
        Muon([w], lr=1.0, momentum=0.0, nesterov=False, ns_dtype="float32", scale="mean").step()
        expected = -math.sqrt(m / n) * newton_schulz(w.grad, dtype=torch.float32)
        torch.testing.assert_close(w.detach(), expected)


def test_moga_preset_plan_uses_spectral_on_matrices_only():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    opt = Muon(model, preset="moga")
    roles = {e.role: e.geometry for e in opt.plan}
    assert roles["hidden"].startswith("spectral") and roles["readout"].startswith("spectral")
    assert roles["embedding"] == "embedding(q=2)"
    assert roles["vector"] == "vector"


def test_same_shape_matrices_share_one_batched_newton_schulz():
    torch.manual_seed(0)
    shapes = [(24, 24)] * 4 + [(48, 24)] * 2 + [(24, 48)]
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    singles = [nn.Parameter(p.detach().clone()) for p in params]
    batched = Muon(params, lr=0.02, nesterov=True, weight_decay=0.1, ns_dtype="float64")
    one_by_one = [Muon([p], lr=0.02, nesterov=True, weight_decay=0.1, ns_dtype="float64") for p in singles]
    for _ in range(2):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, q, g in zip(params, singles, grads):
            p.grad, q.grad = g.clone(), g.clone()
        with torch.profiler.profile() as prof:
            batched.step()
        for o in one_by_one:
            o.step()
        for p, q in zip(params, singles):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    calls = {e.key: e.count for e in prof.key_averages()}
    steps = DEFAULT_NS_STEPS
    # one batched iteration per shape (3), not per matrix (7): 2 matmul-adds per Newton-Schulz step each
    assert calls.get("aten::baddbmm") == 3 * 2 * steps


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=16))


def gpt_loss(model, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 40, (4, 8), generator=gen)
    return model(x, torch.randint(0, 40, (4, 8), generator=gen))[1]


def test_a_plain_spectral_override_warns_what_it_drops():
    """geometries={"hidden": "spectral"} takes the geometry's sqrt(m/n), not the published 0.2 sqrt(max(m, n)):
    the warning names the dropped setting; a spec that names it, or a preset whose scale it equals, is quiet."""
    with pytest.warns(UserWarning, match=r"not this Muon's scale=match_rms_adamw.*'spectral\(scale=match_rms_adamw\)'"):
        opt = Muon(tiny_gpt(), geometries={"hidden": "spectral"})
    assert {e.geometry for e in opt.plan if e.role == "hidden"} == {"spectral"}  # the override still applies
    with pytest.warns(UserWarning, match=r"not this Muon's dtype=bfloat16"):
        Muon(tiny_gpt(), scale="torch", geometries={"hidden": "spectral(scale=torch)"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(tiny_gpt(), geometries={"hidden": "spectral(scale=match_rms_adamw)", "readout": "row(p=2)"})
        Muon(tiny_gpt(), preset="moga", geometries={"hidden": "spectral"})
        Muon(tiny_gpt(), geometries={"hidden": "spectral(scale=mean)"})  # asked for by name
        Muon(tiny_gpt(), geometries={"hidden": "spectral(scale = mean)"})  # spaced: still by name


def test_published_recipe_plan_and_defaults():
    opt = Muon(tiny_gpt())
    by_role = {}
    for e in opt.plan:
        by_role.setdefault(e.role, set()).add((e.geometry, e.update))
    assert by_role["hidden"] == {("spectral(scale=match_rms_adamw)", "lmo")}
    for role in ("embedding", "readout", "vector"):  # AdamW: Adam's step with no factor (the l_inf geometry)
        assert by_role[role] == {("vector", "adam")}, role
    text = str(opt.plan)
    assert "AdamW, betas (0.9, 0.95)" in text and "embedding" in text.splitlines()[-2]
    published = MUON_PRESETS["published"]
    for g in opt.param_groups:  # torch.optim.Muon's lr, decay and momentum; vectors undecayed
        assert g["lr"] == published.lr == 1e-3 and g["betas"] == (0.9, 0.95)
        assert g["weight_decay"] == (0.0 if g["role"] == "vector" else 0.1)
        assert g["momentum"] == 0.95 and g["nesterov"] is True and g["preset"] == "published"


def torch_reference(model, lr, adjust_lr_fn):
    """torch's published recipe on a copy of ``model``: torch.optim.Muon on the hidden matrices (its defaults
    otherwise), torch.optim.AdamW on the rest, decayed as moga decays them (vectors not)."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    muon = torch.optim.Muon(hidden, lr=lr, adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), fused=True)
    return [muon, adamw]


@pytest.mark.parametrize("scale, ns_dtype, adjust", [("torch", None, None),
                                                     ("match_rms_adamw", "bfloat16", "match_rms_adamw")])
def test_published_recipe_is_torch_muon_and_adamw_bit_for_bit(scale, ns_dtype, adjust):
    """With torch's defaults (lr 1e-3 here raised to 0.01 to move the weights, decay 0.1, momentum 0.95,
    Nesterov, bfloat16 Newton-Schulz for scale="torch"), two blocks' same-shape matrices included."""
    ours = tiny_gpt()
    theirs = copy.deepcopy(ours)
    opt = Muon(ours, lr=0.01, scale=scale, ns_dtype=ns_dtype)
    refs = torch_reference(theirs, 0.01, adjust)
    for step in range(4):
        for model, optimizers in ((ours, [opt]), (theirs, refs)):
            for o in optimizers:
                o.zero_grad()
            gpt_loss(model, step).backward()
            for o in optimizers:
                o.step()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), (step, name)
    assert not torch.equal(ours.lm_head.weight, tiny_gpt().lm_head.weight)


def test_moga_preset_is_the_old_recipe():
    """preset="moga" keeps the old defaults: lr 0.02, no decay, sqrt(m/n), tables in MOGA's embedding geometry."""
    model = tiny_gpt()
    old = Muon(model, preset="moga")
    assert {g["lr"] for g in old.param_groups} == {0.02} and {g["weight_decay"] for g in old.param_groups} == {0.0}
    assert old.plan["lm_head.weight"].geometry == "spectral" and old.plan["wte.weight"].geometry == "embedding(q=2)"
    assert old.param_groups[0]["betas"] == (0.9, 0.999)


def test_bad_preset_and_misplaced_option_are_clear_errors():
    with pytest.raises(ValueError, match="Muon's preset must be one of 'published', 'moga'"):
        Muon(tiny_gpt(), preset="paper")
    with pytest.raises(ValueError, match="embedding_q sets the embedding geometry of preset='moga'"):
        Muon(tiny_gpt(), embedding_q=4)
    assert Muon(tiny_gpt(), preset="moga", embedding_q=4).plan["wte.weight"].geometry == "embedding(q=4)"


def test_adamw_spec_is_adams_step_without_factor():
    assert ADAMW == "adam:vector"
