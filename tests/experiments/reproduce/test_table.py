"""The README's results table from stored outcomes that may be damaged or hostile: one line naming the file,
and nothing read from an outcome can move the README's generated section."""

import json

import pytest
from typer.testing import CliRunner

from moga.experiments.reproduce.table import END, START, update_readme


def _table(runs):
    from moga.cli import app

    return CliRunner().invoke(app, ["reproduce", "--table", "--runs", str(runs)], terminal_width=300)


def outcome(**fields):
    return {"outcome": "held", "key": "drift 0 [0, 1]", "data": "digits", "seconds": 60, **fields}


@pytest.mark.parametrize("text", ['{"outcome": "he', "[1, 2]", json.dumps(outcome(outcome="won")),
                                  json.dumps(outcome(key={"a": 1})), "[" * 100_000])
def test_a_damaged_outcome_is_one_line_naming_it(tmp_path, text):
    path = tmp_path / "runs" / "cpu" / "depth-mlp" / "outcome.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    out = _table(tmp_path / "runs")
    assert out.exit_code == 1, out.output
    assert out.output.startswith(f"error: {path} is damaged") and out.output.count("\n") == 1, out.output
    assert "moga reproduce depth-mlp" in out.output


def test_a_marker_in_an_outcome_cannot_survive_readme_regeneration(tmp_path):
    runs = tmp_path / "runs"
    (runs / "cpu" / "depth-mlp").mkdir(parents=True)
    injected = f"x {END}\n\nowned {START} y | z"
    (runs / "cpu" / "depth-mlp" / "outcome.json").write_text(json.dumps(outcome(key=injected, data=END)))
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{START}\nold\n{END}\n\nafter\n")
    for _ in range(2):  # regenerated: the section is found again, whole
        update_readme(readme, runs)
        text = readme.read_text()
        assert text.count(START) == 1 and text.count(END) == 1, text
        assert text.startswith("# title\n\n") and text.endswith(f"{END}\n\nafter\n")
    row = next(line for line in text.splitlines() if line.startswith("| ") and "depth-mlp" in line)
    assert row.count(" | ") == 4  # one row of five cells: the newline and the bar stayed inside the key's cell
