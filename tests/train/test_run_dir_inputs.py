"""A run directory from an unlucky disk or a hostile collaborator: a symlink at any file the run writes, a
short metrics file, other data on resume, a full disk, damaged files. Each ends in one line or in an honest
recovery; nothing outside the run directory changes and nothing is silently wrong."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moga.train import CheckpointError, read_metrics, run

from .conftest import gpt_config, merge, one_line, same_tensors, tiny

SRC = str(Path(__file__).resolve().parents[2] / "src")
RUN_FILES = ("config.yaml", "plan.txt", "metrics.jsonl", "checkpoint.pt", "result.json", ".train.lock")


def small(**sections):
    return merge(tiny(train={"steps": 6}, eval={"every": 0}, checkpoint={"every": 3}), sections)


def _cli(*args: str):
    from moga.cli import app

    return CliRunner().invoke(app, list(args), terminal_width=300)


@pytest.mark.parametrize("target", ["existing", "dangling"])
@pytest.mark.parametrize("name", RUN_FILES)
def test_a_symlink_at_any_file_a_run_writes_changes_nothing_outside(tmp_path, name, target):
    """A link to a file outside (or to where one would be made): whole files replace the link, the run goes on;
    metrics and the lock refuse it in one line; a checkpoint or result read through it is named as damaged."""
    outside = tmp_path / "outside" / name
    outside.parent.mkdir()
    if target == "existing":
        outside.write_text("precious\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside)
    out = _cli("train", *_overrides(small()), "-o", str(run_dir), "-q")
    assert [p.read_text() for p in outside.parent.iterdir()] == (["precious\n"] if target == "existing" else [])
    if name in ("metrics.jsonl", ".train.lock"):
        one_line(out, 1, f"{run_dir / name} is a symlink")
    elif target == "existing" and name in ("checkpoint.pt", "result.json"):  # read before written: not ours
        one_line(out, 1, str(run_dir / name))
    else:
        assert out.exit_code == 0, out.output
        assert (run_dir / name).is_file() and not (run_dir / name).is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "run"]


def _overrides(cfg: dict) -> list[str]:
    """``cfg`` as `moga train`'s KEY=VALUE arguments, one per key of each section."""
    return [f"{k}={json.dumps(v)}" for k, v in _flat(cfg).items()]


def _flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and prefix == "":
            out.update(_flat(v, f"{k}."))
        else:
            out[prefix + k] = v
    return out


def test_a_short_metrics_file_is_never_padded(tmp_path):
    """Records the checkpoint saw but the disk lost (a power cut): the resume cuts to the last whole line, says
    so, marks the gap and goes on; every line still parses, the model is the uninterrupted one."""
    whole = run(small(), tmp_path / "whole")
    run(small(), tmp_path / "cut", stop_at=3)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    data = metrics.read_bytes()
    metrics.write_bytes(data[: len(data) // 2 + 3])  # mid-line
    resumed = run(small(), tmp_path / "cut")
    text = metrics.read_bytes()
    assert b"\0" not in text
    lines = [json.loads(line) for line in text.decode().splitlines()]
    gap = [r for r in lines if r["type"] == "gap"]
    assert len(gap) == 1 and gap[0]["step"] == 3 and gap[0]["lost_bytes"] > 0
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert same_tensors(torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)["model"],
                        torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)["model"])


def test_resume_on_changed_data_is_refused_unless_meant(tmp_path, text_file, monkeypatch):
    cfg = gpt_config(text_file, train={"steps": 4}, checkpoint={"every": 2}, eval={"every": 0})
    run(cfg, tmp_path / "run", stop_at=2)
    trained_on = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["data_fingerprint"]
    text_file.write_text(text_file.read_text()[::-1], encoding="utf-8")  # same size, other text
    with pytest.raises(CheckpointError, match=r"was trained on other data .* MOGA_ALLOW_DATA_CHANGE=1 \(moga train "
                       r"--allow-data-change\)"):
        run(cfg, tmp_path / "run")
    monkeypatch.setenv("MOGA_ALLOW_DATA_CHANGE", "1")
    result = run(cfg, tmp_path / "run")
    assert result["status"] == "finished"
    now = result["data_fingerprint"]  # recorded in the result as in the checkpoint: the data it ended on
    assert now["bytes"] == trained_on["bytes"] and now["sha256"] != trained_on["sha256"]


def test_a_checkpoint_without_its_digest_is_refused_unless_trusted(tmp_path, monkeypatch):
    from moga.train.checkpoint import CHECKSUM

    run(small(), tmp_path / "run", stop_at=3)
    path = tmp_path / "run" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    del state[CHECKSUM]
    torch.save(state, path)  # as an older moga wrote it
    with pytest.raises(CheckpointError, match=r"has no SHA-256 of its contents .* MOGA_ALLOW_UNCHECKED=1"):
        run(small(), tmp_path / "run")
    monkeypatch.setenv("MOGA_ALLOW_UNCHECKED", "1")
    assert run(small(), tmp_path / "run")["status"] == "finished"


def test_damaged_result_json_and_a_directory_checkpoint_are_named(tmp_path):
    overrides = _overrides(small())
    run(small(), tmp_path / "done")
    (tmp_path / "done" / "result.json").write_text('{"status": "fini')
    one_line(_cli("train", *overrides, "-o", str(tmp_path / "done"), "-q"), 1,
              f"{tmp_path / 'done' / 'result.json'} is damaged", "rm ")
    (tmp_path / "dir" / "checkpoint.pt").mkdir(parents=True)
    one_line(_cli("train", *overrides, "-o", str(tmp_path / "dir"), "-q"), 1,
              f"{tmp_path / 'dir' / 'checkpoint.pt'} is a directory, not a checkpoint file")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    return run(small(), tmp_path_factory.mktemp("whole") / "run")


@pytest.mark.parametrize("name", ["result.json", "config.yaml", "plan.txt", "metrics.jsonl"])
def test_a_directory_where_a_run_file_belongs_is_refused_before_training(tmp_path, name, uninterrupted):
    """Found before the first step, not when the file is written (result.json: after all the training): one
    line naming it, the stopped run's files as they were; moved away, the run resumes to the uninterrupted end."""
    run_dir, kept = tmp_path / "run", tmp_path / name
    run(small(), run_dir, stop_at=3)
    if (run_dir / name).exists():
        (run_dir / name).rename(kept)
    (run_dir / name).mkdir()
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    one_line(_cli("train", *_overrides(small()), "-o", str(run_dir), "-q"), 1,
              f"{run_dir / name} is a directory, not a", f"mv {run_dir / name} ")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    (run_dir / name).rmdir()
    if kept.exists():
        kept.rename(run_dir / name)
    assert run(small(), run_dir)["final_train_loss"] == uninterrupted["final_train_loss"]


def test_yaml_nested_50000_deep_isone_line(tmp_path):
    config = tmp_path / "deep.yaml"
    config.write_text("model: " + "[" * 50_000 + "]" * 50_000 + "\n")
    out = _cli("train", str(config), "-o", str(tmp_path / "run"))
    assert out.exit_code == 2 and "Traceback" not in out.output and "nested more than" in out.output, out.output
    assert not (tmp_path / "run").exists()


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
from moga.cli import app
app(sys.argv[2:])
"""


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_checkpoint(tmp_path):
    """A real write failure inside torch.save (its zip writer raises RuntimeError, not OSError)."""
    run_dir = tmp_path / "run"
    overrides = _overrides(small(checkpoint={"every": 1}))
    run(small(checkpoint={"every": 1}), run_dir, stop_at=2)
    before = (run_dir / "checkpoint.pt").read_bytes()
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(len(before) // 2), "train", *overrides, "-o",
                           str(run_dir), "-q"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith(f"error: could not write the checkpoint {run_dir / 'checkpoint.pt'}") and \
        "the previous checkpoint is intact" in err, err
    assert (run_dir / "checkpoint.pt").read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")) == []
    whole = run(small(checkpoint={"every": 1}), tmp_path / "whole")
    assert run(small(checkpoint={"every": 1}), run_dir)["final_train_loss"] == whole["final_train_loss"]


def test_a_finished_run_on_a_read_only_directory_is_read_without_writing(tmp_path):
    result = run(small(), tmp_path / "run")
    (tmp_path / "run" / ".train.lock").unlink()
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    os.chmod(tmp_path / "run", 0o555)
    try:
        assert run(small(), tmp_path / "run") == result
        assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == before
    finally:
        os.chmod(tmp_path / "run", 0o755)


def test_metrics_reach_the_disk_before_each_checkpoint(tmp_path, monkeypatch):
    """The checkpoint records the metrics' length: fsync them first, so a power cut cannot make them shorter."""
    from moga.train import metrics

    order = []
    monkeypatch.setattr(metrics, "fsync_file", lambda f: (order.append("fsync"), f.flush()))
    import moga.train.engine as engine

    real = engine.save_checkpoint
    monkeypatch.setattr(engine, "save_checkpoint", lambda *a, **k: (order.append("save"), real(*a, **k))[1])
    run(small(), tmp_path / "run", stop_at=3)
    assert order == ["fsync", "save"]
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")
