"""`moga bench optimizer`: the records it promises (timings themselves are not asserted: machines are noisy)."""

import json
import statistics

import pytest
import torch
from typer.testing import CliRunner

from moga.bench.optimizer import OPTIMIZERS, add_ratios, make_optimizers, ns_dtype
from moga.hardware import assume, facts
from moga.optim import MOGA
from moga.cli import app

@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_entry_builds_and_steps(name):
    """Each benchmarked optimizer moves every parameter to finite values (shapes of both orientations)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((12, 8), (8, 12))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    before = [p.detach().clone() for p in params]
    OPTIMIZERS[name](params).step()
    for p, b in zip(params, before):
        assert torch.isfinite(p).all() and not torch.equal(p, b)


def test_json_records_and_state_ratio():
    result = CliRunner().invoke(app, ["bench", "optimizer", "--blocks", "1", "--repeats", "1", "--warmup", "1",
                                      "--only", "torch-adamw-fused", "--only", "moga-row-p2",
                                      "--only", "moga-adamw-scaled", "--json"])
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in json.loads(result.output)}
    assert set(records) == {"torch-adamw-fused", "moga-row-p2", "moga-adamw-scaled"}
    for r in records.values():
        assert r["ms"] > 0 and r["params"] == 4 * 768 * 768 + 2 * 768 * 3072
    # Momentum only: half of AdamW's two moments (AdamW's step counters are a few bytes more).
    assert abs(records["moga-row-p2"]["state_vs_adamw"] - 0.5) < 1e-3
    assert abs(records["moga-adamw-scaled"]["state_vs_adamw"] - 1.0) < 1e-3
    # the step that ran, as seen in one more step: torch's own, moga's C++ kernel, moga's plain path (Adam's
    # direction is never fused)
    assert records["torch-adamw-fused"]["kernel"] == "torch.optim"
    assert records["moga-row-p2"]["kernel"] == "cpp"
    assert records["moga-adamw-scaled"]["kernel"] == "torch"


def test_unknown_name_is_an_error():
    result = CliRunner().invoke(app, ["bench", "optimizer", "--only", "adam"])
    assert result.exit_code != 0 and "unknown optimizer" in result.output


def test_ratios_are_relative_to_fused_adamw():
    records = add_ratios([{"name": "torch-adamw-fused", "ms": 2.0, "state_bytes": 8},
                          {"name": "moga-row-p2", "ms": 3.0, "state_bytes": 4}])
    assert records[1]["ms_vs_adamw_fused"] == 1.5 and records[1]["state_vs_adamw"] == 0.5


def test_ratio_is_taken_within_rounds():
    # the machine halves its speed after round 2: per-round ratios stay 1.5, the medians' ratio does not
    base = [2.0, 2.0, 4.0, 4.0, 4.0]
    ours = [3.0, 3.0, 6.0, 2.0, 6.0]
    records = add_ratios([{"name": "torch-adamw-fused", "ms": 4.0, "ms_rounds": base, "state_bytes": 8},
                          {"name": "moga-row-p2", "ms": 3.0, "ms_rounds": ours, "state_bytes": 4}])
    assert records[1]["ms_vs_adamw_fused"] == 1.5


def test_peer_ratios_for_the_targets_that_name_one():
    records = add_ratios([{"name": "torch-muon", "ms": 8.0, "ms_rounds": [8.0, 16.0], "state_bytes": 4},
                          {"name": "moga-muon", "ms": 3.0, "ms_rounds": [2.0, 4.0], "state_bytes": 4},
                          {"name": "moga-row-p2", "ms": 3.0, "state_bytes": 4}])
    assert records[1]["peer"] == "torch-muon" and records[1]["ms_vs_peer"] == 0.25
    assert "peer" not in records[0] and "peer" not in records[2]  # no peer, or its peer did not run
    assert "ms_vs_adamw_fused" not in records[1]  # fused AdamW did not run


def test_device_is_recorded_and_a_missing_one_is_a_clear_error():
    args = ["bench", "optimizer", "--blocks", "1", "--repeats", "1", "--warmup", "0", "--only", "moga-sign", "--json"]
    result = CliRunner().invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["device"] == "cpu"
    if not torch.cuda.is_available():
        result = CliRunner().invoke(app, [*args, "--device", "cuda"])
        assert result.exit_code != 0 and "not available here" in result.output


def test_the_kernel_only_record_is_mogas_row_step():
    """moga-row-p2-kernel times the same update as MOGA row(p=2) without checks: equal results."""
    from moga.kernels import fused_available

    if not fused_available("auto", torch.device("cpu")):
        pytest.skip("the C++ kernel does not build here")
    gen = torch.Generator().manual_seed(1)
    shapes = ((12, 8), (8, 12), (1, 5))
    grads = [torch.randn(s, generator=gen) for s in shapes]
    start = [torch.randn(s, generator=gen) for s in shapes]
    runs = []
    for name in ("moga-row-p2-kernel", "moga-row-p2-nocheck"):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = OPTIMIZERS[name](params)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        runs.append([p.detach() for p in params])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_ratio_quartiles_say_how_much_the_rounds_agree():
    base = [2.0] * 5
    ours = [1.0, 2.0, 3.0, 4.0, 5.0]  # per-round ratios 0.5 .. 2.5
    records = add_ratios([{"name": "torch-adamw-fused", "ms": 2.0, "ms_rounds": base, "state_bytes": 8},
                          {"name": "moga-row-p2", "ms": 3.0, "ms_rounds": ours, "state_bytes": 4}])
    assert records[1]["ms_vs_adamw_fused"] == 1.5
    assert records[1]["ms_vs_adamw_fused_iqr"] == statistics.quantiles([0.5, 1.0, 1.5, 2.0, 2.5], n=4)[::2]
    assert records[1]["ms_vs_adamw_fused_iqr"][0] < 1.5 < records[1]["ms_vs_adamw_fused_iqr"][1]


def test_cpu_clock_and_threads_are_recorded_and_the_callers_threads_restored():
    threads = torch.get_num_threads()
    result = CliRunner().invoke(app, ["bench", "optimizer", "--blocks", "1", "--repeats", "2", "--warmup", "0",
                                      "--only", "torch-adamw-fused", "--only", "moga-row-p2-flag",
                                      "--clock", "cpu", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in json.loads(result.output)}
    assert all(r["clock"] == "cpu" and r["threads"] == 1 and len(r["ms_rounds"]) == 2 for r in records.values())
    low, high = records["moga-row-p2-flag"]["ms_vs_adamw_fused_iqr"]
    assert 0 < low <= records["moga-row-p2-flag"]["ms_vs_adamw_fused"] <= high
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("args,message", [(["--clock", "gpu"], "clock must be one of"),
                                          (["--clock", "cpu", "--device", "cuda"], "wall clock")])
def test_bad_clock_is_an_error(args, message):
    result = CliRunner().invoke(app, ["bench", "optimizer", "--only", "torch-adamw-fused", *args])
    assert result.exit_code != 0 and message in result.output


def test_moga_records_name_their_momentum():
    """Each MOGA record runs the momentum its name says (Nesterov only where named), whatever MOGA's default."""
    params = [torch.nn.Parameter(torch.zeros(4, 3))]
    for name, make in OPTIMIZERS.items():
        opt = make(params)
        if isinstance(opt, MOGA):
            assert all(g["nesterov"] == ("nesterov" in name) for g in opt.param_groups), name


def test_float32_torch_muon_is_torchs_muon_with_float32_newton_schulz():
    """torch-muon-float32 is torch.optim.Muon with its iteration in float32: equal to moga's Muon with torch's
    scale and float32 Newton-Schulz, and not to torch's own (bfloat16) step; torch's function is restored."""
    from torch.optim import _muon

    from moga.optim import Muon

    original = _muon._zeropower_via_newtonschulz
    gen = torch.Generator().manual_seed(2)
    start, grad = torch.randn(24, 16, generator=gen), torch.randn(24, 16, generator=gen)
    results = {}
    for name, make in [("torch32", OPTIMIZERS["torch-muon-float32"]), ("torch", OPTIMIZERS["torch-muon"]),
                       ("moga32", lambda ps: Muon(ps, lr=1e-3, scale="torch", ns_dtype="float32", momentum=0.95,
                                                 nesterov=True, weight_decay=0.0, kernel="torch"))]:
        p = torch.nn.Parameter(start.clone())
        p.grad = grad.clone()
        make([p]).step()
        results[name] = p.detach()
    assert torch.equal(results["torch32"], results["moga32"])
    assert not torch.equal(results["torch32"], results["torch"])
    assert _muon._zeropower_via_newtonschulz is original


def test_records_name_the_cpu_kind():
    result = CliRunner().invoke(app, ["bench", "optimizer", "--blocks", "1", "--repeats", "1", "--warmup", "0",
                                      "--only", "torch-adamw-fused", "--json"])
    assert result.exit_code == 0, result.output
    cpu = json.loads(result.output)[0]["cpu"]
    assert cpu["model"] and cpu["kernel_capability"] in ("AVX512", "AVX2", "DEFAULT") and cpu["torch_capability"]
    assert set(cpu["flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert cpu["bf16_matmul"] == facts().bf16_matmul


@pytest.mark.parametrize("bf16_units", [False, True])
def test_muons_peer_is_torchs_muon_with_the_same_newton_schulz_dtype(bf16_units):
    with assume(bf16_matmul=bf16_units):
        opts = make_optimizers(["torch-muon", "torch-muon-float32", "moga-muon"], [(12, 8)])
        dtypes = {name: ns_dtype(opt, torch.device("cpu")) for name, opt in opts.items()}
    assert dtypes == {"torch-muon": "bfloat16" if bf16_units else "bfloat16 (emulated)",
                      "torch-muon-float32": "float32", "moga-muon": dtypes["torch-muon" if bf16_units else
                                                                          "torch-muon-float32"]}
    records = add_ratios([{"name": name, "ms": 1.0, "state_bytes": 4, "ns_dtype": d} for name, d in dtypes.items()])
    assert records[2]["peer"] == ("torch-muon" if bf16_units else "torch-muon-float32")

def test_default_run_skips_the_hybrids_and_emulated_peers_with_a_line_and_all_times_them():
    from moga.bench.optimizer import HYBRIDS, default_names
    from moga.hardware import assume

    hybrids = sorted(HYBRIDS)
    with assume(bf16_matmul=False):
        names, note = default_names("cpu")
        everything, warning = default_names("cpu", full=True)
    skipped = sorted(set(OPTIMIZERS) - set(names))
    assert skipped == sorted([*hybrids, "torch-muon"]) and "moga-muon" in names and "torch-muon-float32" in names
    assert "emulates bfloat16" in note and "--all times them" in note and all(h in note for h in hybrids)
    assert everything == list(OPTIMIZERS) and "torch-muon" in warning and "emulates bfloat16" in warning
    with assume(bf16_matmul=True):
        names, note = default_names("cpu")
        assert sorted(set(OPTIMIZERS) - set(names)) == hybrids and "emulates" not in note
        assert default_names("cpu", full=True) == (list(OPTIMIZERS), None)
    with assume(bf16_matmul=False):  # the command prints the line; --only runs what it names
        result = CliRunner().invoke(app, ["bench", "optimizer", "--blocks", "1", "--repeats", "1", "--warmup", "0",
                                          "--only", "torch-adamw-fused", "--json"])
    assert result.exit_code == 0 and "skipped" not in result.output


@pytest.mark.parametrize("name, plain", [("moga-row-p2-flag", "moga-row-p2"),
                                         ("moga-adamw-scaled-flag", "moga-adamw-scaled")])
def test_flag_records_step_as_their_plain_record_and_obey_the_flag(name, plain):
    """A record handed the non-finite flag (a clear 0-d bool, as ``moga train`` hands clipping's verdict) steps bit
    for bit as its record without one on finite gradients, and reads the flag: set, it leaves the weights."""
    gen = torch.Generator().manual_seed(2)
    shapes = ((12, 8), (8, 12))
    grads = [torch.randn(s, generator=gen) for s in shapes]
    start = [torch.randn(s, generator=gen) for s in shapes]
    runs = {}
    for n in (name, plain):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt = OPTIMIZERS[n](params)
        opt.step()
        runs[n] = (params, opt)
    for a, b in zip(runs[name][0], runs[plain][0]):
        assert torch.equal(a, b)
    params, opt = runs[name]
    assert opt.found_inf.dtype == torch.bool and opt.found_inf.dim() == 0 and not opt.found_inf
    before = [p.detach().clone() for p in params]
    opt.found_inf = torch.ones((), dtype=torch.bool)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
