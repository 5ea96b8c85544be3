"""One optimizer step on FSDP2-sharded GPT-2-small shapes: step time and the bytes the optimizer communicates.

Runs ``world`` gloo processes on CPU. Each optimizer gets its own model: ``blocks`` GPT-2-small blocks of
matrices (``width`` 768: four ``768x768``, ``3072x768``, ``768x3072``) and a ``vocab x width`` token table, every tensor
``fully_shard``-ed (``Shard(0)``), with fixed random gradients. The optimizers take turns step by step; per
optimizer: the median step time (the slowest rank's), its ratio to torch's fused AdamW and to its peer
(within rounds, as in :mod:`moga.bench.optimizer`), and from :class:`moga.bench.comm.CommLog` around one
``step()`` the collectives it issues and the bytes each rank hands to them.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from moga.bench.comm import CommLog
from moga.bench.optimizer import add_ratios, kernel_path, state_bytes
from moga.optim import MOGA, Muon, ScaledAdamW

GPT2_SMALL_WIDTH = 768


def block_shapes(width: int) -> list[tuple[int, int]]:
    """One GPT-2 block's matrices (out, in): attention q, k, v, out and the MLP's two."""
    return [(width, width)] * 4 + [(4 * width, width), (width, 4 * width)]


def _groups(model: nn.Module, geometry: str | None, table: str, update: str = "lmo") -> list[dict]:
    matrices = {"params": [p for n, p in model.named_parameters() if n != "wte.weight"]}
    if geometry:
        matrices["geometry"] = geometry
    return [matrices, {"params": [model.wte.weight], "geometry": table, "layout": "io", "update": update}]


# MOGA with plain momentum, as every stored record ran before MOGA's default took Nesterov's (no collective
# depends on it).
OPTIMIZERS = {
    "torch-adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
    "torch-adamw-fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
    "moga-row-p2": lambda m: MOGA(_groups(m, "row(p=2)", "embedding(q=2)"), lr=1e-3, nesterov=False),
    "moga-row-p2-torch": lambda m: MOGA(_groups(m, "row(p=2)", "embedding(q=2)"), lr=1e-3, nesterov=False,
                                        kernel="torch"),
    "moga-row-p1.5": lambda m: MOGA(_groups(m, "row(p=1.5)", "embedding(q=2)"), lr=1e-3, nesterov=False),
    "moga-col-q2": lambda m: MOGA(_groups(m, "col(q=2)", "embedding(q=2)"), lr=1e-3, nesterov=False),
    "moga-sign": lambda m: MOGA(_groups(m, "sign", "embedding(q=2)"), lr=1e-3, nesterov=False),
    "moga-muon": lambda m: Muon(_groups(m, None, "embedding(q=2)"), lr=1e-3, weight_decay=0.0),
    "moga-adamw-scaled": lambda m: ScaledAdamW(_groups(m, None, "embedding(q=inf)", "adam"), lr=1e-3),
}


def _model(blocks: int, vocab: int, width: int) -> nn.Module:
    model = nn.Module()
    model.wte = nn.Embedding(vocab, width)
    model.blocks = nn.ModuleList(
        nn.Sequential(*(nn.Linear(i, o, bias=False) for o, i in block_shapes(width))) for _ in range(blocks))
    return model


def _sharded_setup(name: str, rank: int, blocks: int, vocab: int, width: int):
    torch.manual_seed(0)
    model = _model(blocks, vocab, width)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    gen = torch.Generator().manual_seed(rank)
    for p in model.parameters():
        g = torch.randn(p.to_local().shape, generator=gen) * 1e-3
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    opt = OPTIMIZERS[name](model)
    opt.step()  # state allocation
    return model, opt


def _worker(rank: int, world: int, init_file: str, out: str, blocks: int, vocab: int, width: int,
            repeats: int, names: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    setups = {name: _sharded_setup(name, rank, blocks, vocab, width) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name, (_, opt) in setups.items():  # take turns, so noise is shared
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank's does
            times[name].append(1e3 * elapsed.item())
    records = []
    for name, (model, opt) in setups.items():
        log = CommLog()
        with log:
            opt.step()
        sent = torch.tensor([float(log.bytes)])
        dist.all_reduce(sent)
        matrices = [p for n, p in model.named_parameters() if n != "wte.weight"]
        records.append({
            "name": name, "ms": statistics.median(times[name]), "ms_min": min(times[name]), "ms_rounds": times[name],
            "kernel": kernel_path(opt), "state_bytes": state_bytes(opt), "collectives": log.counts(),
            "bytes_rank0": log.bytes if rank == 0 else None,
            "bytes_all_ranks": int(sent.item()), "matrices": len(matrices),
            "matrix_bytes": sum(p.numel() * p.element_size() for p in matrices),
            "fan_in_floats": sum(p.shape[1] for p in matrices),
            "params": sum(p.numel() for p in model.parameters()), "world": world,
        })
    if rank == 0:
        Path(out).write_text(json.dumps(add_ratios(records)))
    dist.barrier()  # no rank closes its connections while another still uses them (gloo aborts on that)
    Path(f"{out}.done{rank}").touch()  # past the last collective: what fails after this is teardown
    dist.destroy_process_group()


def died_in_teardown(error: mp.ProcessExitedException, out: str, world: int) -> bool:
    """A rank killed by a signal after every rank passed the last barrier died tearing gloo down; the records are
    whole. (A rank aborted, "terminate called without an active exception", in 2 of about 130 runs of the
    suite's bench on a loaded 2-core CPU.) An exit code, or a rank that had not passed it, is a bench failure."""
    return error.signal_name is not None and all(Path(f"{out}.done{r}").exists() for r in range(world))


def bench_distributed(world: int = 2, blocks: int = 1, vocab: int = 50257, width: int = GPT2_SMALL_WIDTH,
                      repeats: int = 5, names: list[str] | None = None) -> list[dict]:
    names = names or list(OPTIMIZERS)
    unknown = set(names) - set(OPTIMIZERS)
    if unknown:
        raise ValueError(f"unknown optimizer(s) {sorted(unknown)}; known: {', '.join(OPTIMIZERS)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/records.json"
        try:
            mp.start_processes(_worker, args=(world, f"{tmp}/init", out, blocks, vocab, width, repeats, names),
                               nprocs=world, start_method="spawn")
        except mp.ProcessExitedException as e:
            if not died_in_teardown(e, out, world):
                raise
            warnings.warn(f"moga bench distributed: {e} in teardown, after every rank's last collective; the "
                          "records are complete", RuntimeWarning, stacklevel=2)
        return json.loads(Path(out).read_text())
