"""Per-layer diagnostics records and the depth paper's step rule in the engine."""

import math

import pytest
import torch

from moga.train import ConfigError, build_config, read_metrics, run

from .conftest import same_tensors, tiny

LMO_MOGA = {"name": "moga", "lr": 0.05, "weight_decay": 0.1, "vectors": "sign"}  # every layer an exact LMO step


def final_model(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def test_diagnostics_update_norm_is_lr_and_the_trajectory_is_unchanged(tmp_path):
    cfg = tiny(optim=LMO_MOGA, train={"steps": 8}, data={"augment": True})
    run(cfg, tmp_path / "plain")
    run(tiny(optim=LMO_MOGA, train={"steps": 8}, data={"augment": True}, logging={"diagnostics_every": 3}),
        tmp_path / "diag")
    # Probes run in eval mode on a fixed batch and leave .grad alone: the same weights bit for bit.
    assert same_tensors(final_model(tmp_path / "plain"), final_model(tmp_path / "diag"))
    records = read_metrics(tmp_path / "diag" / "metrics.jsonl", "diagnostics")
    assert [r["step"] for r in records] == [1, 3, 6]
    for r in records:
        assert r["lr"] == 0.05 and len(r["layers"]) == 12  # 4 linears: weights and biases
        for layer in r["layers"]:
            assert layer["update"] == "lmo"
            # ||W_after - (1 - lr wd) W_before||_k = lr for an LMO step, whatever the gradient
            assert layer["update_over_lr"] == pytest.approx(1.0, rel=1e-5), layer["name"]
            if layer["role"] == "vector":  # vectors are never decayed: the raw step is the update
                assert layer["step_norm"] == pytest.approx(layer["update_norm"], rel=1e-4)
            else:  # decay is in the step
                assert layer["step_norm"] != pytest.approx(layer["update_norm"], rel=1e-4)
            for key in ("grad_dual_norm", "train_grad_dual_norm", "weight_norm", "trajectory_smoothness"):
                assert layer[key] > 0 and math.isfinite(layer[key])
        assert r["lipschitz"] == pytest.approx(sum(x["grad_dual_norm"] for x in r["layers"]))
        assert r["trajectory_smoothness"] > 0


def test_diagnostics_for_an_optimizer_without_a_geometry(tmp_path):
    cfg = tiny(optim={"name": "adamw", "lr": 3e-3, "weight_decay": 0.1}, train={"steps": 4},
               logging={"diagnostics_every": 4})
    run(cfg, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "diagnostics")
    assert [r["step"] for r in records] == [1, 4]
    layers = {x["name"]: x for x in records[0]["layers"]}
    # measured in MOGA's default geometry: row(2) matrices, l_inf vectors (Adam's first step is sign(G))
    assert layers["readout.weight"]["geometry"].startswith("row")
    assert layers["input.bias"]["update_over_lr"] == pytest.approx(1.0, rel=1e-3)


def test_step_rule_with_a_measured_smoothness_is_grad_dual_norm_over_L(tmp_path):
    L = 40.0
    cfg = tiny(optim={"name": "moga", "lr": 0.2, "step_rule": "depth_paper", "smoothness": L},
               train={"steps": 6}, logging={"log_every": 1})
    result = run(cfg, tmp_path / "run")
    assert result["status"] == "finished"
    for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train"):
        assert r["smoothness_L"] == L
        assert r["lr"] == pytest.approx(min(0.2, r["grad_dual_norm"] / L), rel=1e-12)
    assert any(r["lr"] < 0.2 for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train"))


def test_step_rule_with_a_running_smoothness_resumes_bit_for_bit(tmp_path):
    cfg = tiny(optim={"name": "moga", "lr": 1.0, "step_rule": "depth_paper", "smoothness_every": 3},
               train={"steps": 9}, logging={"log_every": 1})
    run(cfg, tmp_path / "whole")
    run(cfg, tmp_path / "parts", stop_at=5)  # the running L travels in the checkpoint
    run(cfg, tmp_path / "parts")
    assert same_tensors(final_model(tmp_path / "whole"), final_model(tmp_path / "parts"))
    train = read_metrics(tmp_path / "whole" / "metrics.jsonl", "train")
    assert train == [{**r, "time": a["time"], "samples_per_s": a["samples_per_s"]}
                     for r, a in zip(read_metrics(tmp_path / "parts" / "metrics.jsonl", "train"), train)]
    # L_0 comes from a trial step, so even the first step follows the rule, far below the cap of 1.0
    assert all(0 < r["lr"] < 1.0 and r["smoothness_L"] > 0 for r in train)


def test_step_rule_config():
    with pytest.raises(ConfigError, match="depth_paper needs unit steps"):
        build_config(tiny(optim={"name": "adamw", "step_rule": "depth_paper"}))
    with pytest.raises(ConfigError, match="smoothness does not apply to step_rule 'lr'"):
        build_config(tiny(optim={"smoothness": 3.0}))
    # New keys at their defaults leave the hash of existing runs as it was before they existed. Those runs ran
    # the paper's preset; MOGA's default now scales the tables' lr, so its hash changed (moga.train.config).
    assert build_config(tiny(optim={"preset": "paper"})).hash() == "cf8b08ecb06c28ee" != build_config(tiny()).hash()
    assert build_config(tiny(optim={"step_rule": "depth_paper"})).hash() != build_config(tiny()).hash()
    # diagnostics are logging: not hashed, a run resumes with them switched on or off
    assert build_config(tiny(logging={"diagnostics_every": 5})).hash() == build_config(tiny()).hash()


def test_diagnostics_leave_a_gpt_with_dropout_on_its_trajectory(tmp_path, text_file):
    from .conftest import gpt_config

    cfg = gpt_config(text_file, train={"steps": 5})
    run(cfg, tmp_path / "plain")
    run(gpt_config(text_file, train={"steps": 5}, logging={"diagnostics_every": 2}), tmp_path / "diag")
    assert same_tensors(final_model(tmp_path / "plain"), final_model(tmp_path / "diag"))
    records = read_metrics(tmp_path / "diag" / "metrics.jsonl", "diagnostics")
    assert [r["step"] for r in records] == [1, 2, 4]
    assert all(math.isfinite(x["update_over_lr"]) for x in records[-1]["layers"])


def test_alignment_records_read_the_hidden_momentum_and_leave_the_trajectory_alone(tmp_path, text_file):
    from .conftest import gpt_config

    before = torch.get_num_threads()  # Newton-Schulz on tiny stacked matrices: 2 OpenMP threads on a loaded
    torch.set_num_threads(1)  # 2-core machine took seconds a call (0.5 ms on one thread)
    try:
        _alignment_run(tmp_path, text_file, gpt_config)
    finally:
        torch.set_num_threads(before)


def _alignment_run(tmp_path, text_file, gpt_config):
    spectral = {"name": "moga", "lr": 0.05, "geometries": {"hidden": "spectral"}}
    run(gpt_config(text_file, optim=spectral, train={"steps": 4}), tmp_path / "plain")
    run(gpt_config(text_file, optim=spectral, train={"steps": 4}, logging={"alignment_every": 2}), tmp_path / "align")
    assert same_tensors(final_model(tmp_path / "plain"), final_model(tmp_path / "align"))
    records = read_metrics(tmp_path / "align" / "metrics.jsonl", "alignment")
    assert [r["step"] for r in records] == [2, 4]
    for r in records:  # 2 blocks x (qkv, attention out, MLP in, MLP out)
        assert r["matrices"] == 8 and len(r["layers"]) == 8
        assert 0 < r["cosine"] <= 1 and 0 <= r["gram_coherence"] <= 1 and r["gram_dominance"] > 0
    assert build_config(tiny(logging={"alignment_every": 5})).hash() == build_config(tiny()).hash()
