"""scripts/gpu-check.sh, the first run on a machine with a GPU: what of it can run without one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moga.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
HELPER = ROOT / "scripts" / "gpu_check.py"


def helper(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(HELPER), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_it_stops_at_once_with_one_clear_line(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "unused"), "GPU_CHECK_WHEELS": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.count("\n") == 1 and "no CUDA device" in summary and "Traceback" not in result.stderr
    assert result.stdout == summary


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_STEPS": "tests bench-typo"}
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 2 and "unknown step 'bench-typo'" in result.stdout
    assert (tmp_path / "out" / "summary.txt").read_text() == ""


def test_its_training_config_is_valid_and_asks_for_bf16_on_cuda(tmp_path):
    assert helper("config", tmp_path).returncode == 0
    cfg = load_config(tmp_path / "config.yaml", ["optim.name=adamw", "train.parallel=fsdp",
                                                       "train.deterministic=true", "checkpoint.every=4"])
    assert cfg.train.device == "cuda" and cfg.train.precision == "bf16" and cfg.train.parallel == "fsdp"
    assert Path(cfg.data.text_path).stat().st_size > 100_000


def test_tokens_reads_the_median_rate_after_the_first_record(tmp_path):
    records = [{"type": "train", "loss": 3.0 - i, "tokens_per_s": rate} for i, rate in enumerate([10.0, 50, 70, 60])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = helper("tokens", tmp_path)
    assert result.returncode == 0 and json.loads(result.stdout) == {"tokens_per_s": 60, "final_loss": 0.0}


def test_lines_summarizes_a_syncs_and_a_kernel_log_past_their_noise(tmp_path):
    log = tmp_path / "check.json"
    log.write_text("W1204 a warning\n" + json.dumps({
        "moga-row-p2": {"syncs_per_step": 0, "max_diff_vs_cpu": 1.5e-8, "first": []},
        "moga-bf16": {"error": "NotImplementedError: no bfloat16"},
        "optimizer row(p=2)": {"max_diff": 5.6e-5, "update": 4.1e-5}}) + "\n")
    result = helper("lines", log)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["  moga-row-p2: 0 host syncs/step, max |CUDA - CPU| 1.5e-08",
                                          "  moga-bf16: NotImplementedError: no bfloat16",
                                          "  optimizer row(p=2): max |CUDA - CPU| 5.6e-05 against an update of 4.1e-05"]
