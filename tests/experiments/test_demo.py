"""`moga demo --quick`: the main job in miniature, from sweep to README section."""

import json

from moga.experiments.demo import README_END, README_START, demo_sweep, run_demo, update_readme
from moga.sweep.spec import Sweep


def test_full_demo_grid_has_the_depth_paper_structure():
    sweep = Sweep.from_dict(demo_sweep())
    axes = sweep.spec.axes
    assert axes["optim.name"] == ["adamw", "muon", "moga"]
    assert axes["model.depth_scaling"] == ["none", "inverse_depth"]
    assert min(axes["model.depth"]) == 2 and max(axes["model.depth"]) >= 32
    assert len(sweep.cells) == 3 * 2 * len(axes["model.depth"]) * 6
    assert sweep.base["optim"] == {"name": "moga"} and sweep.base["model"]["k_base"] == 2


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
    update_readme(readme, result["report"], tmp_path / "docs", "moga demo --quick")
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro") and text.endswith("rest\n")
    assert "![final training loss" in text and (tmp_path / "docs" / "demo_train_loss.png").is_file()
    assert text.count("| moga |") == 2
