"""Grid expansion and the errors a bad sweep config gives before anything runs."""

import json

import pytest

from moga.sweep.spec import Sweep, SweepError, cell_id

BASE = {
    "model": {"name": "residual_mlp", "width": 8},
    "data": {"name": "digits"},
    "optim": {"name": "moga", "lr": 0.1},
    "train": {"steps": 3, "batch_size": 16},
}


def sweep(**spec):
    return Sweep.from_dict({"base": BASE, **spec})


def test_plain_and_dependent_axes_expand_in_order():
    s = sweep(
        axes={
            "optim.name": ["adamw", "moga"],
            "model.depth": [2, 8],
            "optim.lr": {"by": "optim.name", "values": {"adamw": [1e-3, 2e-3], "moga": {"pow2": [-3, -1]}}},
        },
        exclude=[{"optim.name": "adamw", "model.depth": 8}],
    )
    assert len(s.cells) == 2 * 1 + 2 * 3  # adamw only at depth 2; moga at both depths, three lrs each
    assert s.cells[0] == {"optim.name": "adamw", "model.depth": 2, "optim.lr": 1e-3}
    assert [c["optim.lr"] for c in s.cells if c["optim.name"] == "moga" and c["model.depth"] == 8] == [0.125, 0.25, 0.5]
    assert s.config(s.cells[-1]).optim.lr == 0.5 and s.config(s.cells[-1]).model.kwargs["depth"] == 8
    ids = [cell_id(c) for c in s.cells]
    assert len(set(ids)) == len(ids)
    assert ids == [cell_id(c) for c in sweep(**{k: v for k, v in s.spec.model_dump().items()
                                                if k in ("axes", "exclude")}).cells]


def test_overrides_apply_to_every_cell():
    s = sweep(overrides={"train.steps": 7}, axes={"optim.lr": [0.1, 0.2], "model.depth": [2]})
    assert all(s.config(c).train.steps == 7 for c in s.cells)


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"axes": {"optim.lrr": [0.1], "model.depth": [2]}}, "unknown key 'optim.lrr'"),
        ({"axes": {"optim.lr": ["fast"], "model.depth": [2]}}, "optim.lr"),
        ({"axes": {"optim.lr": [], "model.depth": [2]}}, "is empty"),
        ({"axes": {"optim.lr": 0.1, "model.depth": [2]}}, "must be a list"),
        ({"axes": {"optim.lr": [0.1, 0.1], "model.depth": [2]}}, "repeats"),
        ({"axes": {"optim.lr": [0.0625, "0.0625"], "model.depth": [2]}}, "mixes value types"),
        ({"axes": {"optim.lr": [0.1], "model.depth": [2, 2.0]}}, "repeats"),
        ({"axes": {"optim.lr": [0.1], "model.depth": [2]}, "name": "../../x"}, "single path component"),
        ({"axes": {"optim.lr": [0.1], "model.depth": [2]}, "name": "/tmp/x"}, "single path component"),
        ({"axes": {}}, "at least one axis"),
        ({"axes": {"optim.lr": [0.1], "model.depth": [2]}, "colour": "red"}, "unknown sweep key 'colour'"),
        ({"axes": {"optim.lr": {"pow2": [-1, -3]}, "model.depth": [2]}}, "lo <= hi"),
        ({"axes": {"optim.lr": {"pow2": [1020, 1030]}, "model.depth": [2]}},  # 2.0**1024 overflowed, raw
         r"pow2 exponents must lie in \[-1074, 1023\]"),
        ({"axes": {"optim.lr": {"pow2": [-1, True]}, "model.depth": [2]}}, "pow2 needs integers"),
        ({"axes": {"optim.name": ["moga"], "model.depth": [2],
                   "optim.lr": {"by": "optim.name", "values": {"adamw": [0.1]}}}}, "missing"),
        ({"axes": {"optim.lr": [0.1], "model.depth": [2]}, "exclude": [{"optim.lr": 0.1}]}, "every cell is excluded"),
        ({"axes": {"optim.lr": [0.1], "model.depth": [2]}, "exclude": [{"model.width": 8}]}, "not axes"),
        ({"axes": {"optim.lr": [0.1], "model.width": [8]}}, "'model.depth' is not an axis"),
        ({"axes": {"optim.lr": [0.1], "model.depth": [2], "model.dept": [1]}}, "model.dept"),
    ],
)
def test_bad_sweeps_fail_before_running(spec, match):
    with pytest.raises(SweepError, match=match):
        sweep(**spec)


def test_shipped_sweep_configs_are_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    configs = sorted([*(root / "sweeps").glob("*.yaml"), *(root / "research").glob("*.yaml")])
    assert len(configs) > 20
    for path in configs:
        assert Sweep.from_file(path).cells


def test_two_scale_keys():
    from moga.sweep.spec import Sweep, SweepError

    base = {"model": {"name": "residual_mlp", "width": 16}, "data": {"name": "digits"}, "train": {"steps": 2}}
    axes = {"model.width": [8, 16], "model.depth": [1, 2], "optim.lr": [0.1]}
    sweep = Sweep.from_dict({"base": base, "axes": axes, "scale_keys": ["model.width", "model.depth"]})
    assert sweep.spec.scale_key == "model.width" and sweep.spec.all_scale_keys == ["model.width", "model.depth"]
    with pytest.raises(SweepError, match="'model.n_layer' is not an axis"):
        Sweep.from_dict({"base": base, "axes": axes, "scale_keys": ["model.width", "model.n_layer"]})
    with pytest.raises(SweepError, match="must be the first of scale_keys"):
        Sweep.from_dict({"base": base, "axes": axes, "scale_key": "model.depth",
                         "scale_keys": ["model.width", "model.depth"]})


def test_a_role_lr_multiplier_is_a_sweep_axis():
    s = sweep(axes={"optim.lr": [0.1], "model.depth": [2], "optim.lr_multipliers.readout": [0.5, 2.0]},
              overrides={"optim.lr_multipliers": {"vector": 3.0}})
    assert [s.config(c).optim.lr_multipliers for c in s.cells] == [{"vector": 3.0, "readout": 0.5},
                                                                    {"vector": 3.0, "readout": 2.0}]
    with pytest.raises(SweepError, match="optim.lr_multipliers.head"):
        sweep(axes={"optim.lr": [0.1], "model.depth": [2], "optim.lr_multipliers.head": [0.5]})


def test_the_preset_is_a_sweep_axis():
    s = sweep(axes={"optim.lr": [0.1], "model.depth": [2], "optim.preset": ["paper", "default"]})
    assert [s.config(c).optim.preset for c in s.cells] == ["paper", "default"]
    with pytest.raises(SweepError, match="optim.preset: Input should be 'default', 'paper', 'muoneq', 'published' or 'moga'"):
        sweep(axes={"optim.lr": [0.1], "model.depth": [2], "optim.preset": ["papers"]})


def test_a_grid_too_large_to_run_is_refused_with_its_size_at_once():
    """A 10^6-cell grid spent minutes checking cells before saying anything; now a grid over MAX_CELLS is
    refused with its size before any cell is checked (kept just over the limit, so main fails in seconds)."""
    from moga.sweep.spec import MAX_CELLS

    axes = {"optim.lr": {"pow2": [-50, 50]}, "model.depth": list(range(1, 101))}
    with pytest.raises(SweepError, match=rf"more than {MAX_CELLS} cells: 101 optim.lr x 100 model.depth makes 10100"):
        sweep(axes=axes)
    dependent = {"optim.name": ["moga", "adamw"], "model.depth": list(range(1, 201)),
                 "optim.lr": {"by": "optim.name", "values": {"moga": {"pow2": [-40, 9]}, "adamw": [0.1]}}}
    with pytest.raises(SweepError, match="makes up to 20000 with the dependent axes"):
        sweep(axes=dependent)


def test_overrides_leave_the_callers_base_as_it_was():
    before = json.dumps(BASE, sort_keys=True)
    sweep(axes={"optim.lr": [0.1], "model.depth": [1]}, overrides={"optim.lr_multipliers": {"vector": 0.5}, "train.steps": 2})
    assert json.dumps(BASE, sort_keys=True) == before


def test_a_dependent_override_sets_a_key_on_the_cells_it_selects_without_changing_their_ids():
    axes = {"optim.name": ["adamw", "muon", "moga"], "model.depth": [2, 8], "optim.lr": [0.01]}
    pinned = sweep(axes=axes, overrides={"train.steps": 2,
                                         "optim.preset": {"by": "optim.name", "values": {"muon": "moga"}}})
    assert [cell_id(c) for c in pinned.cells] == [cell_id(c) for c in sweep(axes=axes).cells]
    presets = {(c["optim.name"], pinned.config(c).optim.preset) for c in pinned.cells}
    assert presets == {("adamw", None), ("muon", "moga"), ("moga", None)}
    assert {pinned.config(c).train.steps for c in pinned.cells} == {2}


def test_a_dependent_override_that_breaks_a_cell_or_names_no_axis_is_refused():
    axes = {"optim.name": ["muon", "moga"], "model.depth": [2], "optim.lr": [0.01]}
    with pytest.raises(SweepError, match=r"optim.preset 'moga' is Muon's"):  # MOGA has no preset "moga"
        sweep(axes=axes, overrides={"optim.preset": {"by": "optim.name", "values": {"muon": "moga", "moga": "moga"}}})
    with pytest.raises(SweepError, match=r"overrides: optim.preset depends on 'optim.p', which must be an axis"):
        sweep(axes=axes, overrides={"optim.preset": {"by": "optim.p", "values": {"2": "moga"}}})
    with pytest.raises(SweepError, match=r"overrides: optim.preset is \{by: AXIS"):
        sweep(axes=axes, overrides={"optim.preset": {"by": "optim.name", "value": {"muon": "moga"}}})
