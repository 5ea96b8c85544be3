import csv
import json
import math

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from moga.sweep.report import analyze, load_records, print_verdicts, write_report
from moga.sweep.report.cli import report_command

from .synthetic import parabola_sweep, pow2

LRS = pow2(-8, 0)


def sweep_records():
    """moga transfers with inverse-depth scaling; adamw's optimum falls a grid step per doubling."""
    offsets = {1: 0.001, 2: -0.001}  # a small seed spread, the same at every lr
    return (parabola_sweep([-4, -4, -4], scales=(2, 4, 8), lrs=LRS, seed_offsets=offsets,
                           optimizer="moga", diverge_above=2.5)
            + parabola_sweep([-3, -4, -5], scales=(2, 4, 8), lrs=LRS, seed_offsets=offsets,
                             optimizer="adamw", diverge_above=2.5))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    records = sweep_records()
    return records, out, write_report(records, out, scale_key="depth", title="Test sweep", resamples=100)


def test_every_output_is_written(report):
    records, out, paths = report
    expected = {"report.md", "report.html", "summary.json", "cells.csv", "figures/train_loss.png",
                "figures/train_loss.pdf", "figures/val_loss.png", "figures/val_loss.pdf"}
    assert set(paths) == expected and all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    assert paths["figures/train_loss.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["figures/val_loss.pdf"].read_bytes()[:5] == b"%PDF-"


def test_summary_json_is_strict_and_complete(report):
    records, out, paths = report

    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    summary = json.loads(paths["summary.json"].read_text(), parse_constant=reject)
    assert set(summary["metrics"]) == {"train_loss", "val_loss"}
    verdicts = {(v["metric"], v["panel"]["optimizer"]): v["verdict"] for v in summary["verdicts"]}
    assert verdicts[("train_loss", "moga")] == "transfers"
    assert verdicts[("train_loss", "adamw")] == "does not transfer"
    adamw = summary["metrics"]["train_loss"][1]
    assert adamw["drift"]["steps"] == 2 and adamw["drift"]["slope_per_doubling"] == pytest.approx(-1.0)
    assert [c["best_lr"] for c in adamw["curves"]] == [2.0**-3, 2.0**-4, 2.0**-5]
    assert adamw["regrets"][2]["relative"] == pytest.approx(0.2 / 0.3)  # seed mean of 0.299, 0.3 and 0.301
    assert adamw["decision"]["scales"][2]["drift_steps"] == pytest.approx(-2.0)
    assert adamw["bootstrap"]["drift_steps"] == [2, 2]
    assert None in adamw["curves"][2]["loss"]  # a diverged point: inf written as null


def test_cells_csv_has_every_run_and_reads_back(report):
    records, out, paths = report
    with open(paths["cells.csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records)
    assert {r["counted_as"] for r in rows} == {"finished", "diverged"}
    assert all(r["train_loss"] == "inf" for r in rows if r["status"] == "diverged")
    again = analyze(load_records(paths["cells.csv"]), resamples=0)
    lines = lambda panels: {p.title: p.verdict_line for p in panels}  # noqa: E731
    assert lines(again) == lines(analyze(records, resamples=0))


def test_markdown_and_html(report):
    records, out, paths = report
    md = paths["report.md"].read_text()
    html = paths["report.html"].read_text()
    lines = [p.verdict_line for p in analyze(records, resamples=100)]
    assert lines[0].startswith("transfers: drift within")
    for line in lines:
        assert line in md and line.replace("'", "&#x27;") in html
    assert "![train_loss against learning rate](figures/train_loss.png)" in md
    assert html.count('src="data:image/png;base64,') == 2
    assert "figures/" not in html  # self-contained: nothing linked
    assert "## Definitions" in md


def test_missing_validation_loss_and_svg(tmp_path):
    records = parabola_sweep([-4, -4], scales=(2, 4), lrs=LRS)
    for r in records:
        del r["val_loss"]
    paths = write_report(records, tmp_path, formats=("svg",), resamples=0)
    assert {p for p in paths if p.startswith("figures/")} == {"figures/train_loss.png", "figures/train_loss.svg"}
    assert "validation" not in paths["report.md"].read_text().lower()


def test_terminal_table():
    records = sweep_records()
    console = Console(record=True, width=160)
    print_verdicts({"train_loss": analyze(records, resamples=100)}, console=console)
    text = console.export_text()
    assert "does not transfer" in text and "transfers" in text and "moga, inverse_depth" in text


def test_cli(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in parabola_sweep([-4, -4], scales=(2, 4), lrs=LRS)))
    app = typer.Typer()
    app.command()(report_command)
    result = CliRunner().invoke(app, [str(path), "--out", str(tmp_path / "out"), "--svg"])
    assert result.exit_code == 0, result.output
    assert "transfers" in result.output and (tmp_path / "out" / "report.html").is_file()
    assert (tmp_path / "out" / "figures" / "train_loss.svg").is_file()
    bad = CliRunner().invoke(app, [str(path), "--scale-key", "width"])
    assert bad.exit_code != 0 and "no record has scale_key 'width'" in bad.output


def test_records_parse():
    from moga.sweep.report import parse_records

    (r,) = parse_records([{"optimizer": "moga", "depth": 8, "lr": 0.1, "train_loss": float("nan")}])
    assert (r.scale, r.scale_key, r.status, r.loss("train_loss")) == (8, "depth", "finished", math.inf)
    (r,) = parse_records([{"optimizer": "moga", "scale": 8, "lr": 0.1, "status": "pending"}])
    assert r.missing and r.loss("train_loss") is None
    with pytest.raises(ValueError, match="record 0"):
        parse_records([{"optimizer": "moga", "scale": 8, "lr": -1}])
