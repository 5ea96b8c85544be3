"""Time one optimizer step on GPT-2-small-shaped matrices, ours beside torch's, in one run.

Per block: four 768x768 (attention q, k, v, out), one 3072x768 and one 768x3072 (MLP). The
optimizers take turns step by step over the same parameters, so machine noise hits all of them alike;
each reports its median step time and the bytes of its state. The ratio to torch's fused AdamW is the
median over rounds of the ratio within a round, so a shared host that speeds up or slows down during
the run does not tilt it; its quartiles over rounds say how much the rounds agreed.

The clock is the wall clock, or with ``clock="cpu"`` the CPU time of the process (all its threads), which
leaves out the time a busy host keeps it off the CPU: on a shared machine, time one thread that way. With
several threads a descheduled one stalls the others at the end of every parallel region, which the wall
clock counts and the CPU clock counts as spinning, if at all.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from moga.geometry import parse_geometry
from moga.hardware import facts
from moga.kernels import FusedCalls, fused_lmo_step_
from moga.kernels.build import capability
from moga.layout import resolve_layout
from moga.optim import MOGA, Muon, ScaledAdamW
from moga.orthogonalize import compute_dtype, newton_schulz

GPT2_SMALL_BLOCK = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}

class KernelOnly(torch.optim.Optimizer):
    """moga's fused row(p=2) step (:func:`moga.kernels.fused_lmo_step_`) called directly on every matrix,
    with momentum and no optimizer logic around it (no checks, no schedule): what MOGA's step adds is the
    difference to moga-row-p2-nocheck."""

    kernel = "cpp"
    geometry = parse_geometry("row(p=2)")

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        ps = [p for g in self.param_groups for p in g["params"]]
        for p in ps:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        fused_lmo_step_(self.geometry, [resolve_layout(None, p) for p in ps], ps, [p.grad for p in ps],
                        [self.state[p]["momentum_buffer"] for p in ps], group["lr"], group["momentum"],
                        nesterov=False, weight_decay=0.0)


def flag_supplied(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer handed the step's non-finite flag, so it makes no pass of its own over the gradients: a
    0-d bool on the parameters' device, as ``moga train`` passes clipping's verdict (``step(found_inf=...)``),
    set the way ``torch.amp.GradScaler`` sets its own (the ``found_inf`` attribute), so that the plain
    ``step()`` the bench times reads it without a wrapper around the step."""
    opt.found_inf = torch.zeros((), dtype=torch.bool, device=opt.param_groups[0]["params"][0].device)
    return opt


class TorchMuonFloat32(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in float32 (torch's own runs it in bfloat16, which CPUs
    without bfloat16 units emulate): the like-for-like peer of moga's Muon where ``ns_dtype="auto"`` picks
    float32. Same operations (:func:`moga.orthogonalize.newton_schulz` is torch's in a chosen dtype)."""

    ns_dtype = "float32"

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim import _muon

        original = _muon._zeropower_via_newtonschulz
        _muon._zeropower_via_newtonschulz = lambda grad, coefficients, steps, eps: newton_schulz(
            grad, steps, coefficients, torch.float32, eps)
        try:
            return super().step(closure)
        finally:
            _muon._zeropower_via_newtonschulz = original


# MOGA's records name their momentum (plain, unless the name says Nesterov), so that each measures the
# same step whatever MOGA's default.
OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "torch-adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "torch-adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    # the same memory streams as the row and sign steps (g read; momentum and W read and written) in torch's
    # fused loop: what those streams cost on this CPU, the floor a one-pass kernel could reach
    "torch-sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, nesterov=True, fused=True),
    "torch-muon": lambda ps: torch.optim.Muon(ps, lr=1e-3, weight_decay=0.0),
    "torch-muon-float32": lambda ps: TorchMuonFloat32(ps, lr=1e-3, weight_decay=0.0),
    "moga-row-p2": lambda ps: MOGA(ps, lr=1e-3, geometry="row(p=2)", nesterov=False),
    "moga-row-p2-nocheck": lambda ps: MOGA(ps, lr=1e-3, geometry="row(p=2)", nonfinite="ignore", nesterov=False),
    "moga-row-p2-flag": lambda ps: flag_supplied(MOGA(ps, lr=1e-3, geometry="row(p=2)", nesterov=False)),
    "moga-row-p2-nesterov-flag": lambda ps: flag_supplied(MOGA(ps, lr=1e-3, geometry="row(p=2)", nesterov=True)),
    "moga-row-p2-kernel": lambda ps: KernelOnly(ps, lr=1e-3),
    "moga-row-p1.5": lambda ps: MOGA(ps, lr=1e-3, geometry="row(p=1.5)", nesterov=False),
    "moga-row-p2.5": lambda ps: MOGA(ps, lr=1e-3, geometry="row(p=2.5)", nesterov=False),
    "moga-col-q2": lambda ps: MOGA(ps, lr=1e-3, geometry="col(q=2)", nesterov=False),
    "moga-col-q2-nocheck": lambda ps: MOGA(ps, lr=1e-3, geometry="col(q=2)", nonfinite="ignore", nesterov=False),
    "moga-sign": lambda ps: MOGA(ps, lr=1e-3, geometry="sign", nesterov=False),
    "moga-sign-nocheck": lambda ps: MOGA(ps, lr=1e-3, geometry="sign", nonfinite="ignore", nesterov=False),
    "moga-muon": lambda ps: Muon(ps, lr=1e-3, weight_decay=0.0),  # as torch-muon above
    # the row-family hybrids (docs/math.md §2.9), with Muon's momentum: whole-matrix steps like Muon's
    "moga-row-spectral-nesterov": lambda ps: MOGA(ps, lr=1e-3, geometry="row_spectral", momentum=0.95,
                                                  nesterov=True),
    "moga-spectral-row-nesterov": lambda ps: MOGA(ps, lr=1e-3, geometry="spectral_row", momentum=0.95,
                                                  nesterov=True),
    "moga-spectral-row-beta2-nesterov": lambda ps: MOGA(ps, lr=1e-3, geometry="spectral_row(beta2=0.95)",
                                                        momentum=0.95, nesterov=True),
    "moga-adamw-scaled": lambda ps: ScaledAdamW(ps, lr=1e-3),
    "moga-adamw-scaled-flag": lambda ps: flag_supplied(ScaledAdamW(ps, lr=1e-3)),
}


def kernel_path(opt: torch.optim.Optimizer) -> str:
    """Which step ran, seen in one more step: "cpp" (moga's fused C++ kernel) or "op" (its custom op's
    CUDA step) for every tensor, "torch" (moga's plain path) for none, "cpp 3/7" for some; "torch.optim"."""
    if getattr(opt, "kernel", None) is None:
        return "torch.optim"
    total = sum(1 for g in opt.param_groups for p in g["params"] if p.grad is not None)
    with FusedCalls() as calls:
        opt.step()
    if not calls.stepped:
        return "torch"
    label = "cpp" if any(name.startswith("moga_kernels::") for name, _ in calls.ops) else "op"
    return label if calls.stepped == total else f"{label} {calls.stepped}/{total}"


def cpu_kind() -> dict:
    """The CPU the bench ran on: its model name, the vector and bfloat16 flags that decide the kernels' speed,
    torch's at::vec capability and the one moga's C++ kernel is built for, and whether bfloat16 matrix units
    are there (moga.hardware: where not, bfloat16 matmuls are emulated)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"model": model, "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "kernel_capability": capability(),
            "bf16_matmul": facts().bf16_matmul}


def ns_dtype(opt: torch.optim.Optimizer, device: torch.device) -> str | None:
    """The Newton-Schulz dtype a Muon record runs (None for the others), and "(emulated)" after bfloat16 on a CPU
    without bfloat16 units."""
    if isinstance(opt, TorchMuonFloat32):
        dtype = torch.float32
    elif isinstance(opt, torch.optim.Muon):
        dtype = torch.bfloat16  # torch.optim.Muon's, fixed
    elif isinstance(opt, Muon):
        dtype = compute_dtype(opt._plans[0].geometry.dtype, device)
    else:
        return None
    name = str(dtype).removeprefix("torch.")
    return f"{name} (emulated)" if dtype == torch.bfloat16 and device.type == "cpu" and not facts().bf16_matmul else name


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )


def make_optimizers(names: list[str], shapes: list[tuple[int, int]], seed: int = 0,
                    device: torch.device | str = "cpu") -> dict[str, torch.optim.Optimizer]:
    """The bench's optimizers by name, each on its own parameters (so no step feeds another's) of these
    shapes, all with the same fixed gradients."""
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]
    opts = {}
    for name in names:
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g
        opts[name] = OPTIMIZERS[name](params)
    return opts


def bench_optimizers(
    blocks: int = 1, repeats: int = 5, warmup: int = 1, names: list[str] | None = None, seed: int = 0,
    device: str = "cpu", clock: str = "wall",
) -> list[dict]:
    names = names or list(OPTIMIZERS)
    unknown = set(names) - set(OPTIMIZERS)
    if unknown:
        raise ValueError(f"unknown optimizer(s) {sorted(unknown)}; known: {', '.join(OPTIMIZERS)}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    dev = torch.device(device)
    if clock == "cpu" and dev.type != "cpu":
        raise ValueError(f"clock='cpu' times the host's CPU, not {device!r}'s kernels: use the wall clock there")
    if dev.type != "cpu" and not getattr(torch, dev.type).is_available():
        raise ValueError(f"device {device!r} is not available here")
    now = CLOCKS[clock]
    sync = getattr(torch, dev.type).synchronize if dev.type != "cpu" else (lambda: None)
    shapes = GPT2_SMALL_BLOCK * blocks
    opts = make_optimizers(names, shapes, seed, dev)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        for name, opt in opts.items():  # take turns, so noise is shared
            sync()
            start = now()
            opt.step()
            sync()  # a GPU step is done when its kernels are
            elapsed = now() - start
            if r >= warmup:
                times[name].append(elapsed * 1e3)
    n_params = sum(torch.Size(s).numel() for s in shapes)
    cpu = cpu_kind()
    return [
        {
            "name": name,
            "ms": statistics.median(times[name]),
            "ms_min": min(times[name]),
            "ms_rounds": times[name],
            "state_bytes": state_bytes(opts[name]),
            "kernel": kernel_path(opts[name]),
            "params": n_params,
            "blocks": blocks,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "device": str(dev),
            "clock": clock,
            "cpu": cpu,
            **({"ns_dtype": dtype} if (dtype := ns_dtype(opts[name], dev)) else {}),
        }
        for name in names
    ]


# The record each one is judged against beside fused AdamW: the kernel's targets, for the nocheck
# records the same step with the non-finite check (their ratio is the check's cost), for the Nesterov
# record the plain one (their ratio is Nesterov's cost), and for the plain path (kernel="torch") the fused kernel.
PEERS = {"moga-muon": "torch-muon", "moga-row-spectral-nesterov": "torch-muon",
         "moga-spectral-row-nesterov": "torch-muon", "moga-spectral-row-beta2-nesterov": "torch-muon",
         "moga-row-p1.5": "moga-row-p2", "moga-row-p2.5": "moga-row-p2",
         "moga-row-p2-nocheck": "moga-row-p2", "moga-row-p2-flag": "moga-row-p2-nocheck",
         "moga-row-p2-nesterov-flag": "moga-row-p2-flag", "moga-col-q2-nocheck": "moga-col-q2", "moga-adamw-scaled-flag": "moga-adamw-scaled", "moga-sign-nocheck": "moga-sign",
         "moga-row-p2-torch": "moga-row-p2"}


# torch's Muon runs Newton-Schulz in bfloat16, which a CPU without bf16 units emulates (minutes a step).
EMULATED_ON_CPU = {"torch-muon"}
# The row-family hybrids: whole-matrix steps like Muon's (seconds each on a CPU), research records with no
# torch peer; `--all` times them.
HYBRIDS = ("moga-row-spectral-nesterov", "moga-spectral-row-nesterov", "moga-spectral-row-beta2-nesterov")


def default_names(device: str = "cpu", full: bool = False) -> tuple[list[str], str | None]:
    """The records a run times: without ``full``, every optimizer less the row-family hybrids and, on a CPU
    without bf16 units, those that emulate bfloat16; and the line that says what was left out (None when
    nothing). With ``full``, all of them, and a line when one of them emulates bfloat16 here."""
    from moga.hardware import facts

    emulated = [n for n in OPTIMIZERS if n in EMULATED_ON_CPU
                if torch.device(device).type == "cpu" and not facts().bf16_matmul]
    why = "torch's Muon emulates bfloat16 on this CPU (no bf16 units), so its step takes minutes"
    if full:
        return list(OPTIMIZERS), (f"{', '.join(emulated)}: {why}" if emulated else None)
    skipped = [*HYBRIDS, *emulated]  # moga-muon's peer is then torch-muon-float32
    note = (f"skipped {', '.join(skipped)} (--all times them; {why})" if emulated
            else f"skipped {', '.join(skipped)} (--all times them)")
    return [n for n in OPTIMIZERS if n not in skipped], note


def _timing_ratio(record: dict, base: dict) -> tuple[float, list[float] | None]:
    """Median over rounds of the ratio within a round (side by side), and its quartiles over the rounds
    (None with fewer than 2 rounds); the medians' ratio without rounds."""
    within = [t / b for t, b in zip(record.get("ms_rounds", []), base.get("ms_rounds", []))]
    if not within:
        return record["ms"] / base["ms"], None
    quartiles = statistics.quantiles(within, n=4) if len(within) > 1 else None
    return statistics.median(within), None if quartiles is None else [quartiles[0], quartiles[2]]


def _peer(record: dict, records: list[dict], by_name: dict) -> dict | None:
    """The record's peer (PEERS); for moga's Muon, torch's Muon with the same Newton-Schulz dtype where one ran."""
    if "ns_dtype" in record and record["name"].startswith("moga-"):
        same = [r for r in records if r["name"].startswith("torch-muon") and r.get("ns_dtype") == record["ns_dtype"]]
        if same:
            return same[0]
    return by_name.get(PEERS.get(record["name"], ""))


def add_ratios(records: list[dict], baseline: str = "torch-adamw-fused") -> list[dict]:
    by_name = {r["name"]: r for r in records}
    base = by_name.get(baseline)
    for r in records:
        if base is not None:
            r["ms_vs_adamw_fused"], r["ms_vs_adamw_fused_iqr"] = _timing_ratio(r, base)
            r["state_vs_adamw"] = r["state_bytes"] / max(base["state_bytes"], 1)
        peer = _peer(r, records, by_name)
        if peer is not None:
            r["peer"] = peer["name"]
            r["ms_vs_peer"], r["ms_vs_peer_iqr"] = _timing_ratio(r, peer)
    return records
