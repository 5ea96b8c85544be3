"""train.parallel=fsdp and train.precision=bf16: FSDP2 on 2 gloo processes, sharded (DCP) checkpoints.

Every 2-process run happens in one torchrun launch (fsdp_worker.py); the tests compare them with
one-process runs made here. Optimizers: AdamW (the GPT-2 style resume, the ResNet) and MOGA (the LLaMA
style runs, the ResidualMLP), whose FSDP2 steps tests/optim/test_sharded.py checks.
Measured (CPU, torch 2.13, this module's tiny configs), each asserted with headroom:
- fsdp (2 processes) vs none, fp32, 8 MOGA steps with clipping: losses agree to 3e-8 relative, weights
  to 2.4e-7 (reduction order only; AdamW: 4e-8 and 1.7e-7); asserted 1e-5 and 1e-5.
- bf16 vs fp32, same config, 8 steps: losses differ by at most 2e-5 relative (fsdp) and 1.3e-5 (autocast
  alone; AdamW: 6e-5 and 2e-5); asserted 1e-3. A model this small sits near ln(vocab): on the char GPT
  config the gap is larger (moga.train.parallel gives the measurement).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moga.train import CheckpointError, ConfigError, build_config, read_metrics, run
from moga.filelock import writer_lock
from moga.train import distributed
from moga.train.build import model_from_config
from moga.train.engine import LOCK
from moga.train.sharded_checkpoint import DIRECTORY, consolidate, find_sharded, load_sharded
from moga.train.tasks import build_task

from ..conftest import corpus_text
from .conftest import gpt_config, merge, same_tensors, tiny

TIMING = ("time", "samples_per_s", "tokens_per_s", "wall_time_s")
FSDP = {"train": {"parallel": "fsdp"}}


def strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def losses(run_dir, key="loss"):
    return [r[key] for r in read_metrics(Path(run_dir) / "metrics.jsonl", "train")]


def configs(text: Path) -> dict:
    # GPT-2 style with dropout (the RNG must resume too), depth scaling (extra state in the checkpoint),
    # gradient accumulation (FSDP's gradient sync on the last micro-batch) and active clipping.
    common = {"optim": {"name": "adamw", "lr": 3e-3},
              "train": {"steps": 8, "grad_accum": 2, "grad_clip": 0.5}, "checkpoint": {"every": 3}}
    gpt2 = merge(gpt_config(text, **common), {"model": {"depth_scaling": "inverse_depth", "k_base": 1}})
    llama = merge(gpt_config(text, **common), {"model": {"style": "llama", "dropout": 0.0}, "eval": {"every": 0},
                                               "optim": {"name": "moga", "lr": 2**-5}})
    images = {"train": {"steps": 4}, "eval": {"every": 0, "max_batches": 1},
              "checkpoint": {"every": 0}}
    resnet = tiny(**merge(images, {"optim": {"name": "adamw", "lr": 1e-2}}))
    # no BatchNorm: its statistics are per process under fsdp (as under ddp), so it would not equal one process
    resnet["model"] = {"name": "resnet", "stages": [1, 1], "base_channels": 4, "in_channels": 1, "norm": "none"}
    return {"gpt2": gpt2, "llama": llama, "resnet": resnet, "mlp": tiny(**images)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    (root / "corpus.txt").write_text(corpus_text(), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOGA_CACHE", str(root / "cache"))
        yield root


@pytest.fixture(scope="module")
def two(corpus):
    """The 2-process fsdp runs: run directories by name."""
    cfg = configs(corpus / "corpus.txt")
    out = corpus / "two"
    jobs = [
        {"dir": out / "whole", "config": merge(cfg["gpt2"], FSDP)},
        {"dir": out / "parts", "config": merge(cfg["gpt2"], FSDP), "stops": [5]},
        {"dir": out / "llama", "config": merge(cfg["llama"], FSDP), "stops": [5], "snapshot": out / "llama-at-5"},
        {"dir": out / "llama-bf16", "config": merge(merge(cfg["llama"], FSDP), {"train": {"precision": "bf16"}})},
        {"dir": out / "llama-offload", "config": merge(merge(cfg["llama"], FSDP), {"train": {"offload": True}}),
         "stops": [5]},
        {"dir": out / "resnet", "config": merge(cfg["resnet"], FSDP)},
        {"dir": out / "mlp", "config": merge(cfg["mlp"], FSDP)},
        {"dir": out / "busy", "config": merge(cfg["mlp"], FSDP), "busy": os.getpid()},  # this process holds it
        {"dir": out / "linked", "config": merge(cfg["mlp"], FSDP), "stops": [1],
         "plant": [f".{DIRECTORY}.tmp", corpus / "outside"]},
    ]
    (corpus / "outside").mkdir()
    (corpus / "outside" / "keep").write_text("precious\n")
    path = corpus / "jobs.json"
    path.write_text(json.dumps(jobs, default=str))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).with_name("fsdp_worker.py")), str(path)]
    with writer_lock(out / "busy" / LOCK):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return {Path(j["dir"]).name: Path(j["dir"]) for j in jobs} | {"llama-at-5": out / "llama-at-5"}


@pytest.fixture(scope="module")
def one(corpus):
    """One-process runs (parallel none): the llama config in fp32 and bf16, the ResNet and the MLP."""
    cfg = configs(corpus / "corpus.txt")
    runs = {"fp32": cfg["llama"], "bf16": merge(cfg["llama"], {"train": {"precision": "bf16"}}),
            "resnet": cfg["resnet"], "mlp": cfg["mlp"]}
    for name, c in runs.items():
        run(c, corpus / f"one-{name}", quiet=True)
    return {name: corpus / f"one-{name}" for name in runs}


def max_weight_difference(sharded_dir: Path, one_dir: Path) -> float:
    a = consolidate(sharded_dir / DIRECTORY)["model"]
    b = torch.load(one_dir / "checkpoint.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b if torch.is_tensor(b[k]))


@pytest.mark.timeout(600)
def test_sharded_resume_equals_the_uninterrupted_run_bit_for_bit(two):
    whole, parts = consolidate(two["whole"] / DIRECTORY), consolidate(two["parts"] / DIRECTORY)
    assert same_tensors(whole["model"], parts["model"]) and same_tensors(whole["optimizer"], parts["optimizer"])
    assert strip(read_metrics(two["whole"] / "metrics.jsonl")) == strip(read_metrics(two["parts"] / "metrics.jsonl"))
    results = [json.loads((two[k] / "result.json").read_text()) for k in ("whole", "parts")]
    assert [strip([r]) for r in results] == [strip([results[0]])] * 2
    assert results[0]["world_size"] == 2
    # one shard file per rank; no temporary or previous directory left behind
    assert sorted(p.name for p in (two["whole"] / DIRECTORY).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in two["whole"].iterdir() if "checkpoint" in p.name) == [DIRECTORY]
    assert whole["model"]["blocks.0.attn.residual_scale._extra_state"] == {"alpha": 0.5}


def test_fsdp_equals_one_process(two, one):
    """Same global batch, same MOGA steps, global gradient clipping (its norm is logged and compared)."""
    sharded, single = losses(two["llama"]), losses(one["fp32"])
    assert sharded == pytest.approx(single, rel=1e-5)
    assert losses(two["llama"], "grad_norm") == pytest.approx(losses(one["fp32"], "grad_norm"), rel=1e-5)
    assert min(losses(one["fp32"], "grad_norm")) > 0.5  # so the clipping was active at every logged step
    diff = max_weight_difference(two["llama"], one["fp32"])
    assert diff < 1e-5, diff
    print(f"fsdp vs none: max |dloss|/loss {max(abs(x - y) / y for x, y in zip(sharded, single)):.1e}, "
          f"max |dw| {diff:.1e}")


def test_cpu_offload_resumes_and_equals_one_process(two, one):
    """train.offload: FSDP2's CPUOffloadPolicy, stopped at step 5 and resumed (the hash leaves offload out,
    so the sharded checkpoint would also resume without it); MOGA steps the CPU shards in its C++ kernel."""
    assert losses(two["llama-offload"]) == pytest.approx(losses(one["fp32"]), rel=1e-5)
    assert max_weight_difference(two["llama-offload"], one["fp32"]) < 1e-5
    assert losses(two["llama-offload"]) == losses(two["llama"])  # where the shards wait changes no number


def test_bf16_trains_within_a_measured_gap_of_fp32(two, one):
    for bf16, fp32 in ((two["llama-bf16"], two["llama"]), (one["bf16"], one["fp32"])):
        low, full = losses(bf16), losses(fp32)
        assert low[-1] < low[0]  # it trains
        gap = max(abs(x - y) / y for x, y in zip(low, full))
        assert 0 < gap < 1e-3, gap  # 0: the bf16 path really ran in bf16
        print(f"bf16 vs fp32 ({bf16.name}): max relative loss gap {gap:.1e}")
        assert json.loads((bf16 / "result.json").read_text())["val_loss"] == pytest.approx(
            json.loads((fp32 / "result.json").read_text())["val_loss"], rel=1e-3)
    gap = max(abs(x - y) / y for x, y in zip(losses(two["llama-bf16"]), losses(one["bf16"])))
    print(f"bf16 fsdp vs bf16 none: max relative loss gap {gap:.1e}")


@pytest.mark.parametrize("name", ["resnet", "mlp"])
def test_every_model_trains_sharded(two, one, corpus, name):
    """ResNet blocks (AdamW) and residual MLP blocks (MOGA) sharded: the one-process run, and whole weights."""
    assert losses(two[name]) == pytest.approx(losses(one[name]), rel=1e-5)
    assert max_weight_difference(two[name], one[name]) < 1e-5
    cfg = build_config(configs(corpus / "corpus.txt")[name])
    full = model_from_config(cfg, build_task(cfg).model_inputs).state_dict()
    saved = consolidate(two[name] / DIRECTORY)["model"]
    assert {k: v.shape for k, v in saved.items() if torch.is_tensor(v)} == {
        k: v.shape for k, v in full.items() if torch.is_tensor(v)}


def test_a_two_process_checkpoint_loads_on_one(two, corpus):
    """DCP reshards: the step-5 checkpoint of 2 processes loads exactly into 1, and the run goes on."""
    snapshot = two["llama-at-5"]
    cfg = build_config(merge(configs(corpus / "corpus.txt")["llama"], FSDP))
    d = distributed.setup("cpu", "fsdp")  # one process: a one-rank group
    try:
        from moga.train.build import build_optimizer
        from moga.train.parallel import shard_model

        model = shard_model(model_from_config(cfg, build_task(cfg).model_inputs))
        optimizer = build_optimizer(cfg, model)
        load_sharded(snapshot / DIRECTORY, model, optimizer)
        loaded = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    finally:
        distributed.teardown(d)
    assert same_tensors(loaded, consolidate(snapshot / DIRECTORY)["model"])

    resumed = corpus / "two-to-one"
    shutil.copytree(snapshot, resumed)
    assert run(cfg, resumed, quiet=True)["world_size"] == 1
    assert losses(resumed) == pytest.approx(losses(two["llama"]), rel=1e-5)


def test_a_busy_run_directory_is_refused_on_every_rank(two):
    """Rank 0 finds the lock held (by this test process) and every rank raises, naming the holder."""
    for rank in (0, 1):
        assert f"(PID {os.getpid()})" in (two["busy"] / f"refused-{rank}.txt").read_text()
    assert not (two["busy"] / "metrics.jsonl").exists() and not (two["busy"] / DIRECTORY).exists()


def test_a_symlink_at_the_shards_temporary_directory_is_refused_on_every_rank(two, corpus):
    """Planted after step 1 at .checkpoint.dcp.tmp, pointing out of the run: both ranks refuse it in one line
    (neither waits for the other), nothing is written outside, the step-1 checkpoint stays."""
    link = two["linked"] / f".{DIRECTORY}.tmp"
    for rank in (0, 1):
        refused = (two["linked"] / f"refused-{rank}.txt").read_text()
        assert refused.startswith(f"{link} is a symlink") and "\n" not in refused, refused
    assert [(p.name, p.read_text()) for p in (corpus / "outside").iterdir()] == [("keep", "precious\n")]
    assert torch.load(two["linked"] / DIRECTORY / "engine.pt", weights_only=True)["step"] == 1
    assert not (two["linked"] / "result.json").exists()


def test_swapped_shards_are_reported(two, tmp_path):
    """Rank 0's and rank 1's shard files exchanged: same names, same metadata; engine.pt's SHA-256 tells."""
    copy = shutil.copytree(two["llama-at-5"] / DIRECTORY, tmp_path / DIRECTORY)
    first, second = copy / "__0_0.distcp", copy / "__1_0.distcp"
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    with pytest.raises(CheckpointError, match=r"corrupted: its file __0_0\.distcp (has|does not match)"):
        consolidate(copy)
    first.write_bytes(a)
    second.write_bytes(b)
    assert same_tensors(consolidate(copy), consolidate(two["llama-at-5"] / DIRECTORY))


def test_another_parallel_setting_is_refused(two, corpus, tmp_path):
    shutil.copytree(two["llama-at-5"], tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"train\.parallel: 'fsdp' -> 'none'"):
        run(merge(configs(corpus / "corpus.txt")["llama"], {"train": {"parallel": "none"}}), tmp_path / "run")


def test_a_save_killed_midway_loses_nothing(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    cfg = tiny(optim={"name": "adamw", "lr": 1e-2}, train={"steps": 6, "parallel": "fsdp"},
               eval={"every": 0, "max_batches": 1}, checkpoint={"every": 2})
    run(cfg, tmp_path / "run", stop_at=2)
    real = dcp.save

    def dies(state, checkpoint_id):
        real(state, checkpoint_id=checkpoint_id)  # the shards are written, engine.pt is not
        raise OSError("killed")

    monkeypatch.setattr(dcp, "save", dies)
    with pytest.raises(OSError, match="killed"):
        run(cfg, tmp_path / "run", stop_at=4)
    monkeypatch.undo()
    found = find_sharded(tmp_path / "run" / DIRECTORY)
    assert found == tmp_path / "run" / DIRECTORY
    assert torch.load(found / "engine.pt", weights_only=True)["step"] == 2
    os.replace(found, tmp_path / "run" / f".{DIRECTORY}.old")  # as if killed between the two renames
    assert run(cfg, tmp_path / "run", quiet=True)["status"] == "finished"
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "checkpoint" in p.name) == [DIRECTORY]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")] == [2, 4, 6]


def test_parallel_none_refuses_several_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="parallel=none trains in one process"):
        distributed.setup("cpu", "none")


def test_fsdp_refuses_what_needs_whole_weights():
    with pytest.raises(ConfigError, match="fsdp does not run logging.diagnostics_every"):
        build_config(tiny(train={"parallel": "fsdp"}, logging={"diagnostics_every": 5}))
    with pytest.raises(ConfigError, match="fsdp does not run optim.name=adaptive-gd"):
        build_config(tiny(train={"parallel": "fsdp"}, optim={"name": "adaptive-gd", "lr": 1.0}))
