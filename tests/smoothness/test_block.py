"""The block norm of a plan: max of the per-parameter norms, sum of the dual norms, per-parameter LMOs."""

import pytest
import torch

from moga.geometry import Spectral
from moga.optim import MOGA, Muon
from moga.roles import build_plan
from moga.smoothness import BlockGeometry, inner

from .nets import MIXED_OVERRIDES, MixedNet


@pytest.fixture
def mixed():
    torch.manual_seed(0)
    return MixedNet()


def test_block_norm_dual_and_lmo(mixed):
    block = BlockGeometry.from_model(mixed, overrides=MIXED_OVERRIDES)
    gen = torch.Generator().manual_seed(1)
    g = [torch.randn(p.shape, generator=gen) for p in block.params]
    assert block.norm(g) == max(block.norms(g))
    assert block.dual_norm(g) == pytest.approx(sum(block.dual_norms(g)))
    d = block.lmo(g)
    # Every block takes its own unit step: the block norm is 1 and so is each parameter's.
    assert block.norm(d) == pytest.approx(1.0, rel=1e-9)
    assert block.norms(d) == pytest.approx([1.0] * len(block), rel=1e-9)
    assert inner(g, d) == pytest.approx(-block.dual_norm(g), rel=1e-9)
    assert inner(g, block.ascent(g)) == pytest.approx(block.dual_norm(g), rel=1e-9)
    u = block.random_unit(gen)
    assert block.norm(u) == pytest.approx(1.0)


def test_geometries_and_exact_lmo(mixed):
    plan = build_plan(mixed, overrides=MIXED_OVERRIDES)
    block = BlockGeometry.from_plan(plan)
    geoms = {e.name: e.geometry for e in block}
    assert str(geoms["conv.weight"]) == "col(q=2)" and str(geoms["mix.weight"]) == "sign"
    assert isinstance(geoms["head.weight"], Spectral) and geoms["head.weight"].method == "svd"
    assert BlockGeometry.from_plan(plan, exact=False).entries[-2].geometry.method == "newton_schulz"
    assert {e.name: e.update for e in block}["head.bias"] == "adam"  # adam:vector: the l_inf norm
    assert str(geoms["head.bias"]) == "vector"


def test_from_optimizer_matches_plan(mixed):
    opt = MOGA(mixed, lr=0.1, overrides=MIXED_OVERRIDES)
    from_opt = BlockGeometry.from_optimizer(opt)
    from_plan = BlockGeometry.from_plan(opt.plan)
    assert sorted(from_opt.names) == sorted(from_plan.names)
    by_name = {e.name: e for e in from_plan}
    for e in from_opt:
        assert str(e.geometry) == str(by_name[e.name].geometry) and e.layout == by_name[e.name].layout
        assert e.group is not None and e.role == by_name[e.name].role
    assert BlockGeometry.of(opt).names == from_opt.names
    assert BlockGeometry.of(opt.plan).names == from_plan.names
    # Plain torch-style params: names from the group index.
    lin = torch.nn.Linear(3, 4)
    muon = Muon([lin.weight], lr=0.1)
    (only,) = BlockGeometry.from_optimizer(muon).entries
    assert only.name == "group0.param0" and only.geometry.method == "svd" and only.layout == "oi"


def test_bad_inputs_are_named():
    p = torch.nn.Parameter(torch.zeros(2, 3, 4))
    from moga.smoothness import BlockEntry
    from moga.geometry import Row

    with pytest.raises(ValueError, match="w: .*layout"):
        BlockGeometry([BlockEntry("w", p, Row(2))])
    block = BlockGeometry([BlockEntry("w", p, Row(2), "boi")])
    with pytest.raises(ValueError, match="expected 1 tensors"):
        block.norm([p, p])
    with pytest.raises(TypeError, match="RolePlan"):
        BlockGeometry.of("row")
