"""Role plans of unmodified models, overrides, and the errors that replace silent guesses."""

import pytest
import torch
from torch import nn

from moga.roles import PlanError, build_plan


def test_mlp_roles_and_table():
    mlp = nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 3))
    plan = build_plan(mlp)
    assert plan.roles() == {
        "0.weight": "input", "0.bias": "vector", "2.weight": "hidden", "2.bias": "vector",
        "3.weight": "vector", "3.bias": "vector", "4.weight": "readout", "4.bias": "vector",
    }
    text = str(plan)
    assert "4.weight" in text and "readout" in text and "row(p=2)" in text and "3x32" in text
    groups = plan.param_groups(lr=0.1)
    assert {g["role"] for g in groups} == {"input", "hidden", "readout", "vector"}
    assert all(g["lr"] == 0.1 for g in groups)
    assert sum(len(g["params"]) for g in groups) == 8


def test_transformer_encoder_layers_are_hidden():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 3, enable_nested_tensor=False)
    plan = build_plan(enc)
    matrices = {e.name: e for e in plan if e.role != "vector"}
    assert len(matrices) == 12 and all(e.role == "hidden" for e in matrices.values())
    assert matrices["layers.0.self_attn.in_proj_weight"].matrix_shape == (48, 16)
    assert matrices["layers.2.linear2.weight"].matrix_shape == (16, 32)


def test_conv_layouts():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ConvTranspose2d(8, 4, 2), nn.Flatten(), nn.LazyLinear(5))
    net(torch.zeros(1, 3, 8, 8))  # materialize the lazy layer
    plan = build_plan(net)
    assert plan["0.weight"].role == "conv" and plan["0.weight"].layout == "oiii"
    assert plan["0.weight"].matrix_shape == (8, 27)
    assert plan["1.weight"].layout == "ioii" and plan["1.weight"].matrix_shape == (4, 32)
    assert plan["3.weight"].role == "readout"


def test_embeddings_are_transposed_tables():
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 50))
    e = build_plan(model)["0.weight"]
    assert (e.role, e.layout, e.matrix_shape, e.geometry) == ("embedding", "io", (8, 50), "embedding(q=2)")


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(30, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.lm_head = nn.Linear(8, 30, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, t):
        h = self.wte(t)
        for b in self.blocks:
            h = h + b(h)
        return self.lm_head(h)


def test_tied_weight_gets_the_tied_role_and_the_plan_says_why():
    plan = build_plan(TiedLM())
    tied = plan["lm_head.weight"]
    assert tied.name == "wte.weight" and tied.aliases == ("lm_head.weight",)
    assert (tied.role, tied.layout, tied.matrix_shape, tied.geometry) == ("tied", "oi", (30, 8), "row(p=2)")
    assert len(plan) == 5  # one entry for the shared tensor
    assert plan["blocks.1.weight"].role == "hidden"  # the head is the tied tensor: no other readout
    (note,) = [line for line in str(plan).splitlines() if line.startswith("note:")]
    assert "wte (Embedding)" in note and "lm_head (Linear)" in note and "row(p=2)" in note and "30x8" in note
    assert plan.rows()[0]["reason"] == note.removeprefix("note: ")
    # Overrides still win, and then the plan has nothing to explain.
    as_embedding = build_plan(TiedLM(), overrides={"lm_head.weight": "embedding"})
    assert (as_embedding["wte.weight"].role, as_embedding["wte.weight"].layout) == ("embedding", "io")
    assert "note:" not in str(as_embedding)
    sign = build_plan(TiedLM(), geometries={"tied": "sign"})["wte.weight"]
    assert (sign.role, sign.geometry) == ("tied", "sign")


class TwoHeads(nn.Module):
    """One table read by two dense layers in opposite orientations: no rule can pick one."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(8, 8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight = self.wte.weight
        self.c = Conv1DLike(self.wte.weight)


class Conv1DLike(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight


Conv1DLike.__name__ = "Conv1D"  # Hugging Face's (in, out) dense layer


def test_a_tensor_used_in_two_orientations_is_still_an_error():
    with pytest.raises(PlanError, match=r"shared as .*overrides=\{'wte.weight': 'tied'\}"):
        build_plan(TwoHeads())


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.w = nn.Parameter(torch.randn(4, 16, 8))
        self.out = nn.Linear(16, 2)

    def forward(self, x):  # x: (tokens, 8); expert e is the (16 x 8) matrix w[e]
        gates = self.router(x).softmax(-1)
        return self.out(sum(gates[:, e, None] * (x @ self.w[e].T) for e in range(4)))


def test_unorientable_tensor_is_an_error_and_the_forward_says_which_override_fixes_it():
    # Without inputs moga cannot run the forward, so it suggests nothing and says how to let it check.
    with pytest.raises(PlanError, match=r"(?s)cannot place 1 parameter.*example_inputs=.*# 'w': \?,.*\(4, 16, 8\), "
                                        r"on Experts: cannot tell \(no example inputs"):
        build_plan(Experts())
    x = torch.randn(3, 8)
    with pytest.raises(PlanError, match=r"(?s)run once on the example inputs.*'w': 'hidden:boi',.*a matrix product "
                                        r"reads it as boi"):
        build_plan(Experts(), example_inputs=x)
    plan = build_plan(Experts(), overrides={"w": "hidden:boi"})
    assert plan["w"].matrix_shape == (16, 8) and plan["w"].layout == "boi"
    with pytest.raises(PlanError, match="needs a layout"):
        build_plan(Experts(), overrides={"w": "hidden"})


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 5))  # a gate bias, added elementwise
        self.b = nn.Parameter(torch.randn(2, 8, 3))  # two (in, out) matrices, applied as x @ b[k]
        self.c = nn.Parameter(torch.randn(5, 3))  # reshaped before use: moga does not follow it
        self.unused = nn.Parameter(torch.randn(2, 2))

    def forward(self, x):  # x: (batch, 8)
        h = torch.einsum("nki,kio->nko", x[:, None].expand(-1, 2, -1), self.b)  # matrix k on the k-th copy
        return h[:, :, :, None] + self.a + self.c.reshape(3, 5)


def test_every_unplaced_tensor_is_listed_at_once_with_one_glob_per_group_and_its_use():
    blocks = nn.ModuleList([Experts(), Experts(), Experts()])
    model = nn.Module()
    model.blocks, model.odd = blocks, Odd()
    with pytest.raises(PlanError) as err:
        build_plan(model)
    text = str(err.value)
    assert text.startswith("cannot place 7 parameter(s)")
    assert "# 'blocks.*.w': ?," in text and "# 3 tensors, (4, 16, 8), on Experts: cannot tell" in text

    with pytest.raises(PlanError) as err:
        build_plan(model.odd, example_inputs=torch.randn(2, 8))
    text = str(err.value)
    assert "'a': 'vector'," in text and "'b': 'hidden:bio'," in text  # k a batch axis, i contracted
    assert "# 'c': ?," in text and "cannot tell (the forward uses it as unknown: reshape)" in text
    assert "# 'unused': ?," in text and "cannot tell (the forward did not use it)" in text
    # The printed suggestions, pasted, place what they name; the commented ones stay errors.
    plan = build_plan(model.odd, overrides={"a": "vector", "b": "hidden:bio", "c": "hidden:oi", "unused": "vector"})
    assert plan["b"].matrix_shape == (3, 8) and plan["a"].role == "vector"


def test_an_override_may_name_the_owning_module():
    model = nn.Module()
    model.blocks = nn.ModuleList([Experts(), Experts()])
    plan = build_plan(model, overrides={"*.0": "hidden:boi", "blocks.1": {"role": "hidden", "layout": "boi"}})
    assert plan["blocks.0.w"].layout == "boi" and plan["blocks.1.w"].layout == "boi"
    # A rule on a module covers its own parameters, not its children's: the router keeps its Linear layout.
    assert plan["blocks.0.router.weight"].role == "hidden" and plan["blocks.0.router.weight"].layout == "oi"


def test_a_layout_that_does_not_fit_names_the_parameter():
    with pytest.raises(PlanError, match=r"parameter 'router.weight' \(hidden, on Linear\): layout 'boi' has 3 axes "
                                        r"but the tensor has shape \(4, 8\).*e.g. 'oi' \(how its module reads it\)"):
        build_plan(Experts(), overrides={"router.weight": "hidden:boi", "w": "hidden:boi"})


def test_override_patterns_geometry_and_mistakes():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    plan = build_plan(mlp, overrides={"[12].weight": {"geometry": "col(q=2)"}, "*.bias": {"geometry": "vector"}})
    assert plan["1.weight"].geometry == "col(q=2)" and plan["2.weight"].geometry == "col(q=2)"
    assert plan["1.weight"].role == "hidden"
    assert plan["0.bias"].update == "lmo"
    with pytest.raises(PlanError, match="match no parameter"):
        build_plan(mlp, overrides={"blocks.*": "hidden"})
    with pytest.raises(PlanError, match="unknown role"):
        build_plan(mlp, overrides={"0.weight": "middle"})
    with pytest.raises(PlanError, match="unknown key"):
        build_plan(mlp, overrides={"0.weight": {"rol": "hidden"}})
    with pytest.raises(PlanError, match="sign geometry"):
        build_plan(mlp, geometries={"hidden": "adam:row(p=2)"})


class HeadFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 3)  # registered before the layer it reads from
        self.stem = nn.Linear(5, 8)

    def forward(self, x):
        return self.head(torch.relu(self.stem(x)))


def test_call_order_from_example_inputs():
    by_registration = build_plan(HeadFirst()).roles()
    assert by_registration["head.weight"] == "input"
    by_call = build_plan(HeadFirst(), example_inputs=torch.zeros(2, 5)).roles()
    assert by_call["stem.weight"] == "input" and by_call["head.weight"] == "readout"


def test_torchvision_resnet():
    torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed in this environment")
    plan = build_plan(torchvision.models.resnet18(num_classes=10))
    roles = plan.roles()
    assert roles["conv1.weight"] == "conv" and plan["conv1.weight"].matrix_shape == (64, 147)
    assert roles["layer1.0.conv1.weight"] == "conv" and roles["layer4.1.bn2.weight"] == "vector"
    assert roles["fc.weight"] == "readout"


def test_hugging_face_gpt2_from_config():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    plan = build_plan(model)  # the tied head needs no override
    assert plan["lm_head.weight"].role == "tied"
    c_fc = plan["transformer.h.0.mlp.c_fc.weight"]  # Conv1D stores (in, out)
    assert (c_fc.role, c_fc.layout, c_fc.matrix_shape) == ("hidden", "io", (128, 32))
    assert plan["transformer.wpe.weight"].role == "embedding"
    assert plan["transformer.h.1.ln_2.bias"].role == "vector"


class NanoGPTLayout(nn.Module):
    """nanoGPT keeps its input layers in a ModuleDict beside the repeated blocks."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(20, 8), h=nn.ModuleList(nn.Linear(8, 8) for _ in range(3)), proj=nn.Linear(8, 8)))
        self.lm_head = nn.Linear(8, 20)


def test_module_dict_is_a_container_not_a_repeated_block():
    roles = build_plan(NanoGPTLayout()).roles()
    assert roles["transformer.h.2.weight"] == "hidden"
    assert roles["transformer.wte.weight"] == "embedding"
    assert roles["lm_head.weight"] == "readout"


class TwoTowers(nn.Module):
    """A contrastive model: two towers and a root scalar temperature (CLIP's logit_scale)."""

    def __init__(self):
        super().__init__()
        self.text = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        self.image = nn.Linear(6, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))


def test_a_contrastive_model_declares_its_multipliers_and_the_users_win():
    """A root scalar temperature (CLIP's logit_scale) makes the plan step vectors and tables at 1/8 of the lr,
    printed with the reason; a model without one gets none; an optimizer's lr_multipliers win role by role."""
    from moga.optim import MOGA

    model = TwoTowers()
    plan = build_plan(model)
    assert plan.lr_multipliers == {"embedding": 0.125, "vector": 0.125}
    assert "note: learning rate embedding x0.125, vector x0.125: a contrastive model" in str(plan)
    lrs = {g["role"]: g["lr"] for g in MOGA(model, lr=0.1).param_groups}
    assert lrs == pytest.approx({"embedding": 0.0125, "vector": 0.0125, "hidden": 0.1, "readout": 0.1})
    lrs = {g["role"]: g["lr"] for g in MOGA(model, lr=0.1, lr_multipliers={"vector": 1}).param_groups}
    assert lrs["vector"] == 0.1 and lrs["embedding"] == pytest.approx(0.0125)
    del model.logit_scale
    assert build_plan(model).lr_multipliers == {} and "learning rate" not in str(build_plan(model))
    assert {g["lr"] for g in MOGA(model, lr=0.1, preset="paper").param_groups} == {0.1}
    lrs = {g["role"]: g["lr"] for g in MOGA(model, lr=0.1).param_groups}  # MOGA's default preset alone
    assert lrs == pytest.approx({"embedding": 0.1 / 16, "vector": 0.1, "hidden": 0.1, "readout": 0.1})


def test_a_contrastive_models_multipliers_win_over_moga_presets(monkeypatch):
    """Defaults stack: the preset's, then the model kind's (a contrastive model's 1/8), then the user's."""
    from moga.optim import MOGA
    from moga.optim.multipliers import PRESETS, Preset

    monkeypatch.setitem(PRESETS, "default", Preset({"embedding": 0.0625, "readout": 0.5}))
    multipliers = {g["role"]: g["lr_multiplier"] for g in MOGA(TwoTowers(), lr=0.1).param_groups}
    assert multipliers == {"embedding": 0.125, "vector": 0.125, "hidden": 1.0, "readout": 0.5}
    multipliers = {g["role"]: g["lr_multiplier"]
                   for g in MOGA(TwoTowers(), lr=0.1, lr_multipliers={"embedding": 2.0}).param_groups}
    assert multipliers == {"embedding": 2.0, "vector": 0.125, "hidden": 1.0, "readout": 0.5}
