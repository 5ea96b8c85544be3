"""The coordinate check: the width-blind control blows up where MOGA stays flat, and the numbers it plots
are the ones a direct computation gives."""

import pytest
import torch
import torch.nn.functional as F

from moga.experiments.coordcheck import coordcheck, residual_mlp, run_one, slope
from moga.experiments.coordcheck_plot import figure
from moga.optim import MOGA


def test_control_blows_up_and_moga_stays_flat_on_a_residual_mlp():
    records, found = coordcheck("residual_mlp", ["moga:vectors=sign", "adamw"], widths=(128, 256, 512), steps=2,
                                init="width")
    verdict = {(v.optimizer, v.layer): v for v in found}
    layers = ["input", "blocks.0.branch.fc1", "blocks.0.branch.fc2", "blocks.1.branch.fc1", "blocks.1.branch.fc2",
              "readout"]
    assert {layer for _, layer in verdict} == set(layers)
    assert all(verdict["moga:vectors=sign", layer].verdict == "flat" for layer in layers), [v.line() for v in found]
    for layer in layers[1:]:  # every matrix whose fan_in grows: AdamW's step grows like width
        control = verdict["adamw", layer]
        assert control.verdict == "optimizer" and control.update > 0.7, control.line()
    # The input layer's fan_in is 64 at every width: Adam's first step needs no factor there.
    assert abs(verdict["adamw", "input"].slopes["gain"][1]) < 0.1
    # A steepest-descent step has norm lr in its own geometry, at every width and step.
    moga_norms = [r.norm for r in records if r.optimizer == "moga:vectors=sign" and r.step > 0]
    assert moga_norms == pytest.approx([2**-4] * len(moga_norms), rel=1e-5)


def test_the_report_tells_the_init_from_the_optimizer_on_a_gpt():
    """nanoGPT's fixed N(0, 0.02^2) init makes every matrix's output at step 0 grow like sqrt(width): the
    report blames the init, under MOGA and AdamW alike. The width-aware init removes that part; what is
    left is the optimizer's: nothing under the paper's MOGA on the hidden layers, AdamW's width-blind step
    everywhere. (MOGA's default, tables at lr / 16, put blocks.0.attn.c_proj's gain slope at -0.11 here, just
    past the flat limit, against -0.09 for the paper's: 3 widths and 2 steps.)"""
    widths = (32, 64, 128)
    paper = "moga:preset=paper"
    _, standard = coordcheck("gpt", [paper], widths=widths, steps=1)  # the init part is the same for any optimizer
    _, aware = coordcheck("gpt", [paper, "adamw"], widths=widths, steps=2, init="width")
    standard = {(v.optimizer, v.layer): v for v in standard}
    aware = {(v.optimizer, v.layer): v for v in aware}
    hidden = [layer for (o, layer), v in aware.items() if o == paper and v.role == "hidden"]
    assert len(hidden) == 8
    head = standard[paper, "lm_head"]
    assert head.init > 0.4 and "init" in head.verdict, head.line()  # 0.02 x sqrt(width)
    assert all("init" in standard[paper, layer].verdict for layer in hidden)
    assert not any("init" in v.verdict for v in aware.values()), [v.line() for v in aware.values()]
    for layer in hidden:
        assert aware[paper, layer].verdict == "flat", aware[paper, layer].line()
        control = aware["adamw", layer]
        assert control.verdict == "optimizer" and control.update > 0.6, control.line()
    assert aware["adamw", "lm_head"].update > 0.6


def test_recorded_and_plotted_numbers_equal_a_direct_computation():
    records = []
    for width in (16, 32):
        records += run_one(residual_mlp(width, depth=2, seed=3), "moga", 0.1, 2, width, None)
    for width in (16, 32):  # the same run by hand: two MOGA steps, then fc1 of block 1 on the same batch
        p = residual_mlp(width, depth=2, seed=3)
        model, opt = p.model, MOGA(p.model, lr=0.1)
        with torch.no_grad():
            at_init = model.readout(model.features(p.inputs))
        for _ in range(2):
            old = [t.detach().clone() for t in model.blocks[1].branch.fc1.parameters()]
            opt.zero_grad()
            F.cross_entropy(model(p.inputs), p.targets).backward()
            opt.step()
        with torch.no_grad():
            y = model.input(p.inputs)
            y = model.blocks[0](y)
            fc1 = model.blocks[1].branch.fc1
            out = fc1(y)
            effect = out - F.linear(y, *old)
        (rec,) = [r for r in records if r.width == width and r.step == 2 and r.layer == "blocks.1.branch.fc1"]
        assert rec.output == pytest.approx(rms(out), rel=1e-6)
        assert rec.update == pytest.approx(rms(effect), rel=1e-6)
        assert rec.gain == pytest.approx(rms(effect) / rms(y), rel=1e-6)
        assert rec.norm == pytest.approx(0.1, rel=1e-6)
        (init,) = [r for r in records if r.width == width and r.step == 0 and r.layer == "readout"]
        assert init.output == pytest.approx(rms(at_init), rel=1e-6) and init.update == 0.0
    fig = figure(records, "moga")
    titles = [ax.get_title() for ax in fig.axes]
    panel = fig.axes[titles.index("RMS of the step's effect, step 2")]
    (line,) = [ln for ln in panel.get_lines() if ln.get_label() == "blocks.1.branch.fc1"]
    expected = [r.update for w in (16, 32) for r in records
                if r.width == w and r.step == 2 and r.layer == "blocks.1.branch.fc1"]
    assert list(line.get_xdata()) == [16, 32] and list(line.get_ydata()) == expected
    assert slope([16, 32], expected) == pytest.approx(torch.tensor(expected[1] / expected[0]).log2().item())


def rms(t):
    return t.double().pow(2).mean().sqrt().item()


def test_cli_on_a_user_factory(tmp_path):
    from typer.testing import CliRunner

    from moga.cli import app

    result = CliRunner().invoke(app, [
        "coordcheck", "--model", "tests.experiments.coordcheck_factory:mlp", "--widths", "16,64", "--steps", "1",
        "--optim", "moga:vectors=sign;p=2.0,adamw", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "== moga:vectors=sign;p=2.0: all layers flat" in result.stdout
    assert "== adamw: optimizer drifts on 2 (2, 4)" in result.stdout
    assert "a part is flat when |slope| <= 0.1" in result.stdout
    # Progress goes to stderr as each run ends, and the control's drift is explained with its number.
    assert "coordcheck: 4 runs (2 optimizers x 2 widths) of 1 steps" in result.stderr
    assert "[4/4] adamw width 64: " in result.stderr and "[" not in result.stdout.split("\n")[0]
    control = next(v for v in found_control(tmp_path) if v.verdict != "flat")
    why = next(line for line in result.stdout.splitlines() if line.startswith("   why optimizer"))
    assert f"like width^{control.update:+.2f}" in why and f"x{4 ** abs(control.update):.2g} too large" in why
    assert "expected of the control" in why
    assert (tmp_path / "coordcheck_moga_vectors_sign_p_2.0.png").is_file() and (tmp_path / "coordcheck.json").is_file()


def found_control(tmp_path):
    """The CLI's adamw verdicts, read back from the coordcheck.json it wrote: the worst drifting layer first."""
    import json

    from moga.experiments.coordcheck import LayerVerdict

    verdicts = [LayerVerdict(**v) for v in json.loads((tmp_path / "coordcheck.json").read_text())["verdicts"]
                if v["optimizer"] == "adamw"]
    return sorted(verdicts, key=lambda v: -abs(v.update))


def test_drift_explanations_say_what_the_number_means_and_what_to_try():
    from moga.experiments.coordcheck_cli import explain

    records, found = coordcheck("residual_mlp", ["moga:vectors=sign", "adamw"], widths=(64, 256), steps=1)
    moga = [v for v in found if v.optimizer == "moga:vectors=sign"]
    drifting = max((v for v in moga if "init" in v.verdict), key=lambda v: abs(v.init))
    first = explain(moga, [64, 256], "default")
    assert first[0].startswith(f"   why init: at step 0 {drifting.layer}'s output goes like width^{drifting.init:+.2f}")
    assert f"(x{4 ** drifting.init:.2g} from width 64 to 256)" in first[0] and "--init width" in first[0]
    assert explain(moga, [64, 256], "default", init_said=True)[0] == (
        "   why init: as above (step 0 comes before any optimizer step)")
    assert explain([v for v in moga if v.verdict == "flat"], [64, 256], "default") == []


def test_a_model_with_no_matrices_says_so(tmp_path):
    from typer.testing import CliRunner

    from moga.cli import app

    result = CliRunner().invoke(app, ["coordcheck", "--model", "tests.experiments.coordcheck_factory:no_matrices",
                                      "--widths", "8,16", "--steps", "1", "--optim", "adamw",
                                      "-o", str(tmp_path / "o")], terminal_width=300)
    assert result.exit_code == 2 and "has no matrices to check" in result.output, result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("how", ["env", "flag"])
def test_no_import_refuses_a_factory_before_importing_it(tmp_path, monkeypatch, how):
    import sys

    from typer.testing import CliRunner

    from moga.cli import app

    marker = tmp_path / "imported"
    (tmp_path / "hostile_factory.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef d(width): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MOGA_NO_IMPORT", "1" if how == "env" else "")
    flag = ["--no-import"] if how == "flag" else []
    result = CliRunner().invoke(app, ["coordcheck", "--model", "hostile_factory:d", "--widths", "16,32",
                                      "--steps", "1", "-o", str(tmp_path / "out"), *flag])
    assert result.exit_code == 2 and "refused" in result.output, result.output
    assert not marker.exists() and "hostile_factory" not in sys.modules
