"""The engine: results and run directories, bitwise resume, divergence, checkpoints, every optimizer."""

import json
import math
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from moga.train import CheckpointError, build_config, read_metrics, run
from moga.train.checkpoint import save_checkpoint

from .conftest import gpt_config, merge, same_tensors, tiny

TIMING = ("time", "samples_per_s", "tokens_per_s")


def records(run_dir):
    """metrics.jsonl without the wall-clock fields."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir / "metrics.jsonl")]


def final_model(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def test_a_run_writes_its_directory(tmp_path):
    result = run(tiny(), tmp_path / "run")
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"config.yaml", "metrics.jsonl", "checkpoint.pt", "result.json", "plan.txt"} <= files
    assert result["status"] == "finished" and result["steps"] == 12
    assert json.loads((tmp_path / "run" / "result.json").read_text()) == result
    for key in ("final_train_loss", "val_loss", "val_acc", "train_eval_loss", "wall_time_s", "config_hash"):
        assert result[key] is not None
    assert result["config_hash"] == build_config(tiny()).hash()
    # digits: 1437 training images, batch 32 -> 44 steps per epoch, so the window is the whole 12-step run
    assert result["final_window_steps"] == 12
    train = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert result["final_train_loss"] == pytest.approx(sum(r["loss"] for r in train) / 6)
    evals = read_metrics(tmp_path / "run" / "metrics.jsonl", "eval")
    assert [r["step"] for r in evals] == [5, 10, 12] and evals[-1]["val_loss"] == result["val_loss"]


@pytest.mark.parametrize("make", ["mlp", "gpt"])
def test_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, make, request):
    if make == "mlp":  # MOGA (momentum, Adam on vectors), a cosine schedule, random crops and flips
        cfg = tiny(schedule={"name": "cosine", "warmup_steps": 3}, train={"steps": 14}, data={"augment": True})
    else:  # a GPT with dropout: the torch RNG must be restored too; AdamW; gradient accumulation
        cfg = gpt_config(request.getfixturevalue("text_file"), optim={"name": "adamw", "lr": 3e-3},
                         train={"steps": 10, "grad_accum": 2})
    whole = run(cfg, tmp_path / "whole")
    stopped = run(cfg, tmp_path / "parts", stop_at=7)  # past the checkpoint at 4: resume at 7 exactly
    assert stopped["status"] == "stopped" and stopped["steps"] == 7
    assert not (tmp_path / "parts" / "result.json").exists()
    resumed = run(cfg, tmp_path / "parts")
    assert same_tensors(final_model(tmp_path / "whole"), final_model(tmp_path / "parts"))
    assert records(tmp_path / "whole") == records(tmp_path / "parts")  # no record lost or doubled
    strip = lambda r: {k: v for k, v in r.items() if k != "wall_time_s"}  # noqa: E731
    assert strip(whole) == strip(resumed)


def test_resume_from_a_periodic_checkpoint_after_a_crash(tmp_path):
    cfg = tiny(train={"steps": 10})
    run(cfg, tmp_path / "whole")
    crash = tmp_path / "crash"
    run(cfg, crash, stop_at=4)
    at_step_4 = (crash / "checkpoint.pt").read_bytes()
    run(cfg, crash, stop_at=8)  # steps 5..8 logged metrics; then the process "dies" before its next save:
    (crash / "checkpoint.pt").write_bytes(at_step_4)
    assert len(records(crash)) > len(records(tmp_path / "whole")) - 3
    run(cfg, crash)
    assert same_tensors(final_model(tmp_path / "whole"), final_model(crash))
    assert records(tmp_path / "whole") == records(crash)  # the records after step 4 were cut, then redone


def test_a_finished_run_returns_its_result_without_training(tmp_path):
    first = run(tiny(), tmp_path / "run")
    stamp = (tmp_path / "run" / "checkpoint.pt").stat().st_mtime_ns
    again = run(tiny(logging={"log_every": 3}), tmp_path / "run")  # logging keys are not part of the hash
    assert again == first
    assert (tmp_path / "run" / "checkpoint.pt").stat().st_mtime_ns == stamp


def test_another_config_is_refused_with_the_differing_keys(tmp_path):
    run(tiny(), tmp_path / "done")
    with pytest.raises(CheckpointError, match=r"optim\.lr: 0\.05 -> 0\.1"):
        run(tiny(optim={"lr": 0.1}), tmp_path / "done")
    run(tiny(), tmp_path / "half", stop_at=4)
    with pytest.raises(CheckpointError) as e:
        run(tiny(model={"depth": 3}, train={"batch_size": 16}), tmp_path / "half")
    assert "model.depth: 2 -> 3" in str(e.value) and "train.batch_size: 32 -> 16" in str(e.value)


@pytest.mark.parametrize("era", ["papers", "tables"])
def test_a_run_from_before_a_change_of_mogas_default_is_refused_with_the_setting_to_resume_it(tmp_path, monkeypatch,
                                                                                               era):
    """A config on MOGA's default preset hashes what the preset runs: after a change of the default, a run made
    before it (finished or half done) is refused, with no key to show but the setting that resumes it: the
    paper's preset for a run of the papers' default, nesterov off for one of the tables at lr/16 with plain
    momentum (the default before it took Nesterov's)."""
    from moga.optim import multipliers

    was, setting, optim = {"papers": (multipliers.PAPER, "optim.preset=paper", {"preset": "paper"}),
                           "tables": (multipliers.Preset({"embedding": 1 / 16}), "optim.nesterov=false",
                                      {"nesterov": False})}[era]
    monkeypatch.setitem(multipliers.PRESETS, "default", was)
    run(tiny(), tmp_path / "done")
    run(tiny(), tmp_path / "half", stop_at=4)
    monkeypatch.setitem(multipliers.PRESETS, "default", multipliers.DEFAULT)
    for run_dir in ("done", "half"):
        with pytest.raises(CheckpointError, match=f"resumes with {setting}"):
            run(tiny(), tmp_path / run_dir)
    assert run(tiny(optim=optim), tmp_path / "half")["status"] == "finished"


def test_corrupted_and_foreign_checkpoints_are_reported(tmp_path):
    run(tiny(), tmp_path / "run", stop_at=4)
    path = tmp_path / "run" / "checkpoint.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    with pytest.raises(CheckpointError, match="corrupted"):
        run(tiny(), tmp_path / "run")
    path.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CheckpointError, match="corrupted"):
        run(tiny(), tmp_path / "run")
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="not a moga training checkpoint"):
        run(tiny(), tmp_path / "run")
    save_checkpoint(path, {"config": {}, "config_hash": "x", "step": 0, "model": {}, "optimizer": {}})
    state = torch.load(path, weights_only=True)
    state["version"] = 99
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="version 99"):
        run(tiny(), tmp_path / "run")


def test_saves_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"step": 1})

    def broken(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(CheckpointError, match="disk full.*previous checkpoint is intact"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 1  # the old checkpoint is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # and no temporary file is left


def test_a_flipped_bit_or_an_empty_checkpoint_is_corrupted_not_diverged(tmp_path):
    run_dir = tmp_path / "run"
    run(tiny(), run_dir, stop_at=4)
    path = run_dir / "checkpoint.pt"
    weight = next(iter(torch.load(path, weights_only=True)["model"].values()))
    data = bytearray(path.read_bytes())
    at = bytes(data).find(weight.reshape(-1)[:4].numpy().tobytes())  # the weights' bytes, stored as they are
    assert at > 0
    data[at + 1] ^= 0x04  # one bit of a mantissa: the file still loads
    path.write_bytes(bytes(data))
    for broken in (bytes(data), b""):
        path.write_bytes(broken)
        with pytest.raises(CheckpointError) as info:
            run(tiny(), run_dir)
        message = str(info.value)
        assert "corrupted" in message and str(path) in message and "Delete it" in message
        assert not (run_dir / "result.json").exists()  # nothing is recorded, least of all "diverged"


DISK_FULL = """
import resource, signal, sys
from moga.train.cli import train
import typer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
app = typer.Typer()
app.command()(train)
app(sys.argv[2:])
"""


def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    import subprocess

    cfg = tiny(eval={"every": 0})
    run(cfg, tmp_path / "run", stop_at=4)
    path = tmp_path / "run" / "checkpoint.pt"
    before = path.read_bytes()
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(cfg))
    limit = len(before) // 2  # every other file stays far below it
    proc = subprocess.run([sys.executable, "-c", DISK_FULL, str(limit), str(config), "-o", str(tmp_path / "run"),
                           "-q"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert f"could not write the checkpoint {path}" in proc.stderr
    assert "previous checkpoint is intact" in proc.stderr and "Traceback" not in proc.stderr
    assert path.read_bytes() == before and [p.name for p in path.parent.glob(".checkpoint*")] == []


def test_a_run_directory_that_is_a_file_and_a_failed_config_leave_nothing(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="is an existing file"):
        run(tiny(), tmp_path / "file")
    assert (tmp_path / "file").read_text() == "mine"
    with pytest.raises(ValueError, match="model.colour"):
        run(tiny(model={"colour": "red"}), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_divergence_needs_no_ceiling(tmp_path):
    # Loss 1.6, 0.7, 2.7, 23.6 (x14 the first): before the default rule this finished with val_loss 3e10.
    cfg = tiny(data={"name": "synthetic"}, optim={"name": "sgd", "lr": 0.5},
               train={"steps": 4, "batch_size": 64}, eval={"every": 0}, logging={"log_every": 1})
    result = run(cfg, tmp_path / "run")
    assert result["status"] == "diverged" and result["diverged_step"] == 3
    assert math.isfinite(result["diverged_loss"]) and "divergence_factor" in result["diverged_reason"]
    first = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")[0]["loss"]
    assert result["diverged_loss"] > 10 * first
    off = run(merge(cfg, {"train": {"divergence_factor": None}}), tmp_path / "off")
    assert off["status"] == "finished"


@pytest.mark.parametrize("case", ["nonfinite", "ceiling"])
def test_divergence_is_a_result_not_a_crash(tmp_path, case):
    if case == "nonfinite":
        cfg = tiny(optim={"name": "sgd", "lr": 1e6}, train={"steps": 30})
    else:
        cfg = tiny(optim={"name": "sgd", "lr": 3.0}, train={"steps": 30, "loss_ceiling": 2.5})
    result = run(cfg, tmp_path / "run")
    assert result["status"] == "diverged"
    assert result["final_train_loss"] == math.inf and result["val_loss"] == math.inf
    assert 0 < result["diverged_step"] < 30
    stored = json.loads((tmp_path / "run" / "result.json").read_text())
    assert stored["status"] == "diverged" and stored["final_train_loss"] == math.inf
    events = read_metrics(tmp_path / "run" / "metrics.jsonl", "diverged")
    assert len(events) == 1 and events[0]["step"] == result["diverged_step"]
    if case == "ceiling":
        assert events[0]["loss"] > 2.5
    assert run(cfg, tmp_path / "run") == stored  # recorded like any other result


@pytest.mark.parametrize("name,extra", [
    ("moga", {"p": 1.5}), ("muon", {}), ("adamw", {"weight_decay": 0.1}), ("adamw-scaled", {}),
    ("sgd", {"momentum": 0.9}), ("adaptive-gd", {}),
])
def test_every_optimizer_trains(tmp_path, name, extra):
    lr = {"moga": 0.05, "muon": 0.05, "adamw": 3e-3, "adamw-scaled": 0.03, "sgd": 0.05, "adaptive-gd": 1.0}[name]
    cfg = tiny(optim={"name": name, "lr": lr, **extra}, train={"steps": 20}, eval={"every": 0},
               checkpoint={"every": 0})
    result = run(cfg, tmp_path / name)
    assert result["status"] == "finished"
    train = read_metrics(tmp_path / name / "metrics.jsonl", "train")
    assert train[-1]["loss"] < train[0]["loss"]


def test_adaptive_gd_full_batch_through_the_engine(tmp_path):
    cfg = {"model": {"name": "feedforward", "width": 32, "depth": 4, "activation": "gelu"},
           "data": {"name": "synthetic", "in_features": 8, "n_train": 128},
           "optim": {"name": "adaptive-gd", "lr": 0.5}, "train": {"steps": 60, "batch_size": "full"},
           "logging": {"log_every": 1, "progress": False}, "checkpoint": {"every": 0}}
    result = run(cfg, tmp_path / "run")
    train = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    losses = [r["loss"] for r in train]
    assert len(losses) == 60 and all(b <= a for a, b in zip(losses, losses[1:]))
    assert all(r["eta"] > 0 and r["w_norm"] > 0 for r in train)  # eta_t and ||W_t|| logged every step
    assert train[0]["w0_norm"] == train[0]["w_norm"]
    # A full-batch epoch is one step, so the final-epoch loss is the last step's loss.
    assert result["final_window_steps"] == 1 and result["final_train_loss"] == losses[-1]
    assert result["epochs"] == 60


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    one = run(tiny(optim={"name": "sgd", "lr": 0.1}), tmp_path / "one")
    two = run(tiny(optim={"name": "sgd", "lr": 0.1}, train={"grad_accum": 4}), tmp_path / "acc")
    a, b = final_model(tmp_path / "one"), final_model(tmp_path / "acc")
    for k in a:
        if torch.is_tensor(a[k]):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert one["final_train_loss"] == pytest.approx(two["final_train_loss"], rel=1e-5)


def test_epochs_regression_losses_and_depth_scaling(tmp_path):
    cfg = tiny(model={"depth": 4, "depth_scaling": "inverse_depth"}, train={"steps": None, "epochs": 0.5},
               eval={"every": 0, "final_window": 5})
    result = run(cfg, tmp_path / "scaled")
    assert result["steps"] == 22 and result["final_window_steps"] == 5  # 44 steps per epoch
    model = final_model(tmp_path / "scaled")
    assert model["blocks.0.branch.residual_scale._extra_state"] == {"alpha": 0.5}  # k_base / K = 2 / 4
    for loss in ("mse", "bce"):
        r = run(tiny(train={"loss": loss}), tmp_path / loss)
        assert r["status"] == "finished" and r["val_acc"] is not None
    r = run({"data": {"name": "synthetic", "out_features": 3}, "model": {"name": "feedforward", "width": 8, "depth": 2},
             "optim": {"name": "adamw"}, "train": {"steps": 5, "loss": "bce", "batch_size": 64},
             "logging": {"progress": False}}, tmp_path / "synthetic-bce")
    assert 0 <= r["val_acc"] <= 1


def test_evaluation_every_epoch(tmp_path):
    cfg = tiny(train={"steps": 90, "batch_size": 64}, eval={"every": "epoch", "max_batches": 1},
               checkpoint={"every": 0}, logging={"log_every": 30})
    run(cfg, tmp_path / "run")  # 1437 images / 64 = 22 steps per epoch
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "eval")] == [22, 44, 66, 88, 90]


def test_your_own_model_by_import_path(tmp_path):
    cfg = tiny(data={"flatten": True})  # a model the engine does not know gets images as they are unless told
    cfg["model"] = {"name": "torch.nn:Linear", "in_features": 64, "out_features": 10}
    result = run(cfg, tmp_path / "linear")
    train = read_metrics(tmp_path / "linear" / "metrics.jsonl", "train")
    assert result["status"] == "finished" and train[-1]["loss"] < train[0]["loss"]


def test_compile_path_runs(tmp_path):
    result = run(tiny(train={"compile": "eager", "steps": 4}), tmp_path / "compiled")
    assert result["status"] == "finished"


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were absent
    with pytest.raises(ImportError, match="pip install tensorboard"):
        run(tiny(logging={"tensorboard": True}), tmp_path / "tb")


def test_tensorboard_receives_the_metrics(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tiny(logging={"tensorboard": True, "log_every": 1}), tmp_path / "tb")
    (event_file,) = (tmp_path / "tb").rglob("events.out.tfevents*")
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    train = read_metrics(tmp_path / "tb" / "metrics.jsonl", "train")
    logged = [e.value for e in events.Scalars(next(t for t in events.Tags()["scalars"] if t.endswith("loss")))]
    assert logged == pytest.approx([r["loss"] for r in train], rel=1e-6)


class HostReads(TorchFunctionMode):
    """Calls that read a tensor on the host (a device sync on a GPU), and argmaxes."""

    READS = (torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__)

    def __init__(self):
        super().__init__()
        self.reads, self.argmaxes = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in self.READS
        self.argmaxes += func in (torch.Tensor.argmax, torch.argmax)
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_the_loss_once_and_takes_no_argmax(tmp_path, monkeypatch):
    """4 micro-batches: the loss is summed on the device and read once per step (it was read per micro-batch),
    and no accuracy is computed for training batches (an argmax over every logit)."""
    from moga.train.engine import Trainer

    original, steps = Trainer._forward_backward, []

    def recorded(self):
        with HostReads() as mode:
            loss = original(self)
        steps.append((mode.reads, mode.argmaxes))
        return loss

    monkeypatch.setattr(Trainer, "_forward_backward", recorded)
    result = run(tiny(train={"steps": 3, "grad_accum": 4}, eval={"every": 0}), tmp_path / "r")
    assert result["steps"] == 3 and steps == [(1, 0)] * 3


@pytest.mark.parametrize("clip", [None, 1.0])
def test_clipping_norm_is_the_optimizers_nonfinite_verdict(tmp_path, clip):
    # With clipping, the global norm already says whether a gradient is NaN or inf: MOGA takes that flag
    # and does not read every gradient a second time (its C++ check does not run).
    from moga.kernels import FusedCalls

    cfg = tiny(train={"steps": 3, "grad_clip": clip}, optim={"name": "moga", "lr": 0.05},
               eval={"every": 0}, checkpoint={"every": 0})
    with FusedCalls() as calls:
        run(cfg, tmp_path / "run")
    checks = sum(1 for name, _ in calls.ops if name.endswith("found_nonfinite"))
    assert calls.stepped > 0 and checks == (0 if clip else 3)


def test_a_cooldown_branched_from_a_longer_wsd_run_is_the_short_run_bit_for_bit(tmp_path, text_file):
    """Warmup-stable-decay: a 10-step run decays from step 8, a 20-step one from 16. Branched from the long run's
    checkpoint at step 8, the short run's weights, metrics and result are those it makes from scratch (the
    published Muon: orthogonalized hidden matrices, AdamW on the rest, with weight decay)."""
    wsd = {"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.2}
    cfg = lambda steps, **train: gpt_config(  # noqa: E731
        text_file, optim={"name": "muon", "lr": 0.01, "weight_decay": 0.1}, schedule=wsd,
        train={"steps": steps, **train}, checkpoint={"keep": [8, 12]})
    run(cfg(20), tmp_path / "long")
    assert {p.name for p in (tmp_path / "long").glob("checkpoint-*.pt")} == {"checkpoint-8.pt", "checkpoint-12.pt"}
    scratch = run(cfg(10), tmp_path / "scratch")
    branched = run(cfg(10, branch_from=str(tmp_path / "long" / "checkpoint-8.pt")), tmp_path / "branch")
    assert same_tensors(final_model(tmp_path / "scratch"), final_model(tmp_path / "branch"))
    assert records(tmp_path / "scratch") == records(tmp_path / "branch")
    # it did branch: its first 8 steps' records are the long run's, wall-clock times included
    first = lambda d: [r for r in read_metrics(d / "metrics.jsonl") if r["step"] <= 8]  # noqa: E731
    assert first(tmp_path / "branch") == first(tmp_path / "long") != first(tmp_path / "scratch")
    strip = lambda r: {k: v for k, v in r.items() if k != "wall_time_s"}  # noqa: E731
    assert strip(scratch) == strip(branched) and branched["config_hash"] == build_config(cfg(10)).hash()
    # past its own decay start the long run's rates are not this run's; another lr is another config
    with pytest.raises(CheckpointError, match="different rates before step 12"):
        run(cfg(10, branch_from=str(tmp_path / "long" / "checkpoint-12.pt")), tmp_path / "late")
    other = gpt_config(text_file, optim={"name": "muon", "lr": 0.02, "weight_decay": 0.1}, schedule=wsd,
                       train={"steps": 10, "branch_from": str(tmp_path / "long" / "checkpoint-8.pt")})
    with pytest.raises(CheckpointError, match=r"another config, not this one at another length: optim.lr"):
        run(other, tmp_path / "other")
