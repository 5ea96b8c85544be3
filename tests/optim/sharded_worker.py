"""The 2-process half of test_sharded.py: every case runs in one launch, results go to a JSON file per rank."""

from __future__ import annotations

import json
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import moga.geometry
from moga.bench.comm import CommLog
from moga.models.gpt import GPT, GPTConfig
from moga.geometry import parse_geometry
from moga.hardware import assume
from moga.kernels import FusedCalls, covers
from moga.layout import as_layout
from moga.optim import MOGA, Muon, ScaledAdamW
from moga.optim.sharded import reduce_key
from moga.roles import MATRIX_ROLES

from .reference import ReferenceStep

STEPS = 5


def matrices(geometry: str) -> dict[str, str]:
    return {role: geometry for role in MATRIX_ROLES}


FSDP_CASES = {
    "row-p2": lambda m: MOGA(m, lr=0.02, p=2),
    "row-p1.5": lambda m: MOGA(m, lr=0.02, p=1.5),
    "col-q2": lambda m: MOGA(m, lr=0.02, geometries=matrices("col(q=2)")),
    "sign": lambda m: MOGA(m, lr=0.02, geometries=matrices("sign"), vectors="sign"),
    "embedding-q3": lambda m: MOGA(m, lr=0.02, embedding_q=3.0),
    "muon": lambda m: Muon(m, lr=0.02, preset="moga"),  # spectral on every matrix: the most to shard
    # a row-family hybrid gathers whole matrices as Muon does (docs/math.md §2.9)
    "spectral-row": lambda m: MOGA(m, lr=0.02, geometries={"hidden": "spectral_row"}),
    "scaled-adamw": lambda m: ScaledAdamW(m, lr=0.01),
}


def gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False, seed=0))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 32, (4, 8), generator=g)
    return idx, torch.roll(idx, -1, 1)


def train(model, opt, logs=None, kernel_logs=None):
    for step in range(STEPS):
        _, loss = model(*batch(step))
        loss.backward()
        log, kernels = CommLog(), FusedCalls()
        with log, kernels:
            opt.step()
        opt.zero_grad()
        if logs is not None:
            logs.append(log)
            kernel_logs.append(kernels)


def fsdp_case(name: str, mesh) -> dict:
    ref = gpt()
    train(ref, FSDP_CASES[name](ref))
    model = gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = FSDP_CASES[name](model)
    logs, kernel_logs = [], []
    train(model, opt, logs, kernel_logs)
    diffs = {n: (p.full_tensor() - q).abs().max().item()
             for (n, p), q in zip(model.named_parameters(), ref.parameters())}
    worst = max(diffs, key=diffs.get)
    readable = gpt()  # moga.optim.functional, one whole tensor at a time
    train(readable, ReferenceStep(FSDP_CASES[name](readable).param_groups))
    functional_diff = max((p.full_tensor() - q).abs().max().item()
                          for p, q in zip(model.parameters(), readable.parameters()))
    state_ok = all(
        isinstance(v, DTensor) and v.placements == p.placements
        for p in model.parameters() for v in opt.state[p].values() if torch.is_tensor(v) and v.ndim
    )
    n_matrices = sum(1 for e in opt.plan if e.role in MATRIX_ROLES)
    geometries = [(e, parse_geometry(e.geometry)) for e in opt.plan if e.update == "lmo"]
    local_steps = sum(1 for e, g in geometries if covers(g) and reduce_key(e.param, g, as_layout(e.layout)) is None)
    return {"diff": diffs[worst], "worst": worst, "functional_diff": functional_diff, "diffs": {k: v for k, v in diffs.items() if v}, "state_sharded": state_ok, "calls": logs[-1].calls, "matrices": n_matrices,
            "kernel_calls": kernel_logs[-1].ops, "local_steps": local_steps,
            "matrix_bytes": sum(e.param.numel() * 4 for e in opt.plan if e.role in MATRIX_ROLES),
            "columns": sum(e.param.shape[1] for e in opt.plan if e.role in MATRIX_ROLES),
            "matrix_groups": len({e.role for e in opt.plan if e.role in MATRIX_ROLES}),
            "placements": sorted({str(p.placements) for p in model.parameters()})}


MULTIPLIERS = {"embedding": 0.5, "readout": 2.0, "vector": 4.0}


def multipliers_case(mesh) -> dict:
    """MOGA with role multipliers under a LambdaLR schedule, FSDP2 against one process; then the sharded
    state dict (DCP's get/set_optimizer_state_dict) into an optimizer built without multipliers."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.optim.lr_scheduler import LambdaLR

    def make(model, **kw):
        opt = MOGA(model, lr=0.02, **kw)
        return opt, LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def steps(model, opt, sched):
        for step in range(STEPS):
            _, loss = model(*batch(step))
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    ref, plain = gpt(), gpt()
    steps(ref, *make(ref, lr_multipliers=MULTIPLIERS))
    steps(plain, *make(plain))
    model = gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make(model, lr_multipliers=MULTIPLIERS)
    steps(model, opt, sched)
    full = [p.full_tensor() for p in model.parameters()]
    state = get_optimizer_state_dict(model, opt)
    fresh, _ = make(model)
    set_optimizer_state_dict(model, fresh, state)
    return {"diff": max((p - q).abs().max().item() for p, q in zip(full, ref.parameters())),
            "plain_diff": max((p - q).abs().max().item() for p, q in zip(full, plain.parameters())),
            "saved": sorted({(g["role"], g["lr_multiplier"], g["lr"]) for g in state["param_groups"]}),
            "loaded": sorted({(g["role"], g["lr_multiplier"], g["lr"]) for g in fresh.param_groups}),
            "expected": sorted({(g["role"], m, 0.02 / (1 + STEPS) * m)
                                for g in opt.param_groups for m in [MULTIPLIERS.get(g["role"], 1.0)]})}


def user_placement_case(geometry: str, placement, mesh, extreme: str = "") -> dict:
    """One 12 x 10 matrix sharded as the user says, against the same step on the whole matrix. ``extreme``
    ("rows" or "cols") scales two rows (one in each rank's Shard(0) half) or two columns of the gradient
    to 1e-30 and two to 1e25: their sums of squares under- and overflow float32."""
    gen = torch.Generator().manual_seed(0)
    w, grads = torch.randn(12, 10, generator=gen), [torch.randn(12, 10, generator=gen) for _ in range(STEPS)]
    for g in grads:
        if extreme == "rows":
            g[[0, 6]] *= 1e-30
            g[[1, 7]] *= 1e25
        elif extreme == "cols":
            g[:, [0, 6]] *= 1e-30
            g[:, [1, 7]] *= 1e25
    ref = nn.Parameter(w.clone())
    sharded = nn.Parameter(distribute_tensor(w.clone(), mesh, [placement]))
    ref_opt = MOGA([ref], lr=0.1, geometry=geometry)
    opt = MOGA([sharded], lr=0.1, geometry=geometry)
    logs = []
    for g in grads:
        ref.grad = g.clone()
        ref_opt.step()
        sharded.grad = distribute_tensor(g.clone(), mesh, [placement])
        log = CommLog()
        with log:
            opt.step()
        logs.append(log)
    return {"diff": (sharded.full_tensor() - ref).abs().max().item(), "calls": logs[-1].calls}


def uneven_case(geometry: str, mesh) -> dict:
    """Shapes that FSDP2's Shard(0) splits unevenly over 2 ranks (2 + 1 rows, and 1 + 0: a rank with an
    empty shard), against the same steps on the whole tensors."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(3, 5), (1, 5), (5, 3)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    whole = [nn.Parameter(t.clone()) for t in init]
    shards = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
    ref_opt, opt = MOGA(whole, lr=0.1, geometry=geometry), MOGA(shards, lr=0.1, geometry=geometry)
    for _ in range(STEPS):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g in zip(whole, shards, grads):
            p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
        ref_opt.step()
        with FusedCalls() as calls:
            opt.step()
    return {"diff": max((q.full_tensor() - p).abs().max().item() for p, q in zip(whole, shards)),
            "local_rows": [q.to_local().shape[0] for q in shards], "stepped": calls.stepped}


def error_case(make) -> str:
    try:
        make()
    except ValueError as e:
        return str(e)
    return ""


def ddp_muon_case() -> dict:
    """Plain replicated matrices (as under DDP): distributed Muon against every rank computing everything."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(24, 16), (16, 24), (16, 16), (32, 16), (16, 16)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    split = [nn.Parameter(t.clone()) for t in init]
    alone = [nn.Parameter(t.clone()) for t in init]
    opt_split = Muon(split, lr=0.02, preset="moga")
    opt_alone = Muon(alone, lr=0.02, preset="moga", distributed=False)
    calls, logs = [0], []
    original = moga.geometry.orthogonalize

    def counted(mat, *args, **kwargs):
        calls[0] += mat.shape[0]
        return original(mat, *args, **kwargs)

    for gs in grads:
        for p, q, g in zip(split, alone, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt_alone.step()
        calls[0] = 0
        moga.geometry.orthogonalize = counted
        log = CommLog()
        try:
            with log:
                opt_split.step()
        finally:
            moga.geometry.orthogonalize = original
        logs.append(log)
    return {"diff": max((p - q).abs().max().item() for p, q in zip(split, alone)),
            "orthogonalized": calls[0], "matrices": len(shapes), "calls": logs[-1].calls}


def ddp_gpt_case() -> dict:
    """Real DDP, each rank on half of the batch: distributed Muon against one process on the whole batch."""
    from torch.nn.parallel import DistributedDataParallel

    ref = gpt()
    ref_opt = Muon(ref, lr=0.02, preset="moga", distributed=False)
    model = DistributedDataParallel(gpt())
    opt = Muon(model.module, lr=0.02, preset="moga")
    rank, logs = dist.get_rank(), []
    for step in range(STEPS):
        idx, targets = batch(step)
        ref(idx, targets)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(idx[2 * rank: 2 * rank + 2], targets[2 * rank: 2 * rank + 2])[1].backward()
        log = CommLog()
        with log:
            opt.step()
        opt.zero_grad()
        logs.append(log)
    diffs = {n: (p - q).abs().max().item() for (n, p), q in zip(model.module.named_parameters(), ref.parameters())}
    moved = {n: (q - p0).abs().max().item() for (n, q), p0 in zip(ref.named_parameters(), gpt().parameters())}
    return {"diff": max(diffs.values()), "diffs": diffs, "moved": moved, "calls": logs[-1].calls}


def nonfinite_case(mesh, geometry: str) -> dict:
    """A NaN in one rank's shard only: both ranks skip the step, weights and momentum untouched (col on
    Shard(0) also makes its all-reduces of column sums on both ranks, so neither waits for the other)."""
    w = torch.ones(4, 6)
    p = nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    opt = MOGA([p], lr=0.1, geometry=geometry)
    p.grad = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
    opt.step()
    before = (p.full_tensor().clone(), opt.state[p]["momentum_buffer"].full_tensor().clone())
    grad = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
    if dist.get_rank() == 1:
        grad.to_local()[0, 0] = float("nan")
    p.grad = grad
    opt.step()
    after = (p.full_tensor(), opt.state[p]["momentum_buffer"].full_tensor())
    return {"skipped": opt.skipped_steps, "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}


def cases(record, mesh, world: int) -> None:
    for name in FSDP_CASES:
        record(f"fsdp/{name}", lambda: fsdp_case(name, mesh))
    record("fsdp-multipliers", lambda: multipliers_case(mesh))
    hsdp = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    for name in ("row-p1.5", "muon"):
        record(f"hsdp/{name}", lambda: fsdp_case(name, hsdp))
    for geometry, placement in (("row(p=1.5)", Shard(1)), ("row(p=2)", Shard(1)), ("row(p=inf)", Shard(1)), ("col(q=2)", Shard(0)),
                                ("col(q=3)", Shard(1)), ("sign", Shard(1)), ("spectral", Shard(1))):
        record(f"user/{geometry}/{placement!r}", lambda: user_placement_case(geometry, placement, mesh))
    for geometry, placement, extreme in (("row(p=2)", Shard(0), "rows"), ("row(p=2)", Shard(1), "rows"),
                                         ("col(q=2)", Shard(0), "cols"), ("col(q=3)", Shard(0), "cols")):
        record(f"user-extreme/{geometry}/{placement!r}",
               lambda: user_placement_case(geometry, placement, mesh, extreme=extreme))
    for geometry in ("row(p=2)", "sign"):
        record(f"uneven/{geometry}", lambda: uneven_case(geometry, mesh))
    record("ddp/muon", ddp_muon_case)
    record("ddp/gpt", ddp_gpt_case)
    for geometry in ("row(p=2)", "col(q=2)"):
        record(f"nonfinite/{geometry}", lambda: nonfinite_case(mesh, geometry))


def run(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    results: dict = {}

    def record(key, fn):
        try:
            results[key] = fn()
        except Exception:  # noqa: BLE001 -- reported to the test, which fails on it
            results[key] = {"error": traceback.format_exc()}

    with assume(bf16_matmul=False):  # Newton-Schulz in float32 on every CPU: equal to one process to 1e-6
        cases(record, mesh, world)
    with assume(bf16_matmul=True):  # the branch of CPUs with bf16 units and of GPUs, run on every CPU
        record("bf16/fsdp/muon", lambda: fsdp_case("muon", mesh))
        record("bf16/ddp/muon", ddp_muon_case)
        record("bf16/ddp/gpt", ddp_gpt_case)

    def bad(geometry, placements):
        t = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)])
        p = nn.Parameter(DTensor.from_local(t.to_local(), mesh, placements, run_check=False))
        return lambda: MOGA([{"params": [p], "names": ["blocks.0.mlp.c_fc.weight"]}], geometry=geometry)

    results["error/partial"] = error_case(bad("row(p=2)", [Partial()]))
    results["error/strided"] = error_case(bad("row(p=2)", [_StridedShard(0, split_factor=2)]))
    results["error/stateful"] = error_case(bad("spectral_row(beta2=0.95)", [Shard(0)]))

    def grad_sharded_otherwise():
        p = nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)]))
        opt = MOGA([{"params": [p], "names": ["lm_head.weight"]}], geometry="row(p=2)")
        p.grad = distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])
        opt.step()

    results["error/grad"] = error_case(grad_sharded_otherwise)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()  # no rank closes its connections while another still uses them (gloo aborts on that)
    dist.destroy_process_group()
