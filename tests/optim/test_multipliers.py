"""Per-role learning-rate multipliers: each role's groups step at lr x its multiplier, through schedulers and
state_dict (FSDP2: tests/optim/test_sharded.py, case multipliers)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR

from moga.models.gpt import GPT, GPTConfig
from moga.optim import MOGA, Muon, ScaledAdamW
from moga.optim.multipliers import PAPER, PRESETS, Preset, base_lr

from .tinynet import TINY_OVERRIDES, TinyNet, tiny_loss

MULT = {"embedding": 0.25, "readout": 3.0, "vector": 2.0}
LR = 0.01
BUILDERS = {  # MOGA from the paper's preset, every role at lr: the default preset's own multipliers are tested below
    "moga": lambda m, **kw: MOGA(m, momentum=0.9, nesterov=True, weight_decay=0.1, overrides=TINY_OVERRIDES,
                                 preset="paper", **kw),
    "muon": lambda m, **kw: Muon(m, weight_decay=0.1, ns_dtype="float32", overrides=TINY_OVERRIDES, **kw),
    "adamw-scaled": lambda m, **kw: ScaledAdamW(m, weight_decay=0.1, overrides=TINY_OVERRIDES, **kw),
}


def tiny(seed=0):
    torch.manual_seed(seed)
    return TinyNet()


def run(model, opt, steps, scheduler=None, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        tiny_loss(model, seed=step).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def roles_of(opt):
    return {e.name: e.role for e in opt.plan}


def make_scheduler(kind, opt):
    if kind == "lambda":
        return LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.5 ** (s // 4))
    return CosineAnnealingLR(opt, T_max=6, eta_min=1e-4)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_one_step_moves_each_role_as_the_run_at_its_multiplied_lr(name):
    """From the same weights (so the same gradients), a role's parameters land exactly where one step at
    lr x its multiplier takes them; the multipliers did move the readout off the plain step."""
    build = BUILDERS[name]
    model = tiny()
    opt = build(model, lr=LR, lr_multipliers=MULT)
    run(model, opt, 1)
    roles = roles_of(opt)
    for m in {1.0, *MULT.values()}:
        ref = tiny()
        run(ref, build(ref, lr=LR * m), 1)
        ref_params = dict(ref.named_parameters())
        checked = [n for n, p in model.named_parameters() if MULT.get(roles[n], 1.0) == m]
        assert checked
        for n in checked:
            torch.testing.assert_close(dict(model.named_parameters())[n], ref_params[n], rtol=1e-6, atol=1e-7, msg=n)
    plain = tiny()
    run(plain, build(plain, lr=LR), 1)
    assert not torch.allclose(model.head.weight, plain.head.weight)


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("schedule", ["lambda", "cosine"])
def test_a_scheduler_scales_each_multiplied_lr(name, schedule):
    """Under a torch scheduler, training with multipliers is bit for bit training with each group's lr set
    by hand to lr x multiplier before the scheduler is made: the scheduler scales each group's own lr."""
    build = BUILDERS[name]
    model = tiny()
    opt = build(model, lr=LR, lr_multipliers=MULT)
    run(model, opt, 6, make_scheduler(schedule, opt))
    ref = tiny()
    ref_opt = build(ref, lr=LR)
    for group in ref_opt.param_groups:
        group["lr"] = LR * MULT.get(group["role"], 1.0)
    run(ref, ref_opt, 6, make_scheduler(schedule, ref_opt))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]


def test_groups_carry_their_multiplier_and_schedulers_keep_the_ratio():
    model = tiny()
    opt = MOGA(model, lr=LR, lr_multipliers=MULT, overrides=TINY_OVERRIDES)
    for group in opt.param_groups:
        assert group["lr_multiplier"] == MULT.get(group["role"], 1.0)
        assert group["lr"] == LR * group["lr_multiplier"]
    sched = CosineAnnealingLR(opt, T_max=5)
    for _ in range(3):
        run(model, opt, 1, sched)
        expected = sched.get_last_lr()[0] / opt.param_groups[0]["lr_multiplier"]
        assert all(math.isclose(base_lr(g), expected, rel_tol=1e-12) for g in opt.param_groups)


@pytest.mark.parametrize("schedule", ["lambda", "cosine"])
def test_state_dict_round_trip_resumes_bitwise(schedule):
    """Saved after 3 steps (torch.save, weights_only load) into an optimizer built without multipliers: the
    groups get theirs back, and 3 more steps match the uninterrupted run bit for bit."""
    model = tiny()
    opt = MOGA(model, lr=LR, momentum=0.9, lr_multipliers=MULT, overrides=TINY_OVERRIDES)
    sched = make_scheduler(schedule, opt)
    run(model, opt, 3, sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    run(model, opt, 3, sched, start=3)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = tiny(seed=1)
    resumed.load_state_dict(saved["model"])
    opt2 = MOGA(resumed, lr=LR, momentum=0.9, overrides=TINY_OVERRIDES)  # no multipliers: the state brings them
    sched2 = make_scheduler(schedule, opt2)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert [g["lr_multiplier"] for g in opt2.param_groups] == [MULT.get(g["role"], 1.0) for g in opt2.param_groups]
    run(resumed, opt2, 3, sched2, start=3)
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n


def test_no_multipliers_leaves_the_groups_as_before():
    opt = MOGA(tiny(), lr=LR, overrides=TINY_OVERRIDES, preset="paper")  # the paper's preset has none
    assert all("lr_multiplier" not in g and g["lr"] == LR for g in opt.param_groups)
    assert all(base_lr(g) == LR for g in opt.param_groups)


@pytest.mark.parametrize("bad, message", [
    ({"head": 2.0}, "'head', which is not a role"),
    ({"readout": 0.0}, "must be a finite number > 0"),
    ({"readout": -1.0}, "must be a finite number > 0"),
    ({"readout": float("nan")}, "must be a finite number > 0"),
    ({"readout": True}, "must be a finite number > 0"),
    ({"tied": 2.0}, "role(s) tied, which no parameter of this model has"),
    ([("readout", 2.0)], "must map roles to numbers"),
])
def test_bad_multipliers_are_clear_errors(bad, message):
    with pytest.raises(ValueError) as e:
        MOGA(tiny(), lr=LR, lr_multipliers=bad, overrides=TINY_OVERRIDES)
    assert message in str(e.value)


def test_a_readout_multiplier_on_a_tied_head_is_refused():
    """The tied GPT has no readout role: the multiplier would change nothing, so it is an error naming the roles."""
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, tie_weights=True))
    with pytest.raises(ValueError, match="no parameter of this model has; its roles: .*tied"):
        MOGA(model, lr=LR, lr_multipliers={"readout": 2.0})
    MOGA(model, lr=LR, lr_multipliers={"tied": 2.0})


def test_param_groups_without_roles_are_refused():
    model = tiny()
    with pytest.raises(ValueError, match="pass the nn.Module"):
        MOGA(list(model.parameters()), lr=LR, geometry="sign", lr_multipliers={"readout": 2.0})


def test_a_refused_multiplier_leaves_a_model_untouched():
    model = tiny()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError):
        MOGA(model, lr=LR, lr_multipliers={"bogus": 1.0}, overrides=TINY_OVERRIDES)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- MOGA's presets: named sets of default multipliers ---------------------------------------------------------

def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))


def run_gpt(model, opt, steps):
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randint(0, 16, (4, 8), generator=gen)
        opt.zero_grad()
        _, loss = model(x, x)
        loss.backward()
        opt.step()


@pytest.fixture
def scaled_default(monkeypatch):
    """A default preset with other multipliers: embedding and a role the GPT lacks."""
    monkeypatch.setitem(PRESETS, "default", Preset({"embedding": 0.25, "conv": 3.0}, nesterov=True))
    return PRESETS["default"]


def test_the_preset_reaches_the_param_groups_and_the_printed_plan(scaled_default):
    opt = MOGA(tiny_gpt(), lr=LR)
    assert opt.preset == "default" and {g["preset"] for g in opt.param_groups} == {"default"}
    lrs = {g["role"]: (g["lr"], g["lr_multiplier"]) for g in opt.param_groups}
    assert lrs == {"embedding": (LR * 0.25, 0.25), "vector": (LR, 1.0), "hidden": (LR, 1.0), "readout": (LR, 1.0)}
    table = str(opt.plan).splitlines()
    assert table[0].split()[-2:] == ["lr", "x"]
    assert table[2].split()[0] == "wte.weight" and table[2].split()[-1] == "0.25"
    assert next(line for line in table if line.startswith("lm_head.weight")).split()[-1] == "1"
    assert "the preset 'default'" in table[-1]
    assert table[-2].startswith("momentum: EMA 0.9, Nesterov")
    paper = MOGA(tiny_gpt(), lr=LR, preset="paper")
    assert {(g["preset"], g["nesterov"]) for g in paper.param_groups} == {("paper", False)}
    assert all("lr_multiplier" not in g and g["lr"] == LR for g in paper.param_groups)
    assert str(paper.plan).splitlines()[-2].startswith("momentum: EMA 0.9, plain")


def test_the_default_is_the_tables_at_a_sixteenth_with_nesterov_momentum():
    assert PRESETS["default"] == Preset({"embedding": 1 / 16}, nesterov=True)
    assert PRESETS["paper"] == PAPER == Preset({}, nesterov=False)


def gpt_after(steps=3, **kw):
    model = tiny_gpt()
    run_gpt(model, MOGA(model, lr=LR, **kw), steps)
    return dict(model.named_parameters())


def assert_same_bits(a, b):
    for n, p in a.items():
        assert torch.equal(p, b[n]), n


def test_the_default_steps_as_the_paper_with_its_options_passed_by_hand():
    """MOGA's default is the paper's step with the tables at lr/16 and Nesterov momentum, bit for bit; with
    plain momentum instead, every matrix lands elsewhere (from the second step on: on the first, Nesterov's
    direction is a multiple of plain momentum's, and MOGA's matrix LMOs do not see the scale)."""
    default = gpt_after()
    assert_same_bits(default, gpt_after(preset="paper", lr_multipliers={"embedding": 1 / 16}, nesterov=True))
    plain = gpt_after(preset="paper", lr_multipliers={"embedding": 1 / 16})
    assert all(not torch.equal(p, plain[n]) for n, p in default.items() if p.dim() == 2)


def test_muoneq_is_the_default_with_row_spectral_hidden_matrices_and_a_users_geometry_wins():
    """preset="muoneq" steps as the default with geometries={"hidden": "row_spectral"}, bit for bit, and unlike
    the default; a user's hidden geometry replaces the preset's, other roles' geometries add to it."""
    muoneq = gpt_after(preset="muoneq")
    assert_same_bits(muoneq, gpt_after(geometries={"hidden": "row_spectral"}))
    default = gpt_after()
    assert any(not torch.equal(p, default[n]) for n, p in muoneq.items() if p.dim() == 2)
    assert_same_bits(gpt_after(preset="muoneq", geometries={"hidden": "row(p=2)"}), default)
    assert_same_bits(gpt_after(preset="muoneq", geometries={"readout": "spectral"}),
                     gpt_after(geometries={"hidden": "row_spectral", "readout": "spectral"}))


def test_the_paper_preset_steps_with_plain_momentum():
    """The paper's preset is the default with both of its options undone; its groups say plain momentum."""
    paper = gpt_after(preset="paper")
    assert_same_bits(paper, gpt_after(lr_multipliers={"embedding": 1.0}, nesterov=False))
    nesterov = gpt_after(preset="paper", nesterov=True)
    assert any(not torch.equal(p, nesterov[n]) for n, p in paper.items())


def test_a_users_nesterov_wins_over_the_presets():
    """nesterov=False under the default: the tables keep lr/16, the momentum is plain; nesterov=True under the
    paper's preset: Nesterov. None (the default argument) takes the preset's."""
    model = tiny_gpt()
    assert {g["nesterov"] for g in MOGA(model, lr=LR, nesterov=False).param_groups} == {False}
    assert {g["nesterov"] for g in MOGA(model, lr=LR, preset="paper", nesterov=True).param_groups} == {True}
    assert {g["nesterov"] for g in MOGA(model, lr=LR, nesterov=None).param_groups} == {True}
    assert_same_bits(gpt_after(nesterov=False), gpt_after(preset="paper", lr_multipliers={"embedding": 1 / 16}))
    with pytest.raises(ValueError, match="nesterov must be True or False"):
        MOGA(model, lr=LR, nesterov="yes")


def test_a_user_multiplier_overrides_the_presets_role_by_role(scaled_default):
    """The user's embedding multiplier wins over the preset's; the preset's conv multiplier, a role the GPT lacks,
    is skipped (the user's would be an error); the user's readout one adds to the preset."""
    opt = MOGA(tiny_gpt(), lr=LR, lr_multipliers={"embedding": 2.0, "readout": 0.5})
    assert {g["role"]: g["lr_multiplier"] for g in opt.param_groups} == \
        {"embedding": 2.0, "vector": 1.0, "hidden": 1.0, "readout": 0.5}
    with pytest.raises(ValueError, match="role.s. conv, which no parameter of this model has"):
        MOGA(tiny_gpt(), lr=LR, lr_multipliers={"conv": 2.0})
    tiny_opt = MOGA(tiny(), lr=LR, overrides=TINY_OVERRIDES)  # TinyNet has a conv: the preset's 3 applies
    assert {g["role"]: g["lr_multiplier"] for g in tiny_opt.param_groups}["conv"] == 3.0


def test_torch_style_param_groups_take_no_preset_multipliers(scaled_default):
    """Param groups have no roles: the preset's multipliers cannot apply (no error, each group keeps its lr); its
    momentum, which needs no role, does."""
    model = tiny_gpt()
    opt = MOGA([{"params": [model.wte.weight], "geometry": "embedding(q=2)", "layout": "io"}], lr=LR)
    assert opt.param_groups[0]["lr"] == LR and "lr_multiplier" not in opt.param_groups[0] and opt.plan is None
    assert opt.param_groups[0]["nesterov"] is True
    paper = MOGA([{"params": [model.wte.weight], "geometry": "embedding(q=2)", "layout": "io"}], lr=LR, preset="paper")
    assert paper.param_groups[0]["nesterov"] is False


@pytest.mark.parametrize("bad", ["Paper", "papers", "", None, 1])
def test_a_bad_preset_is_a_clear_error_naming_the_presets(bad):
    model = tiny_gpt()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="preset must be one of 'default', 'paper'"):
        MOGA(model, lr=LR, preset=bad)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_state_dict_round_trip_keeps_the_presets_group_lrs(scaled_default):
    """Saved under a scaled default and loaded into a paper-preset optimizer: the groups' lrs, multipliers,
    preset and momentum come back with the state (as for lr_multipliers), and the next steps match the
    uninterrupted run (so a checkpoint keeps the momentum it ran, whatever the default has become)."""
    model = tiny_gpt()
    opt = MOGA(model, lr=LR)
    sched = CosineAnnealingLR(opt, T_max=6, eta_min=1e-4)
    for _ in range(2):
        run_gpt(model, opt, 1)
        sched.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = tiny_gpt(seed=1)
    resumed.load_state_dict(saved["model"])
    opt2 = MOGA(resumed, lr=LR, preset="paper")
    sched2 = CosineAnnealingLR(opt2, T_max=6, eta_min=1e-4)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    keys = ("lr", "initial_lr", "lr_multiplier", "preset", "nesterov")
    assert [[g[k] for k in keys] for g in opt2.param_groups] == [[g[k] for k in keys] for g in opt.param_groups]
    assert {g["nesterov"] for g in opt2.param_groups} == {True}
    table = str(opt2.plan).splitlines()  # the printed plan follows the loaded groups
    assert "0.25" in table[2] and table[-2].startswith("momentum: EMA 0.9, Nesterov")
    for _ in range(2):
        run_gpt(model, opt, 1)
        sched.step()
        run_gpt(resumed, opt2, 1)
        sched2.step()
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
