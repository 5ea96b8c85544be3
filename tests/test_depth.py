"""Inverse-depth residual scaling as a tool: alpha, foreign models, removal, deepcopy, state_dict."""

import copy
import fnmatch
import io

import pytest
import torch
from torch import nn

from moga.depth import (
    ResidualScale,
    remove_residual_scaling,
    residual_alpha,
    residual_blocks,
    residual_scales,
    scale_residual_branches,
)
from moga.models import GPT, CifarResNet, ResidualMLP


class PlainBlock(nn.Module):
    """A residual block this library knows nothing about."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class PlainNet(nn.Module):
    def __init__(self, width=8, depth=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(PlainBlock(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def hand_scaled(alpha: float, x: torch.Tensor, depth: int = 4) -> torch.Tensor:
    """``y_k = y_{k-1} + alpha f_k(y_{k-1})`` written out on an unscaled PlainNet with the same weights."""
    for layer in PlainNet(depth=depth).layers:
        x = x + alpha * layer.mlp(layer.norm(x))
    return x


def test_residual_alpha():
    assert residual_alpha(2) == 1.0  # K = K_base: the tuned reference network itself
    assert residual_alpha(64) == 2 / 64
    assert residual_alpha(8, k_base=4) == 0.5
    assert residual_alpha(8, beta=1) == 1 / 8
    assert residual_alpha(64, mode="none") == 1.0
    for kwargs, word in [(dict(depth=0), "depth"), (dict(depth=2.5), "depth"), (dict(depth=True), "depth"),
                         (dict(depth=4, mode="sqrt"), "mode"), (dict(depth=4, k_base=0), "k_base"),
                         (dict(depth=4, beta=float("nan")), "beta")]:
        with pytest.raises(ValueError, match=word):
            residual_alpha(**kwargs)


class StackBlock(nn.Module):
    """A residual block whose add is a stack and a sum: no residual add to find. Its branch ends in a norm."""

    def __init__(self, width):
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return torch.stack([x, self.norm(self.fc(x))]).sum(0)


def stack_net(width=8, depth=3):
    torch.manual_seed(0)
    return nn.Sequential(*(StackBlock(width) for _ in range(depth)))


def test_blocks_are_found_from_the_forward():
    net, x = PlainNet(depth=4), torch.randn(3, 8)
    assert residual_blocks(net) == {f"layers.{i}": [f"layers.{i}.mlp"] for i in range(4)}
    handle = scale_residual_branches(net)  # K = 4 blocks found, alpha = 2/4, probed on a derived input
    assert handle.depth == 4 and handle.alpha == 0.5 and handle.blocks == tuple(f"layers.{i}" for i in range(4))
    torch.testing.assert_close(net(x), hand_scaled(0.5, x))
    # One branch per block and a 2-layer MLP: the contribution is exactly linear in alpha.
    assert handle.probe_alpha == 2 ** -4 and all(abs(r - 1) < 1e-4 for r in handle.measured.values())


def test_unfound_blocks_are_an_error_that_says_how_to_name_them():
    with pytest.raises(ValueError, match=r"found no residual branches in Sequential.*branches=\[") as info:
        scale_residual_branches(stack_net())
    assert "residual_branches()" in str(info.value) and "'0.fc'" in str(info.value)
    shared = PlainNet(depth=1)
    shared.layers = nn.ModuleList([shared.layers[0]] * 3)  # one block, three calls
    with pytest.raises(ValueError, match=r"In layers.0, it ran 3 times in one forward"):
        scale_residual_branches(shared)
    with pytest.raises(ValueError, match="depth=K"):
        scale_residual_branches(PlainNet(), branches=["layers.*.mlp"])  # what K counts is the user's to say
    with pytest.raises(ValueError, match="matches no module"):
        scale_residual_branches(PlainNet(), 0.5, branches=["blocks.*.mlp"])


def test_named_branches_are_measured_where_no_add_is_found():
    net, x = stack_net(), torch.randn(3, 8)
    unscaled = net(x)
    handle = scale_residual_branches(net, depth=3, branches=["*.norm"])  # right: verified by the ratio alone
    assert handle.blocks == ("0", "1", "2") and all(abs(r - 1) < 1e-4 for r in handle.measured.values())
    handle.remove()
    # The norm undoes a scale on fc: the block's contribution does not shrink, and the call says so.
    with pytest.raises(ValueError, match=r"block 0: with branches \['0.fc'\] scaled by alpha = 0.0625, its "
                                         r"contribution .* is 0\.99\d* times the unscaled one"):
        scale_residual_branches(net, depth=3, branches=["*.fc"])
    assert residual_scales(net) == {}  # nothing left behind
    torch.testing.assert_close(net(x), unscaled)


class PostActivationBlock(nn.Module):
    """relu(x + W x), a post-activation ResNet block in one line: the ReLU after the add bends the contribution."""

    def __init__(self, width, gain):
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(-gain * torch.eye(width))

    def forward(self, x):
        return torch.relu(x + self.fc(x))


def test_a_nonlinearity_after_the_add_is_not_mistaken_for_a_misplaced_scale():
    """On a positive input the block's contribution is -min(alpha * 3, 1) x: the full branch is clipped at -x,
    a scaled one is not, so the measured ratio is 3, not 1. A CIFAR ResNet-66 block at seed 2 measured 2.04
    at alpha 2^-2, and the old tolerance (a factor 2 at any probe alpha) refused a model scaled right."""
    net, x = nn.Sequential(PostActivationBlock(8, gain=3.0)), torch.rand(4, 8) + 0.5
    handle = scale_residual_branches(net, depth=8, example_input=x)  # alpha = 2/8, probed at 2^-4
    assert handle.alpha == 0.25 and handle.probe_alpha == 2 ** -4
    assert handle.measured["0"] == pytest.approx(3.0)
    torch.testing.assert_close(net(x), torch.relu(x - 0.75 * x))


def test_a_failed_call_leaves_earlier_scales_and_modes_as_they_were():
    net, x = PlainNet(), torch.randn(3, 8)
    scale_residual_branches(net, 0.25)
    before, state = net(x), torch.random.get_rng_state()
    net.train()
    with pytest.raises(ValueError, match="block layers.0"):
        scale_residual_branches(net, 0.5, branches=["layers.*.mlp.0"])  # a Linear before the Tanh
    assert set(residual_scales(net).values()) == {0.25} and set(residual_scales(net)) == {
        f"layers.{i}.mlp.2" for i in range(4)}
    assert net.training and all(m.training for m in net.modules()) and torch.is_grad_enabled()
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe input has its own generator
    torch.testing.assert_close(net(x), before)


def test_zero_initialized_branches_cannot_be_verified_unless_told():
    net = PlainNet()
    for layer in net.layers:
        nn.init.zeros_(layer.mlp[2].weight)
        nn.init.zeros_(layer.mlp[2].bias)
    with pytest.raises(ValueError, match="block layers.0 contributes nothing measurable.*verify=False"):
        scale_residual_branches(net, depth=4, branches=["layers.*.mlp"])
    handle = scale_residual_branches(net, depth=4, branches=["layers.*.mlp"], verify=False)
    assert handle.measured == {} and set(residual_scales(net).values()) == {0.5}


def test_on_the_meta_device_the_structure_is_still_checked():
    with torch.device("meta"):
        net = PlainNet()
        handle = scale_residual_branches(net)
        with pytest.raises(ValueError, match=r"block layers.0: a residual add takes the output of mlp, which is not"):
            scale_residual_branches(net, 0.5, branches=["layers.*.mlp.0"])
    assert handle.depth == 4 and handle.measured == {}  # no values: no ratios
    assert set(residual_scales(net).values()) == {0.5}


def test_the_probe_input_is_derived_or_given():
    class TakesTwo(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = PlainNet()

        def forward(self, x, shift):
            return self.body(x + shift)

    model = TakesTwo()
    with pytest.raises(ValueError, match=r"unscaled probe forward of TakesTwo failed .*example_input="):
        scale_residual_branches(model)
    x = torch.randn(3, 8)
    for example in [(x, 1.0), {"x": x, "shift": 1.0}]:
        handle = scale_residual_branches(model, example_input=example)
        assert handle.depth == 4 and len(handle.measured) == 4


def test_named_branches_of_a_foreign_model_equal_the_hand_scaled_reference():
    net, x = PlainNet(depth=4), torch.randn(3, 8)
    unscaled = net(x)
    handle = scale_residual_branches(net, branches=["layers.*.mlp"], depth=4)
    assert handle.alpha == 0.5 and len(handle.branches) == 4
    # A Sequential branch is scaled at its last module, whose output is the branch's output.
    assert handle.branches[0] == "layers.0.mlp.2" and isinstance(net.layers[0].mlp[2].residual_scale, ResidualScale)
    torch.testing.assert_close(net(x), hand_scaled(0.5, x))
    handle.remove()
    assert residual_scales(net) == {} and not net.layers[0].mlp[2]._forward_hooks
    torch.testing.assert_close(net(x), unscaled)


def test_alpha_is_set_not_compounded():
    net, x = PlainNet(), torch.randn(3, 8)
    scale_residual_branches(net, 0.5, branches=[layer.mlp for layer in net.layers])
    scale_residual_branches(net, 0.25, branches=["layers.*.mlp"])
    assert set(residual_scales(net).values()) == {0.25}
    assert sum(len(layer.mlp[2]._forward_hooks) for layer in net.layers) == 4
    torch.testing.assert_close(net(x), hand_scaled(0.25, x))


def test_tuple_outputs_scale_their_first_element():
    class Attention(nn.Module):
        def forward(self, x):
            return x, torch.ones(2)

    scale = ResidualScale(0.5)
    out, weights = scale(Attention()(torch.ones(3)))
    assert torch.equal(out, torch.full((3,), 0.5)) and torch.equal(weights, torch.ones(2))


def test_survives_deepcopy_and_removal_on_the_copy():
    net, x = PlainNet(), torch.randn(3, 8)
    scale_residual_branches(net, 0.5, branches=["layers.*.mlp"])
    clone = copy.deepcopy(net)
    torch.testing.assert_close(clone(x), hand_scaled(0.5, x))
    scale_residual_branches(clone, 0.1, branches=["layers.*.mlp"])  # the copy has its own scales
    assert set(residual_scales(net).values()) == {0.5}
    torch.testing.assert_close(clone(x), hand_scaled(0.1, x))
    assert len(remove_residual_scaling(clone)) == 4
    torch.testing.assert_close(clone(x), hand_scaled(1.0, x))
    torch.testing.assert_close(net(x), hand_scaled(0.5, x))


def test_state_dict_carries_alpha_and_parameter_names_are_unchanged():
    net, x = PlainNet(), torch.randn(3, 8)
    names = set(net.state_dict())
    scale_residual_branches(net, 0.5, branches=["layers.*.mlp"])
    state = net.state_dict()
    assert {k for k in state if k not in names} == {f"layers.{i}.mlp.2.residual_scale._extra_state" for i in range(4)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = PlainNet()
    scale_residual_branches(fresh, 1.0, branches=["layers.*.mlp"])
    fresh.load_state_dict(loaded)  # restores the saved alpha, whatever the receiver had
    assert set(residual_scales(fresh).values()) == {0.5}
    torch.testing.assert_close(fresh(x), net(x))
    with pytest.raises(RuntimeError, match="residual_scale"):
        PlainNet().load_state_dict(loaded)  # an unscaled receiver would compute another function


def test_pickled_model_keeps_its_scaling():
    model, x = ResidualMLP(6, 2, width=8, depth=4, alpha=0.5, seed=0), torch.randn(3, 6)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x))
    assert set(residual_scales(loaded).values()) == {0.5}


def test_this_projects_blocks_are_known():
    model, x = ResidualMLP(6, 2, width=8, depth=8, seed=0), torch.randn(3, 6)
    assert list(residual_blocks(model)) == [f"blocks.{i}" for i in range(8)]
    unscaled = model(x)
    handle = scale_residual_branches(model)  # K = 8 blocks found, alpha = K_base / K
    assert handle.depth == 8 and handle.alpha == 0.25 and model.alpha == 0.25
    assert not torch.allclose(model(x), unscaled)
    handle.remove()
    torch.testing.assert_close(model(x), unscaled)


class TorchvisionStyleBlock(nn.Module):
    """torchvision's BasicBlock, written out: ``out += identity`` after bn2, a projection shortcut."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        out += identity
        return torch.relu(out)


def test_convolutional_blocks_with_projection_shortcuts():
    def build():
        torch.manual_seed(0)
        blocks = [TorchvisionStyleBlock(3, 4, 1), TorchvisionStyleBlock(4, 4, 1), TorchvisionStyleBlock(4, 8, 2)]
        return nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), *blocks).eval()

    model, reference, x = build(), build(), torch.randn(2, 3, 8, 8)
    handle = scale_residual_branches(model)  # the shortcut costs one conv, the branch two: bn2 ends the branch
    assert handle.branches == ("1.bn2", "2.bn2", "3.bn2") and handle.alpha == 2 / 3
    with torch.no_grad():
        for i in (1, 2, 3):
            reference[i].bn2.weight.mul_(2 / 3)
            reference[i].bn2.bias.mul_(2 / 3)
        torch.testing.assert_close(model(x), reference(x))


@pytest.mark.parametrize("build", [
    lambda: ResidualMLP(6, 2, width=8, depth=3, seed=0),
    lambda: GPT(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8),
    lambda: GPT(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8, style="llama"),
    lambda: CifarResNet((1, 1), base_channels=4, num_classes=3, seed=0),
], ids=["residual_mlp", "gpt2", "gpt_llama", "resnet"])
def test_this_projects_declared_branches_agree_with_the_trace(build):
    model = build()
    declared = residual_blocks(model)
    assert declared and residual_blocks(model, declared=False) == declared


# --- foreign libraries ---------------------------------------------------------------------------------


@pytest.fixture
def resnet_module():
    pytest.importorskip("torchvision", reason="torchvision is not installed in this environment; run "
                        "tests/test_depth.py with a torch + torchvision environment to check its ResNets",
                        exc_type=ImportError)
    from torchvision.models import resnet

    return resnet


@pytest.mark.parametrize("block,last", [("BasicBlock", "bn2"), ("Bottleneck", "bn3")])
def test_torchvision_resnet(resnet_module, block, last):
    def build():
        torch.manual_seed(0)
        return resnet_module.ResNet(getattr(resnet_module, block), [1, 2, 1, 1], num_classes=5).eval()

    model, reference, x = build(), build(), torch.randn(2, 3, 32, 32)
    handle = scale_residual_branches(model)
    assert handle.depth == 5 and handle.alpha == 2 / 5
    assert all(name.endswith(last) for name in handle.branches)  # the branch ends just before out += identity
    with torch.no_grad():  # hand-scaled: the branch's last BatchNorm times alpha; downsample untouched
        for m in reference.modules():
            if isinstance(m, getattr(resnet_module, block)):
                getattr(m, last).weight.mul_(2 / 5)
                getattr(m, last).bias.mul_(2 / 5)
        expected = reference(x)
        torch.testing.assert_close(model(x), expected)
        receiver = build()
        scale_residual_branches(receiver, 1.0)
        receiver.load_state_dict(model.state_dict())
        torch.testing.assert_close(receiver(x), expected)


def test_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                       "moga[hf]); it is needed only to check Hugging Face's GPT2Block",
                                       exc_type=ImportError)

    def build():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64, n_positions=16)
        return transformers.GPT2Model(config).eval()

    model, reference = build(), build()
    idx = torch.randint(0, 64, (2, 16))
    handle = scale_residual_branches(model)
    assert handle.depth == 3 and handle.alpha == 2 / 3  # K counts blocks; both sub-blocks get alpha
    assert handle.branches == ("h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp", "h.2.attn", "h.2.mlp")
    with torch.no_grad():
        for block in reference.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.mul_(2 / 3)
                proj.bias.mul_(2 / 3)
        expected = reference(idx).last_hidden_state
        torch.testing.assert_close(model(idx).last_hidden_state, expected)
        receiver = build()
        scale_residual_branches(receiver, 1.0)
        receiver.load_state_dict(model.state_dict())
        torch.testing.assert_close(receiver(idx).last_hidden_state, expected)


# Hugging Face blocks: (family, modules that end each branch, scaled by hand in the reference)
HF_BRANCH_ENDS = {
    "llama": ("self_attn.o_proj", "mlp.down_proj"),
    "mistral": ("self_attn.o_proj", "mlp.down_proj"),
    "qwen2_tied": ("self_attn.o_proj", "mlp.down_proj"),
    "bert": ("attention.output.dense", "layer.*.output.dense"),
    "vit": ("attention.o_proj", "mlp.fc2", "attention.output.dense", "layer.*.output.dense"),  # 5.x, 4.x
    "t5": ("SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"),
}


@pytest.mark.parametrize("family", HF_BRANCH_ENDS)
def test_hugging_face_blocks_are_known(family):
    """Each block computes x + alpha * branch(x): the scaled model equals one whose branch-ending layers
    are multiplied by alpha by hand (alpha is linear in those layers' weights and biases)."""
    from tests.integrations.hf_zoo import batch, build

    model, reference, layers = build(family, layers=3).eval(), build(family, layers=3).eval(), 3
    blocks = 2 * layers if family == "t5" else layers  # T5: encoder and decoder blocks together
    handle = scale_residual_branches(model)
    assert handle.depth == blocks and handle.alpha == 2 / blocks
    per_block = 3 if family == "t5" else 2
    assert len(handle.branches) == per_block * blocks - (layers if family == "t5" else 0)  # encoders: no cross-attn
    ends = [n for n, _ in reference.named_modules()
            if any(fnmatch.fnmatchcase(n, "*." + pattern) for pattern in HF_BRANCH_ENDS[family])]
    assert len(ends) == len(handle.branches)
    with torch.no_grad():
        for name in ends:
            for p in reference.get_submodule(name).parameters():
                p.mul_(2 / blocks)
        inputs = {k: v for k, v in batch(family).items() if k != "labels" or family == "t5"}
        expected = reference(**inputs).logits
        torch.testing.assert_close(model(**inputs).logits, expected)
        assert not torch.allclose(build(family, layers=3).eval()(**inputs).logits, expected)  # alpha did something
