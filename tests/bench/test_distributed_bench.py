"""`moga bench distributed`: the records, the communication targets and the step that ran, on small shapes
(timings not asserted).
Two blocks: each `fully_shard` call builds its own (equal) mesh, and the collectives must not multiply."""

import json
from pathlib import Path

import pytest

from typer.testing import CliRunner

from moga.bench.distributed import OPTIMIZERS
from moga.cli import app


def test_bytes_per_optimizer_meet_the_targets():
    result = CliRunner().invoke(app, ["bench", "distributed", "--blocks", "2", "--vocab", "64", "--width", "32", "--repeats", "1", "--json",
                                      "--only", "torch-adamw", "--only", "moga-row-p2", "--only", "moga-col-q2",
                                      "--only", "moga-muon", "--only", "moga-row-p2-torch", "--only", "torch-adamw-fused"])
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in json.loads(result.output)}
    assert records["torch-adamw"]["bytes_all_ranks"] == 0
    flag = 4 * 2  # the skip decision: one int32 per rank
    assert records["moga-row-p2"]["bytes_all_ranks"] == flag
    col = records["moga-col-q2"]
    assert col["collectives"]["allreduce_"] == 1 + 2  # the flag, then the matrices' column sums and maxima
    assert col["bytes_all_ranks"] == flag + 2 * 2 * 4 * col["fan_in_floats"]  # 2 floats per column, per rank
    muon = records["moga-muon"]
    assert muon["collectives"] == {"allreduce_": 1, "alltoall_base_": 2}
    assert muon["bytes_all_ranks"] == flag + 2 * muon["matrix_bytes"]  # each matrix out to its owner and back
    # Which step ran on the local shards: the C++ kernel for every tensor but Muon's matrices (spectral);
    # the plain path with kernel="torch".
    assert records["torch-adamw"]["kernel"] == "torch.optim"
    assert records["moga-row-p2"]["kernel"] == "cpp"
    assert col["kernel"] == "cpp" and muon["kernel"] == f"cpp 1/{col['matrices'] + 1}"
    assert records["moga-row-p2-torch"]["kernel"] == "torch"
    assert records["moga-row-p2-torch"]["peer"] == "moga-row-p2" and records["moga-row-p2-torch"]["ms_vs_peer"] > 0
    # ratios within rounds against torch's fused AdamW on the same shards; state over all ranks (momentum
    # only: half of AdamW's two moments)
    assert all(r["ms_vs_adamw_fused"] > 0 for r in records.values())
    assert records["moga-row-p2"]["state_vs_adamw"] == pytest.approx(0.5, abs=1e-3)


def test_unknown_name_is_an_error():
    result = CliRunner().invoke(app, ["bench", "distributed", "--only", "adam"])
    assert result.exit_code != 0 and "unknown optimizer" in result.output and "moga-muon" in result.output
    assert "torch-adamw" in OPTIMIZERS


def test_only_a_signal_after_every_ranks_last_barrier_counts_as_teardown(tmp_path):
    """gloo can abort a rank while it tears down (rarely, on a loaded CPU): the bench keeps its records then, and
    only then; an exit code, or a rank that never passed the last barrier, stays a failure."""
    import torch.multiprocessing as mp

    from moga.bench.distributed import died_in_teardown
    out = str(tmp_path / "records.json")
    aborted = mp.ProcessExitedException("process 1 terminated with signal SIGABRT", error_index=1, error_pid=1,
                                        exit_code=-6, signal_name="SIGABRT")
    exited = mp.ProcessExitedException("process 1 terminated with exit code 1", error_index=1, error_pid=1,
                                       exit_code=1)
    Path(f"{out}.done0").touch()
    assert not died_in_teardown(aborted, out, 2)  # rank 1 had not passed the last barrier
    Path(f"{out}.done1").touch()
    assert died_in_teardown(aborted, out, 2)
    assert not died_in_teardown(exited, out, 2)
