"""Sharded (DCP) checkpoints from a hostile or damaged source: refused with one paragraph, nothing run.

Real DCP files, written by a real one-process gloo FSDP2 run (train.parallel=fsdp); tests/train/test_fsdp.py
has the two-process runs and resharding.
"""

import builtins
import io
import os
import pickle

import pytest
import torch
from typer.testing import CliRunner

from moga.train import CheckpointError, run
from moga.train.dcp_reader import METADATA
from moga.train.sharded_checkpoint import DIRECTORY, consolidate

from .conftest import tiny

CONFIG = tiny(optim={"name": "moga", "lr": 1e-2}, train={"steps": 6, "parallel": "fsdp"},
              eval={"every": 0, "max_batches": 1}, checkpoint={"every": 2})


class RunsCode:
    """Unpickling this calls ``call(*args)``: what a hostile checkpoint would hold."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _cli(args: list[str]):
    import typer

    from moga.train.cli import train

    app = typer.Typer(add_completion=False)
    app.command("train")(train)
    app.command("other")(lambda: None)  # two commands: "train" stays a subcommand
    return CliRunner().invoke(app, ["train", *args], terminal_width=200)


@pytest.fixture
def stopped(tmp_path):
    """A run stopped at step 2: its checkpoint.dcp/ and the config as a file for the CLI."""
    import yaml

    run(CONFIG, tmp_path / "run", stop_at=2, quiet=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    return tmp_path


def _resume_with_cli(root):
    return _cli([str(root / "config.yaml"), "-q", "-o", str(root / "run")])


def _plant_value(directory, fqn_end: str, payload: bytes) -> None:
    """Point the value ``...fqn_end`` of a DCP checkpoint at ``payload`` (appended to its shard file)."""
    metadata = pickle.loads((directory / METADATA).read_bytes())  # our own file: plain pickle is fine here
    index = next(i for i in metadata.storage_data if i.fqn.endswith(fqn_end))
    info = metadata.storage_data[index]
    shard = directory / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    info.offset, info.length = offset, len(payload)
    (directory / METADATA).write_bytes(pickle.dumps(metadata))


def test_a_hostile_metadata_runs_nothing(stopped):
    marker = stopped / "ran"
    directory = stopped / "run" / DIRECTORY
    (directory / METADATA).write_bytes(pickle.dumps(RunsCode(os.system, f"touch {marker}")))
    _reseal(directory)
    out = _resume_with_cli(stopped)
    assert out.exit_code == 1, out.output
    assert "corrupted or unsafe" in out.output and "system" in out.output and "nothing in it was run" in out.output
    assert "Traceback" not in out.output and len(out.output.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="corrupted or unsafe"):
        consolidate(directory)
    assert not marker.exists()


def test_a_hostile_value_runs_nothing(stopped):
    """Non-tensor values (an lr, a residual scale) are pickles too: they load with weights_only=True."""
    marker = stopped / "ran"
    directory = stopped / "run" / DIRECTORY
    buffer = io.BytesIO()
    torch.save(RunsCode(builtins.open, str(marker), "w"), buffer)
    _plant_value(directory, "_extra_state.alpha", buffer.getvalue())
    _reseal(directory)
    out = _resume_with_cli(stopped)
    assert out.exit_code == 1 and "corrupted or unsafe" in out.output and "_extra_state.alpha" in out.output
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        consolidate(directory)
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(stopped):
    directory = stopped / "run" / DIRECTORY
    metadata = pickle.loads((directory / METADATA).read_bytes())
    next(iter(metadata.storage_data.values())).relative_path = "../../engine.pt"
    (directory / METADATA).write_bytes(pickle.dumps(metadata))
    _reseal(directory)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        consolidate(directory)


def test_a_safe_checkpoint_still_resumes_and_consolidates(stopped):
    before = consolidate(stopped / "run" / DIRECTORY)
    assert before["model"]["blocks.0.branch.residual_scale._extra_state"] == {"alpha": 1.0}
    assert _resume_with_cli(stopped).exit_code == 0
    after = consolidate(stopped / "run" / DIRECTORY)
    assert not torch.equal(before["model"]["readout.weight"], after["model"]["readout.weight"])


def _reseal(directory) -> None:
    """What an attacker who can write the directory can also do: record the new files' digests in engine.pt
    (its own checksum is recomputed by save_checkpoint), so only the safe reader stands in the way."""
    from moga.train.checkpoint import save_checkpoint
    from moga.train.sharded_checkpoint import ENGINE, FILES, file_digests

    engine = torch.load(directory / ENGINE, weights_only=True)
    save_checkpoint(directory / ENGINE, {**engine, FILES: file_digests(directory)})


def _flip(path, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


def test_a_flipped_bit_anywhere_is_reported(stopped):
    """Every file of the checkpoint but engine.pt (which checks itself): bits at the start, inside and at
    the end of each; each is refused on resume, then put back, and the checkpoint resumes."""
    from moga.train.sharded_checkpoint import ENGINE, load_engine_state

    directory = stopped / "run" / DIRECTORY
    files = sorted(p for p in directory.iterdir() if p.name != ENGINE)
    assert [p.name for p in files] == [METADATA, "__0_0.distcp"]
    for path in files:
        size = path.stat().st_size * 8
        for bit in (0, 7, size // 3, size // 2 + 5, (2 * size) // 3, size - 1):
            _flip(path, bit)
            with pytest.raises(CheckpointError, match=f"corrupted: its file {path.name} does not match the SHA-256"):
                load_engine_state(directory)
            _flip(path, bit)
    _flip(files[1], files[1].stat().st_size * 4)  # and through the CLI, in one line
    out = _resume_with_cli(stopped)
    assert out.exit_code == 1 and len(out.output.strip().splitlines()) == 1 and "rm -r" in out.output
    _flip(files[1], files[1].stat().st_size * 4)
    assert _resume_with_cli(stopped).exit_code == 0


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, message", [
    (lambda d: _truncate(d / "__0_0.distcp"), r"file __0_0\.distcp has \d+ bytes, but was written with \d+"),
    (lambda d: (d / "__0_0.distcp").unlink(), r"file __0_0\.distcp is missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b""), r"file __0_0\.distcp has 0 bytes"),
    (lambda d: (d / METADATA).unlink(), r"file \.metadata is missing"),
    (lambda d: (d / METADATA).write_bytes(os.urandom(64)), r"file \.metadata has 64 bytes"),
    (lambda d: (d / "engine.pt").unlink(), r"its engine\.pt is missing"),
])
def test_a_damaged_checkpoint_is_one_paragraph(stopped, damage, message):
    directory = stopped / "run" / DIRECTORY
    damage(directory)
    out = _resume_with_cli(stopped)
    assert out.exit_code == 1, out.output
    line = out.output.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"error: {directory} is corrupted")
    assert "Delete it to start the run over" in line
    import re

    assert re.search(message, line), line
    assert not (stopped / "run" / "result.json").exists()  # nothing trained over it


def test_a_shard_from_another_save_is_reported(stopped):
    """The same file names, sizes and metadata: only the digests tell the step-2 shard from the step-4 one."""
    directory = stopped / "run" / DIRECTORY
    old_shard = (directory / "__0_0.distcp").read_bytes()
    run(CONFIG, stopped / "run", stop_at=4, quiet=True)
    (directory / "__0_0.distcp").write_bytes(old_shard)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match the SHA-256"):
        run(CONFIG, stopped / "run", quiet=True)


def test_digests_are_checked_before_dcp_reads_anything(stopped):
    """A hostile .metadata is refused by its digest (and, resealed, by the safe reader)."""
    directory = stopped / "run" / DIRECTORY
    marker = stopped / "ran"
    (directory / METADATA).write_bytes(pickle.dumps(RunsCode(os.system, f"touch {marker}")))
    with pytest.raises(CheckpointError, match=r"corrupted: its file \.metadata has \d+ bytes"):
        consolidate(directory)
    _reseal(directory)
    with pytest.raises(CheckpointError, match="asks to build posix.system|asks to build nt.system"):
        consolidate(directory)
    assert not marker.exists()


def test_a_save_killed_by_kill_9_leaves_no_temporary_directory(stopped):
    """kill -9 after the shards were written: .checkpoint.dcp.tmp holds them, with no engine.pt."""
    import shutil

    run_dir = stopped / "run"
    tmp = run_dir / f".{DIRECTORY}.tmp"
    shutil.copytree(run_dir / DIRECTORY, tmp)
    (tmp / "engine.pt").unlink()
    assert run(CONFIG, run_dir, stop_at=2, quiet=True)["status"] == "stopped"  # resumed at 2: nothing saved
    assert not tmp.exists()
    assert sorted(p.name for p in run_dir.iterdir() if "checkpoint" in p.name) == [DIRECTORY]


def test_an_engine_pt_without_shard_digests_is_refused_unless_trusted(stopped, monkeypatch):
    """The pre-digest format would turn every shard check off: refused in one line, naming the way to trust it."""
    from moga.train.checkpoint import load_checkpoint, save_checkpoint
    from moga.train.sharded_checkpoint import ENGINE, FILES

    engine = stopped / "run" / DIRECTORY / ENGINE
    state = load_checkpoint(engine)
    del state[FILES]
    save_checkpoint(engine, {k: v for k, v in state.items() if k not in ("format", "version", "sha256")})
    out = _resume_with_cli(stopped)
    assert out.exit_code == 1 and len(out.output.strip().splitlines()) == 1, out.output
    assert f"{engine} has no SHA-256 digests of its shard files" in out.output and "--allow-unchecked" in out.output
    assert not (stopped / "run" / "result.json").exists()
    monkeypatch.setenv("MOGA_ALLOW_UNCHECKED", "0")  # restored (unset) after the test: the flag sets it to 1
    out = _cli([str(stopped / "config.yaml"), "-q", "-o", str(stopped / "run"), "--allow-unchecked"])
    assert out.exit_code == 0, out.output


def _tree(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["existing", "dangling"])
@pytest.mark.parametrize("name", [f".{DIRECTORY}.tmp", f".{DIRECTORY}.old", DIRECTORY])
def test_a_symlink_at_a_name_the_sharded_save_writes_is_refused(stopped, name, target):
    """The shards' temporary directory, the previous one's name, the checkpoint itself: a link out of the run
    is refused in one line before training; nothing outside changes and the step-2 checkpoint stays."""
    run_dir, outside = stopped / "run", stopped / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious\n")
    if name == DIRECTORY:  # a link to a whole checkpoint elsewhere (existing), or to nowhere
        os.replace(run_dir / DIRECTORY, outside / DIRECTORY)
        link_to = outside / DIRECTORY
    else:
        link_to = outside
    (run_dir / name).symlink_to(link_to if target == "existing" else stopped / "nowhere")
    before, kept = _tree(outside), _tree(run_dir / DIRECTORY) if name != DIRECTORY else None
    out = _resume_with_cli(stopped)
    assert out.exit_code == 1 and "Traceback" not in out.output and out.output.count("\n") == 1, out.output
    assert f"{run_dir / name} is a symlink" in out.output and f"rm {run_dir / name}" in out.output, out.output
    assert _tree(outside) == before and not (stopped / "nowhere").exists()
    if kept is not None:
        assert _tree(run_dir / DIRECTORY) == kept
    assert not (run_dir / "result.json").exists()
    assert sorted(p.name for p in stopped.iterdir()) == ["config.yaml", "outside", "run"]


def test_a_symlink_planted_while_a_run_trains_is_refused_at_its_save(tmp_path):
    """The run's start checked the names; a link planted after it is refused by the save itself."""
    from moga.files import UnsafeFile
    from moga.train import build_config, distributed
    from moga.train.build import build_optimizer, model_from_config
    from moga.train.parallel import shard_model
    from moga.train.sharded_checkpoint import ENGINE, save_sharded
    from moga.train.tasks import build_task

    cfg = build_config(CONFIG)
    path, outside = tmp_path / "run" / DIRECTORY, tmp_path / "outside"
    path.parent.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("precious\n")
    d = distributed.setup("cpu", "fsdp")  # a one-rank gloo group, as the run makes
    try:
        model = shard_model(model_from_config(cfg, build_task(cfg).model_inputs))
        optimizer = build_optimizer(cfg, model)
        save = lambda step: save_sharded(path, model, optimizer, {"step": step}, main=True,  # noqa: E731
                                         barrier=lambda: distributed.barrier(d))
        save(1)
        kept = _tree(path)
        for name in (f".{DIRECTORY}.tmp", f".{DIRECTORY}.old"):
            (path.parent / name).symlink_to(outside)
            with pytest.raises(UnsafeFile, match=f"{path.parent / name} is a symlink"):
                save(2)
            assert _tree(outside) == {"keep": b"precious\n"} and _tree(path) == kept
            (path.parent / name).unlink()
        save(3)  # the link gone, the run saves on
    finally:
        distributed.teardown(d)
    assert torch.load(path / ENGINE, weights_only=True)["step"] == 3
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["outside", "keep", "run", DIRECTORY, *_tree(path)])
