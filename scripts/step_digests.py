"""A digest of every optimizer's weights and state after a few steps, over a broad grid of configurations.

Run it on two commits and compare the files: equal digests mean the step is bit for bit the same. A refactor
of the step (issue 38) is checked this way::

    PYTHONPATH=src python scripts/step_digests.py --out before.json      # on the old commit
    PYTHONPATH=src python scripts/step_digests.py --out after.json --compare before.json

The grid: MOGA (both presets), Muon, ScaledAdamW, AdaptiveGD, and GeometryOptimizer with each geometry, x
float32 / bfloat16 (with and without master weights) x plain / Nesterov / no momentum x weight decay x kernel
torch / auto x nonfinite skip / raise / ignore, with a NaN gradient on one step (or the caller's
``found_inf`` flag set on it), on a model with same-shape
matrices (one batched Newton-Schulz call) and a non-contiguous parameter. Only public APIs are used, so the
script runs unchanged on any commit since they settled. Digests depend on the machine (CPU, torch, compiler).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import warnings

import torch
from torch import nn

from moga.optim import MOGA, GeometryOptimizer, Muon, ScaledAdamW
from moga.optim.adaptive import AdaptiveGD

STEPS = 3
NAN_STEP = 1  # the step whose gradient holds a NaN, in the configurations with one

GEOMETRIES = ("row(p=2)", "row(p=1.5)", "row(p=1)", "row(p=inf)", "col(q=2)", "col(q=inf)", "sign",
              "spectral", "spectral(scale=torch)", "embedding(q=2)", "vector", "row_spectral", "spectral_row",
              "spectral_row(beta2=0.95)")


class Net(nn.Module):
    """Every role: an embedding, same-shape hidden matrices, a readout, biases and a norm gain."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.wide = nn.Linear(8, 12, bias=False)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        h = self.embed(x).mean(1)
        for layer in self.hidden:
            h = h + layer(h).relu()
        return self.head(self.norm(self.wide(h)))


def model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return Net().to(dtype)


def set_grads(params, step: int, nan: bool) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for k, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        if nan is True and step == NAN_STEP and k == 1:
            g.view(-1)[0] = float("nan")
        p.grad = g


def digest(params, opt) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().contiguous().numpy().tobytes())
        h.update(str(p.dtype).encode())
    state = opt.state_dict()
    h.update(repr(state.get("skipped_steps")).encode())
    for i in sorted(state["state"]):
        for key in sorted(state["state"][i]):
            v = state["state"][i][key]
            h.update(f"{i}.{key}.{getattr(v, 'dtype', type(v))}".encode())
            h.update(v.detach().float().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    for g in state["param_groups"]:
        h.update(repr(sorted((k, repr(v)) for k, v in g.items())).encode())
    return h.hexdigest()[:20]


def build(name: str, net: nn.Module, dtype, master, momentum, nesterov, wd, kernel, nonfinite):
    common = dict(weight_decay=wd, kernel=kernel, nonfinite=nonfinite, master_weights=master)
    if name.startswith("moga"):
        return MOGA(net, lr=0.05, momentum=momentum or 0.0, nesterov=nesterov, preset=name.split("-")[1],
                    **common)
    if name == "muon":
        return Muon(net, lr=0.02, momentum=momentum or 0.0, nesterov=nesterov, **common)
    if name == "adamw-scaled":
        return ScaledAdamW(net, lr=0.01, **common)
    if name == "adaptive-gd":
        return AdaptiveGD(net.parameters(), alpha=0.5, layers=3, nonfinite=nonfinite)
    geometry = name.removeprefix("geometry:")
    matrices = [p for p in net.parameters() if p.ndim == 2]
    params = list(net.parameters()) if geometry == "vector" else matrices
    if geometry.startswith("embedding"):
        params = [net.embed.weight]
    return GeometryOptimizer(params, lr=0.03, momentum=momentum or 0.0, nesterov=nesterov, geometry=geometry,
                             **common)


def run(config: dict) -> str:
    dtype = getattr(torch, config["dtype"])
    net = model(dtype)
    if config["transposed"]:  # a parameter whose storage is not contiguous: the plain path takes it
        net.wide.weight = nn.Parameter(net.wide.weight.detach().t().contiguous().t())
    params = list(net.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = build(config["optimizer"], net, dtype, config["master"], config["momentum"], config["nesterov"],
                    config["wd"], config["kernel"], config["nonfinite"])
        for step in range(STEPS):
            set_grads(params, step, config["nan"])
            try:
                if config["optimizer"] == "adaptive-gd":
                    opt.step(loss=torch.tensor(1.0 + step))
                elif config["nan"] == "flag":  # the caller's verdict (clipping's, GradScaler's)
                    opt.step(found_inf=torch.tensor(float(step == NAN_STEP)))
                else:
                    opt.step()
            except FloatingPointError:
                pass
    return digest(params, opt)


def grid() -> list[dict]:
    out = []
    optimizers = ["moga-default", "moga-paper", "muon", "adamw-scaled", "adaptive-gd",
                  *(f"geometry:{g}" for g in GEOMETRIES)]
    for opt, (dtype, master), kernel in itertools.product(
            optimizers, (("float32", False), ("bfloat16", False), ("bfloat16", True)), ("torch", "auto")):
        adam_like = opt in ("adamw-scaled", "adaptive-gd")
        moments = [(None, False)] if adam_like else [(0.9, False), (0.9, True), (None, False)]
        for (momentum, nesterov), wd in itertools.product(moments, (0.0, 0.1)):
            for nonfinite, nan in (("skip", False), ("skip", True), ("raise", True), ("ignore", True),
                                   ("skip", "flag")):
                if opt == "adaptive-gd" and ((kernel, master, wd) != ("torch", False, 0.0) or nan == "flag"):
                    continue  # it has no kernel, master copies or decay
                out.append(dict(optimizer=opt, dtype=dtype, master=master, kernel=kernel, momentum=momentum,
                                nesterov=nesterov, wd=wd, nonfinite=nonfinite, nan=nan,
                                transposed=nonfinite == "ignore"))
    return out


def key(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file of {configuration: digest}")
    parser.add_argument("--compare", help="a file written before: report every configuration that differs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    digests = {}
    for config in grid():
        try:
            digests[key(config)] = run(config)
        except Exception as e:  # an error is a result too: it must be the same error on both commits
            digests[key(config)] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    with open(args.out, "w") as f:
        json.dump(digests, f, indent=0, sort_keys=True)
    errors = sum(v.startswith("error") for v in digests.values())
    print(f"{len(digests)} configurations ({errors} raised), {len(set(digests.values()))} distinct digests")
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        differ = [k for k in sorted(set(before) | set(digests)) if before.get(k) != digests.get(k)]
        for k in differ[:20]:
            print(f"DIFFERS {k}: {before.get(k)} -> {digests.get(k)}")
        print(f"{len(digests) - len(differ)} of {len(digests)} equal, {len(differ)} differ")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
