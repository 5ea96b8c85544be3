"""moga's optimizers on FSDP2 (DTensor) parameters and under DDP: 2 gloo processes, one launch for the file.

Each case compares 5 steps with the same optimizer in one process and counts the collectives the step
issues (moga.bench.comm.CommLog around ``opt.step()``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from .sharded_worker import FSDP_CASES, run

WORLD = 2
TOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    mp.start_processes(run, args=(WORLD, str(out / "init"), str(out)), nprocs=WORLD, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def case(results, key):
    for r in results:
        assert "error" not in r[key], r[key].get("error")
    return results


def ops(calls):
    return sorted(name for name, _ in calls)


FLAG = ("allreduce_", 4)  # the skip decision: one int32, ANDed over the ranks


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_fsdp_step_equals_one_process(results, name):
    for r in case(results, f"fsdp/{name}"):
        got = r[f"fsdp/{name}"]
        assert got["placements"] == ["(Shard(dim=0),)"]
        assert got["diff"] <= TOL, got["diff"]
        assert got["functional_diff"] <= TOL, got["functional_diff"]  # the readable step, whole tensors
        assert got["state_sharded"]


def test_role_multipliers_step_and_save_under_fsdp(results):
    """Role multipliers under a LambdaLR schedule step the shards as one process does, and DCP's sharded
    optimizer state dict carries each group's multiplier and lr into an optimizer built without them."""
    for r in case(results, "fsdp-multipliers"):
        got = r["fsdp-multipliers"]
        assert got["diff"] <= TOL, got["diff"]
        assert got["plain_diff"] > 100 * TOL  # the multipliers changed the run
        assert [tuple(x[:2]) for x in got["saved"]] == [tuple(x[:2]) for x in got["expected"]]
        for saved, expected in zip(got["saved"], got["expected"]):
            assert saved[2] == pytest.approx(expected[2], rel=1e-12)
        assert got["loaded"] == got["saved"]


@pytest.mark.parametrize("name", ["row-p2", "row-p1.5", "sign", "embedding-q3", "scaled-adamw"])
def test_local_geometries_on_shard0_communicate_only_the_skip_flag(results, name):
    for r in case(results, f"fsdp/{name}"):
        assert r[f"fsdp/{name}"]["calls"] == [list(FLAG)]


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_local_shards_step_in_the_fused_kernel(results, name):
    """Every tensor whose step needs no other rank (row, sign and embedding on Shard(0)) goes through the
    C++ kernel on its local shard, after one check of all the local gradients; col on a row-sharded matrix
    needs the other ranks' column sums: partial sums in C++, an all-reduce, the update in C++."""
    for r in case(results, f"fsdp/{name}"):
        got = r[f"fsdp/{name}"]
        steps = [n for op, n in got["kernel_calls"] if op == "moga_kernels::lmo_step"]
        split = [n for op, n in got["kernel_calls"] if op == "moga_kernels::lmo_apply"]
        assert sum(steps) == got["local_steps"]
        assert [op for op, _ in got["kernel_calls"]].count("moga_kernels::found_nonfinite") == 1
        if name in ("row-p2", "row-p1.5", "embedding-q3"):
            assert got["local_steps"] == got["matrices"] + 2  # and the two embedding tables
        if name == "col-q2":  # the embedding tables alone, the matrices in two calls around the all-reduces
            assert got["local_steps"] == 2 and sum(split) == got["matrices"]
        else:
            assert not split


def test_col_all_reduces_its_column_sums_and_maxima_once_per_group(results):
    """col on row-sharded matrices: the C++ kernel's column sums |d|^2 and maxima |d| of all the matrices
    of a param group go in one all-reduce each (a sum, a max), never the matrices."""
    for r in case(results, "fsdp/col-q2"):
        got = r["fsdp/col-q2"]
        reduces = [c for c in got["calls"] if c != list(FLAG)]
        assert all(name == "allreduce_" for name, _ in reduces)
        assert len(reduces) == 2 * got["matrix_groups"]
        assert sum(b for _, b in reduces) == 2 * 4 * got["columns"]  # a float32 sum and maximum per column


def test_muon_gathers_each_matrix_once_in_total(results):
    total = 0
    for r in case(results, "fsdp/muon"):
        got = r["fsdp/muon"]
        assert ops(got["calls"]) == ["allreduce_", "alltoall_base_", "alltoall_base_"]  # the flag, in, out
        total += sum(b for name, b in got["calls"] if name == "alltoall_base_")
    # in (shards to owners) and out (update slices back): each rank's own shard is part of its payload
    assert total == 2 * got["matrix_bytes"]


@pytest.mark.parametrize("name", ["row-p1.5", "muon"])
def test_hsdp_mesh(results, name):
    for r in case(results, f"hsdp/{name}"):
        got = r[f"hsdp/{name}"]
        assert got["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert got["diff"] <= TOL and got["state_sharded"]


@pytest.mark.parametrize("key, reduces", [
    # the C++ kernel: the sums |d|^p and the maxima |d| (which keep every magnitude exact), one each
    ("user/row(p=2)/Shard(dim=1)", 2), ("user/col(q=2)/Shard(dim=0)", 2), ("user/row(p=1.5)/Shard(dim=1)", 2),
    ("user/row(p=inf)/Shard(dim=1)", 2),  # the row maximum, then the number of entries that reach it
    ("user/col(q=3)/Shard(dim=1)", 0), ("user/sign/Shard(dim=1)", 0),
])
def test_user_placements(results, key, reduces):
    for r in case(results, key):
        got = r[key]
        assert got["diff"] <= TOL, got["diff"]
        partials = [c for c in got["calls"] if c != list(FLAG)]
        assert len(partials) == reduces and all(name == "allreduce_" for name, _ in partials)
        assert all(b == 12 * 4 if "row" in key else b == 10 * 4 for _, b in partials)  # one float per row/col


@pytest.mark.parametrize("key, reduces", [
    ("user-extreme/row(p=2)/Shard(dim=0)", 0),  # whole rows on each rank: exact in the kernel alone
    # split rows or columns out of range: the sums and maxima, then one more sum for their exact step
    ("user-extreme/row(p=2)/Shard(dim=1)", 3), ("user-extreme/col(q=2)/Shard(dim=0)", 3),
    ("user-extreme/col(q=3)/Shard(dim=0)", 3),
])
def test_rows_and_columns_at_float32_extremes_step_exactly_on_shards(results, key, reduces):
    """Rows or columns whose sums |d|^p under- or overflow float32 step exactly on shards, as on the whole
    matrix (the plain fast l2 path would give them a zero update)."""
    for r in case(results, key):
        assert r[key]["diff"] <= TOL, r[key]["diff"]
        n = 10 if "col" in key else 12  # columns or rows
        sizes = [n * 4, n * 4, n * 8]  # float32 sums and maxima, then the flagged ones' float64 sums
        assert [c for c in r[key]["calls"] if c != list(FLAG)] == [["allreduce_", b] for b in sizes[:reduces]]


@pytest.mark.parametrize("geometry", ["row(p=2)", "sign"])
def test_uneven_shards_and_an_empty_one_step_like_the_whole(results, geometry):
    rows = []
    for r in case(results, f"uneven/{geometry}"):
        got = r[f"uneven/{geometry}"]
        assert got["diff"] <= TOL, got["diff"]
        assert got["stepped"] == sum(1 for n in got["local_rows"] if n)  # the kernel takes every nonempty shard
        rows.append(got["local_rows"])
    assert rows == [[2, 1, 3], [1, 0, 2]]


def test_spectral_on_shard1(results):
    for r in case(results, "user/spectral/Shard(dim=1)"):
        assert r["user/spectral/Shard(dim=1)"]["diff"] <= TOL


def test_ddp_muon_splits_the_work_and_equals_one_process(results):
    orthogonalized = 0
    for r in case(results, "ddp/muon"):
        got = r["ddp/muon"]
        assert got["diff"] <= TOL
        assert 0 < got["orthogonalized"] < got["matrices"]
        assert ops(got["calls"]) == ["_allgather_base_"]
        orthogonalized += got["orthogonalized"]
    assert orthogonalized == got["matrices"]


@pytest.mark.parametrize("branch", ["", "bf16/"], ids=["float32-newton-schulz", "bf16-newton-schulz"])
def test_real_ddp_muon_equals_one_process_on_the_whole_batch(results, branch):
    """Newton-Schulz in float32 (CPUs without bf16 units) and in bfloat16 (with them, and GPUs), both on
    every CPU. Per-matrix (split) and batched (one process) bf16 work round differently, so the bound
    follows the roundoff of the dtype used, relative to how far each parameter moved in the 5 steps."""
    roundoff = torch.finfo(torch.bfloat16 if branch else torch.float32).eps
    for r in case(results, f"{branch}ddp/gpt"):
        got = r[f"{branch}ddp/gpt"]
        for name, diff in got["diffs"].items():
            assert diff <= TOL + 10 * roundoff * got["moved"][name], (name, diff, got["moved"][name])
        assert ops(got["calls"]) == ["_allgather_base_"]


@pytest.mark.parametrize("key", ["bf16/fsdp/muon", "bf16/ddp/muon"])
def test_muon_with_bf16_newton_schulz_equals_one_process(results, key):
    """The same per-matrix bf16 work on either side: equal to float32 roundoff."""
    for r in case(results, key):
        assert r[key]["diff"] <= TOL, r[key]["diff"]


def test_nan_on_one_rank_skips_on_all(results):
    for key in ("nonfinite/row(p=2)", "nonfinite/col(q=2)"):
        for r in case(results, key):
            assert r[key] == {"skipped": 1, "unchanged": True}


def test_bad_placement_names_parameter_and_placement(results):
    for r in results:
        assert "blocks.0.mlp.c_fc.weight" in r["error/partial"] and "Partial" in r["error/partial"]
        assert "blocks.0.mlp.c_fc.weight" in r["error/strided"] and "_StridedShard" in r["error/strided"]
        assert "lm_head.weight" in r["error/grad"] and "Shard(dim=1)" in r["error/grad"]
        # NorMuon's per-row second moment cannot follow a matrix to the rank that orthogonalizes it: refused
        assert "blocks.0.mlp.c_fc.weight" in r["error/stateful"] and "beta2=0" in r["error/stateful"]
