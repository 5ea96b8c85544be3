"""DDP through torchrun: 2 CPU processes on gloo give the one-process result for the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from moga.train import read_metrics, run

from .conftest import same_tensors, tiny


def torchrun(config_path, run_dir, nproc=2, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "moga.train", str(config_path), "--run-dir", str(run_dir), "--quiet"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((run_dir / "result.json").read_text())


@pytest.mark.timeout(240)
def test_two_processes_match_one(tmp_path):
    # grad_accum=2 and batch 32: micro-batches of 16, 8 per process; MOGA with Adam on vectors; evaluation
    # batches shared out over the processes.
    cfg = tiny(train={"steps": 10, "grad_accum": 2}, eval={"every": 5, "batch_size": 100},
               checkpoint={"every": 0})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    single = run(cfg, tmp_path / "one")
    double = torchrun(path, tmp_path / "two")
    assert double["world_size"] == 2 and double["status"] == "finished"
    assert double["config_hash"] == single["config_hash"]

    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    diff = max((one["model"][k] - two["model"][k]).abs().max().item()
               for k in one["model"] if torch.is_tensor(one["model"][k]))
    assert diff < 1e-5, f"max |w_one - w_two| = {diff}"
    assert same_tensors(one["data"], two["data"])  # the same batches were drawn
    for key in ("final_train_loss", "val_loss", "val_acc", "train_eval_loss"):
        assert double[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
    losses = lambda d: [r["loss"] for r in read_metrics(d / "metrics.jsonl", "train")]  # noqa: E731
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    print(f"DDP parity: max weight difference {diff:.2e}")
