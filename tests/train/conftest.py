"""Small, fast configs over real data (scikit-learn digits, a slice of tiny Shakespeare)."""

import copy
from pathlib import Path

import torch


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


TINY = {
    "seed": 0,
    "model": {"name": "residual_mlp", "width": 16, "depth": 2},
    "data": {"name": "digits"},
    "optim": {"name": "moga", "lr": 0.05},
    "train": {"steps": 12, "batch_size": 32},
    "eval": {"every": 5},
    "checkpoint": {"every": 4},
    "logging": {"progress": False, "log_every": 2},
}


def tiny(**sections) -> dict:
    """TINY with sections merged in: tiny(optim={"name": "adamw"})."""
    return merge(TINY, sections)


def gpt_config(text_path: Path, **sections) -> dict:
    """A 2-block char-level GPT with dropout (so resuming must restore the torch RNG)."""
    cfg = merge(TINY, {"data": {"name": "text", "text_path": str(text_path), "block_size": 16},
                       "train": {"batch_size": 8}, "eval": {"max_batches": 2}})
    cfg["model"] = {"name": "gpt", "n_layer": 2, "n_embd": 16, "n_head": 2, "dropout": 0.1}
    return merge(cfg, sections)


def one_line(result, exit_code: int, *needles: str) -> str:
    """A CLI result that is one error line (no traceback) with ``exit_code``, naming each of ``needles``."""
    out = result.output
    assert result.exit_code == exit_code, out
    assert "Traceback" not in out and out.startswith("error: ") and out.count("\n") == 1, out
    for needle in needles:
        assert needle in out, out
    return out


def same_tensors(a, b) -> bool:
    """Bitwise equality of two (nested) state dicts."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b
