"""The residual patterns people write, each found, scaled and proven: the add in the model's own loop over
plain branches (automatically and with branches=), and blocks with their own forward: pre-norm, post-norm,
parallel residual. Each is checked against the same model scaled by hand."""

import pytest
import torch
from torch import nn

from moga.depth import residual_blocks, scale_residual_branches

W, K = 8, 3


def mlp():
    return nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W))


class ParentLoop(nn.Module):
    """``for f in self.blocks: h = h + f(h)``, each f a plain Sequential; ``norm`` adds a pre-norm."""

    def __init__(self, norm=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(mlp() for _ in range(K))
        self.norms = nn.ModuleList(nn.LayerNorm(W) if norm else nn.Identity() for _ in range(K))
        self.head = nn.Linear(W, 2)

    def forward(self, h, alpha=1.0):  # alpha: the hand-scaled reference
        for f, norm in zip(self.blocks, self.norms):
            h = h + alpha * f(norm(h))
        return self.head(h)


class PreNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(W), mlp()

    def forward(self, x, alpha=1.0):
        return x + alpha * self.mlp(self.norm(x))


class PostNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(W), mlp()

    def forward(self, x, alpha=1.0):
        return self.norm(x + alpha * self.mlp(x))


class Parallel(nn.Module):
    """GPT-J's block: one add of the sum of attention-like and MLP branches on the same normed input."""

    def __init__(self):
        super().__init__()
        self.norm, self.mix, self.mlp = nn.LayerNorm(W), nn.Linear(W, W), mlp()

    def forward(self, x, alpha=1.0):
        y = self.norm(x)
        return x + alpha * self.mix(y) + alpha * self.mlp(y)


class Stack(nn.Module):
    def __init__(self, block):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block() for _ in range(K))

    def forward(self, x, alpha=1.0):
        for layer in self.layers:
            x = layer(x, alpha)
        return x


CASES = {  # model, its branches
    "parent loop": (lambda: ParentLoop(), [f"blocks.{i}" for i in range(K)]),
    "parent loop, pre-norm": (lambda: ParentLoop(norm=True), [f"blocks.{i}" for i in range(K)]),
    "pre-norm": (lambda: Stack(PreNorm), [f"layers.{i}.mlp" for i in range(K)]),
    "post-norm": (lambda: Stack(PostNorm), [f"layers.{i}.mlp" for i in range(K)]),
    "parallel": (lambda: Stack(Parallel), [n for i in range(K) for n in (f"layers.{i}.mix", f"layers.{i}.mlp")]),
}
PATTERNS = {"parent loop": "blocks.*", "parent loop, pre-norm": "blocks.*", "pre-norm": "layers.*.mlp",
            "post-norm": "layers.*.mlp", "parallel": "layers.*.m[il]*"}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("named", [False, True], ids=["found", "named"])
def test_found_scaled_and_proven_as_by_hand(case, named):
    build, branches = CASES[case]
    model, x = build(), torch.randn(4, W)
    if named:
        handle = scale_residual_branches(model, depth=K, branches=[PATTERNS[case]])
    else:
        assert sorted(n for names in residual_blocks(model).values() for n in names) == sorted(branches)
        handle = scale_residual_branches(model)
    assert handle.depth == K and handle.alpha == 2 / K and len(handle.measured) == K
    assert all(abs(r - 1) < 0.3 for r in handle.measured.values()), handle.measured
    reference = build()
    torch.testing.assert_close(model(x), reference(x, alpha=2 / K))
    handle.remove()
    torch.testing.assert_close(model(x), reference(x))


class Gated(nn.Module):
    """``h = h + f(h).tanh()``: the branch is bent after its module, so no scale on the module is alpha."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(mlp() for _ in range(K))

    def forward(self, h):
        for f in self.blocks:
            h = h + f(h).tanh()
        return h


def test_a_parent_loop_refusal_says_what_would_work():
    with pytest.raises(ValueError, match=r"found no residual branches.*branches=\[") as info:
        scale_residual_branches(Gated())
    assert "residual_branches()" in str(info.value)
    with pytest.raises(ValueError, match=r"not added to its own input.*Move the ops between into the branch module.*verify=False") as info:
        scale_residual_branches(Gated(), depth=K, branches=["blocks.*"])
    with pytest.raises(ValueError, match=r"names no module in block\(s\) \['layers.1', 'layers.2'\].*"
                                         r"name a branch in each: \['layers.1.mlp', 'layers.2.mlp'\]"):
        scale_residual_branches(Stack(PreNorm), depth=K, branches=["layers.0.mlp"])
    shared = Stack(PreNorm)
    shared.layers = nn.ModuleList([shared.layers[0]] * K)  # one block, K calls: no scale on it can be checked
    with pytest.raises(ValueError, match=r"cannot verify block layers.0: .*Name branches that lie in blocks.*"
                                         r"verify=False"):
        scale_residual_branches(shared, depth=K, branches=["layers.0.mlp"])
