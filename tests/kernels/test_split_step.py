"""The split step (``fused_split_step_``): rows or columns cut between two ranks give the same step as the
whole tensor in the fused kernel. The two "ranks" are two threads; ``reduce`` is the all-reduce they would
make, a sum or a maximum of their two partials, each thread waiting for the other's (a barrier, no sleep).
Addition is commutative in IEEE arithmetic, so both threads hold bitwise the same combined sums.
"""

import threading

import pytest
import torch

from moga.geometry import parse_geometry
from moga.kernels import fused_lmo_step_, fused_split_step_
from moga.layout import Layout
from moga.layout import ShardLayout

from .test_lmo_step import TOL, built  # noqa: F401  (the session's one build)

TOL = {**TOL, torch.bfloat16: 1e-2}  # one bfloat16 ulp: the sums add in another order


class TwoRanks:
    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=120)  # a failing rank breaks it: the other raises, no hang
        self.slots = [None, None]
        self.ops: list[list[tuple[str, int]]] = [[], []]

    def reduce_for(self, rank: int):
        def reduce(x: torch.Tensor, op: str) -> torch.Tensor:
            self.ops[rank].append((op, x.numel()))
            self.slots[rank] = x.clone()
            self.barrier.wait()
            other = self.slots[1 - rank]
            combined = x + other if op == "sum" else torch.maximum(x, other)
            self.barrier.wait()  # both have read before either writes its next partial
            return x.copy_(combined)

        return reduce


def on_two_ranks(ranks: TwoRanks, step) -> None:
    """``step(r)`` on two threads; an error in either is raised here (the other's barrier is broken)."""
    errors = []

    def rank(r):
        try:
            step(r)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)
            ranks.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def whole_and_split(spec, shape, cut, dtype, momentum, nesterov, wd, extreme=None, steps=3):
    """W after ``steps`` steps on the whole matrix and on its two parts (cut along the normalized axis at
    ``cut``), and the reductions each part made."""
    geometry = parse_geometry(spec)
    layout = Layout("oi")
    axis = 0 if spec.startswith("col") else 1  # col normalizes along out (dim 0), row along in (dim 1)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=gen).to(dtype)
    grads = []
    for _ in range(steps):
        g = torch.randn(shape, generator=gen)
        if extreme is not None:  # two lines across the cut to 1e-30, two to 1e25: their sums under- and overflow
            index = [slice(None)] * 2
            for lines, scale in (([0, 3], 1e-30), ([1, 4], 1e25)):
                index[1 - axis] = lines
                g[tuple(index)] *= scale
        grads.append(g.to(dtype))
    whole, m = w.clone(), torch.zeros_like(w) if momentum else None
    for g in grads:
        fused_lmo_step_(geometry, [layout], [whole], [g], [m] if momentum else None, 0.1, momentum, nesterov, wd)

    parts = [t.contiguous() for t in w.tensor_split([cut], dim=axis)]
    bufs = [torch.zeros_like(t) for t in parts] if momentum else None
    ranks = TwoRanks()
    shard_layout = ShardLayout("oi", tuple(shape))  # the factors of the whole matrix

    def rank(r):
        for g in grads:
            local_grad = g.tensor_split([cut], dim=axis)[r].contiguous()
            left = fused_split_step_(geometry, [shard_layout], [parts[r]], [local_grad], [bufs[r]] if momentum else None,
                                     0.1, momentum, nesterov, wd, ranks.reduce_for(r))
            assert left == [], left

    on_two_ranks(ranks, rank)
    return whole, torch.cat(parts, dim=axis), ranks.ops


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["col(q=2)", "col(q=3)", "row(p=2)", "row(p=1.5)", "row(p=3.2)"])
@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.9, False, 0.1), (0.9, True, 0.0)])
def test_split_step_equals_the_whole(built, dtype, spec, momentum, nesterov, wd):
    shape = (37, 21) if spec.startswith("col") else (21, 37)  # 37 along the normalized axis: two column chunks
    whole, split, ops = whole_and_split(spec, shape, 20, dtype, momentum, nesterov, wd)
    scale = whole.double().abs().max().item()
    assert (whole.double() - split.double()).abs().max().item() <= TOL[dtype] * scale
    assert ops[0] == ops[1] == [("sum", 21), ("max", 21)] * 3  # one sum and one max per step


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("spec", ["col(q=2)", "row(p=2.5)"])
def test_lines_out_of_range_step_exactly(built, dtype, spec):
    shape = (12, 10) if spec.startswith("col") else (10, 12)
    whole, split, ops = whole_and_split(spec, shape, 5, dtype, 0.9, True, 0.1, extreme=True)
    assert torch.isfinite(split).all()
    assert (whole.double() - split.double()).abs().max().item() <= TOL[dtype] * whole.double().abs().max().item()
    extra = [("sum", 10)] if dtype == torch.float32 else []  # float64 sums hold 1e25^2 and 1e-30^2
    assert ops[0] == ops[1] == ([("sum", 10), ("max", 10)] + extra) * 3


def test_an_empty_part_still_takes_part(built):
    """A rank with no rows of a col matrix (FSDP2's uneven split) adds zeros and waits for the others."""
    whole, split, ops = whole_and_split("col(q=2)", (5, 8), 5, torch.float32, 0.9, False, 0.0, extreme=True)
    assert (whole - split).abs().max().item() <= 1e-6 * whole.abs().max().item()
    assert ops[0] == ops[1] and len(ops[0]) == 3 * 3  # the exact step's sum too, on the empty part as well


def test_a_skipped_step_touches_nothing_and_still_reduces(built):
    """found_inf set (a non-finite gradient on some rank): W and m stay bitwise as they were, and both
    ranks still make the same reductions, so no rank waits for a collective the other skipped."""
    geometry, shape = parse_geometry("col(q=2)"), (9, 6)
    gen = torch.Generator().manual_seed(4)
    parts = [torch.randn(shape, generator=gen) for _ in (0, 1)]
    bufs = [torch.randn(shape, generator=gen) for _ in (0, 1)]
    grads = [torch.randn(shape, generator=gen) for _ in (0, 1)]
    grads[1][2, 3] = float("nan")
    before = [t.clone() for t in parts + bufs]
    ranks = TwoRanks()
    on_two_ranks(ranks, lambda r: fused_split_step_(
        geometry, [ShardLayout("oi", (18, 6))], [parts[r]], [grads[r]], [bufs[r]], 0.1, 0.9, False, 0.1,
        ranks.reduce_for(r), found_inf=torch.ones(())))
    assert all(torch.equal(a, b) for a, b in zip(parts + bufs, before))
    assert ranks.ops[0] == ranks.ops[1] == [("sum", 6), ("max", 6)]
