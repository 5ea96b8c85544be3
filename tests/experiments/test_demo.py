"""`moga demo --quick`: the main job in miniature, from sweep to README section."""

import json
import sqlite3

import pytest

from moga.experiments.reproduce.catalog import data_inputs
from moga.experiments.demo import (FULL_TIME, QUICK_TIME, README_END, README_START, demo_sweep, run_demo,
                                   update_demo_readme)
from moga.sweep.spec import Sweep, SweepError, arm_label, cell_id
from moga.sweep.store import SweepStore
from moga.train.build import build_optimizer, model_from_config


def test_full_demo_grid_has_the_depth_paper_structure():
    sweep = Sweep.from_dict(demo_sweep())
    axes = sweep.spec.axes
    assert axes["optim.name"] == ["adamw", "muon", "moga"]
    assert axes["model.depth_scaling"] == ["none", "inverse_depth"]
    assert min(axes["model.depth"]) == 2 and max(axes["model.depth"]) >= 32
    assert len(sweep.cells) == 3 * 2 * len(axes["model.depth"]) * 6
    assert sweep.base["optim"] == {"name": "moga"} and sweep.base["model"]["k_base"] == 2


def test_time_estimates_count_the_grid_and_name_their_workers():
    from typer.testing import CliRunner

    from moga.cli import app

    for estimate, quick in ((QUICK_TIME, True), (FULL_TIME, False)):
        assert estimate.startswith(f"{len(Sweep.from_dict(demo_sweep(quick)).cells)} runs")
        assert "with 2 workers on a 2-core CPU" in estimate
    result = CliRunner().invoke(app, ["demo", "--help"], terminal_width=300)
    assert result.exit_code == 0 and "with 2 workers on a 2-core CPU" in result.output


def _previous_demo(quick: bool) -> dict:
    """The demo as the previous main ran it: no override, so its Muon cells ran Muon's default, then moga's."""
    spec = demo_sweep(quick)
    del spec["overrides"]
    return spec


@pytest.mark.parametrize("quick", [False, True])
def test_every_muon_cell_of_the_demo_runs_the_papers_muon_and_keeps_its_id(quick):
    """Muon as the papers define it (moga's all-geometry Muon), which the demo's lr grids were tuned for; MOGA's
    cells keep their default; the cells' ids are those of the demo before, so its stores' run directories hold."""
    sweep = Sweep.from_dict(demo_sweep(quick))
    arms, muon_cells = set(), 0
    for cell in sweep.cells:
        optim = sweep.config(cell).optim
        arms.add(arm_label(optim))
        if optim.name == "muon":
            assert optim.preset == "moga", cell
            muon_cells += 1
        else:
            assert optim.preset is None, cell
    assert muon_cells == len(sweep.cells) // 3
    assert arms == {"adamw", "muon (moga preset)", "moga (default preset)"}
    config = sweep.config(next(c for c in sweep.cells if c["optim.name"] == "muon"))
    assert build_optimizer(config, model_from_config(config, data_inputs(config)[0])).preset == "moga"
    assert [cell_id(c) for c in sweep.cells] == [cell_id(c) for c in Sweep.from_dict(_previous_demo(quick)).cells]


def test_a_store_of_the_previous_demo_resumes(tmp_path):
    """A store the previous main's demo made (no Muon record: its Muon cells ran moga's all-geometry Muon) extends
    with nothing added or dropped; run without the override, it would be refused."""
    store = SweepStore(tmp_path / "demo")
    store.create_or_check(Sweep.from_dict(_previous_demo(True)))
    definition = {k: v for k, v in store.definition().items() if k != "muon_default_preset"}  # as it was stored
    with sqlite3.connect(store.path) as con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'sweep'", (json.dumps(definition),))
    con.close()
    with pytest.raises(SweepError, match="Muon's default became the published recipe"):
        SweepStore(tmp_path / "demo").create_or_check(Sweep.from_dict(_previous_demo(True)))
    assert SweepStore(tmp_path / "demo").create_or_check(Sweep.from_dict(demo_sweep(True))) == \
        {"added": 0, "dropped": 0}


def test_quick_demo_runs_and_reports(tmp_path):
    # one seed (max_seeds=1): the seeding loop is tested with the reproductions; here the grid and the report
    result = run_demo(tmp_path / "demo", quick=True, workers=2, progress=False, max_seeds=1)
    counts = result["counts"]
    assert counts["finished"] + counts["diverged"] == 48 and counts["failed"] == 0
    summary = json.loads((result["report"] / "summary.json").read_text())
    panels = {(v["panel"]["optimizer"], v["panel"]["scaling"]) for v in summary["verdicts"] if v["metric"] == "train_loss"}
    assert panels == {(o, s) for o in ("adamw", "muon", "moga") for s in ("none", "inverse_depth")}
    assert (result["report"] / "report.html").stat().st_size > 10_000  # figures embedded

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_START}\nold\n{README_END}\nrest\n")
    update_demo_readme(readme, result["report"], tmp_path / "docs", "moga demo --quick", result["arms"])
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro") and text.endswith("rest\n")
    assert "![final training loss" in text and (tmp_path / "docs" / "demo_train_loss.png").is_file()
    assert text.count("| moga (default preset) |") == 2 and text.count("| muon (moga preset) |") == 2
