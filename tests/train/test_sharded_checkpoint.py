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
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        consolidate(directory)


def test_a_safe_checkpoint_still_resumes_and_consolidates(stopped):
    before = consolidate(stopped / "run" / DIRECTORY)
    assert before["model"]["blocks.0.branch.residual_scale._extra_state"] == {"alpha": 1.0}
    assert _resume_with_cli(stopped).exit_code == 0
    after = consolidate(stopped / "run" / DIRECTORY)
    assert not torch.equal(before["model"]["readout.weight"], after["model"]["readout.weight"])
