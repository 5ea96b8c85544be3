"""Atomic checkpoints that know which config made them.

A checkpoint is one ``torch.save`` file (load it with ``torch.load(path, weights_only=True)``)
holding the model, optimizer, step, RNG states, data position and the run's config with its hash.
It is written to a temporary file in the same directory and moved over the old one with
``os.replace``, so a crash mid-save (or a full disk) leaves the previous checkpoint intact.
It also holds the SHA-256 of its own contents (``sha256``: every tensor's bytes, dtype and shape, and
every other value), checked on load, so a flipped bit is reported instead of trained on.
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import numpy as np
import torch

from moga.files import out_of_space, replacing

from .hashing import hash_diff

FORMAT = "moga.train.checkpoint"
VERSION = 1
REQUIRED = ("format", "version", "config", "config_hash", "step", "model", "optimizer")
CHECKSUM = "sha256"
DATA_FINGERPRINT = "data_fingerprint"  # {"bytes": n, "sha256": hex} of what the run trains on (Task.fingerprint)
# Set to 1 to resume on purpose where moga refuses by default (moga train --allow-data-change / --allow-unchecked).
ALLOW_DATA_CHANGE, ALLOW_UNCHECKED = "MOGA_ALLOW_DATA_CHANGE", "MOGA_ALLOW_UNCHECKED"


def allowed(variable: str) -> bool:
    return os.environ.get(variable, "") not in ("", "0")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed: corrupted, from another program or version, or another config."""


def restart_hint(path: Path) -> str:
    remove = f"rm -r {path}" if path.is_dir() else f"rm {path}"
    return (f"Delete it to start the run over ({remove}), or put back an earlier copy of it if you kept one; "
            "then run the same command again.")


def refuse_directory(path: Path, kind: str = "checkpoint") -> None:
    """A directory where a file of the run belongs (left by hand, or by another tool) is found before training,
    not at the first write after it (which would say only "Is a directory", or "free some space")."""
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a {kind} file: move it away (mv {path} "
                              f"{path}.aside) and run the same command again")


def check_data(state: dict, now: dict, path: Path) -> None:
    """Refuse to resume on other data than the checkpoint trained on (checkpoints before fingerprints pass)."""
    was = state.get(DATA_FINGERPRINT)
    if was is None or was == now or allowed(ALLOW_DATA_CHANGE):
        return
    raise CheckpointError(f"{path} was trained on other data ({was['bytes']} bytes, SHA-256 {was['sha256'][:12]}; "
                          f"now {now['bytes']} bytes, {now['sha256'][:12]}): put the data back, use a new run "
                          f"directory, or set {ALLOW_DATA_CHANGE}=1 (moga train --allow-data-change) to continue on "
                          "the new data on purpose")


def _digest(obj, h) -> None:
    """Feed a checkpoint's contents to ``h`` in a canonical form: tensors by dtype, shape and bytes."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            _digest(k, h)
            _digest(v, h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for v in obj:
            _digest(v, h)
    else:  # numbers, strings, None, bools: their repr is exact (floats round-trip)
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def checksum(payload: dict) -> str:
    h = hashlib.sha256()
    _digest({k: v for k, v in payload.items() if k != CHECKSUM}, h)
    return h.hexdigest()


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write atomically; on failure (a full disk) the previous checkpoint is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_directory(path)
    payload = {"format": FORMAT, "version": VERSION, **state}
    payload[CHECKSUM] = checksum(payload)
    try:
        with replacing(path, "wb", fsync=True) as f:  # the one writer (moga.files): the previous file stays
            torch.save(payload, f)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError from its zip writer
        kept = "the previous checkpoint is intact" if path.is_file() else "there is no earlier checkpoint"
        cause = out_of_space(e) or e  # torch's "unexpected pos" hides the write's own error in its context
        why = getattr(cause, "strerror", None) or (str(e).strip().splitlines() or ["no message"])[-1][:200]
        raise CheckpointError(f"could not write the checkpoint {path} ({why}); {kept}. "
                              "Free some space and run the same command again to continue.") from None
    return path


def load_checkpoint(path: str | Path, config: dict | None = None, config_hash: str | None = None) -> dict:
    """Load and check a checkpoint; with ``config_hash`` it must come from that config."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == 0:
        raise CheckpointError(f"{path} is corrupted: it is empty (0 bytes). {restart_hint(path)}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # a truncated zip, garbage bytes, a pickle of something else
        first = (str(e).strip().splitlines() or ["no message"])[0][:200]
        raise CheckpointError(f"{path} is corrupted or not a checkpoint ({type(e).__name__}: {first}). "
                              f"{restart_hint(path)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a moga training checkpoint (no {FORMAT!r} format tag)")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {state.get('version')}; "
                              f"this moga reads version {VERSION}")
    if CHECKSUM not in state and not allowed(ALLOW_UNCHECKED):
        raise CheckpointError(unchecked(path, "SHA-256 of its contents"))
    if CHECKSUM in state and state[CHECKSUM] != checksum(state):
        raise CheckpointError(f"{path} is corrupted: its contents do not match the SHA-256 stored with them "
                              f"(a changed bit on disk or in transfer). {restart_hint(path)}")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{path} is incomplete: missing {', '.join(missing)}")
    if config_hash is not None and state["config_hash"] != config_hash:
        diff = hash_diff(state["config"], config, state["config_hash"]) if config is not None else []
        detail = ("\n  " + "\n  ".join(diff)) if diff else ""
        raise CheckpointError(
            f"{path} was written by a different config (hash {state['config_hash']}, this config "
            f"{config_hash}); differing keys (checkpoint -> now):{detail}\n"
            "Use a new run directory, or resume with the checkpoint's config.")
    return state


def unchecked(path: Path, what: str) -> str:
    return (f"{path} has no {what} (written before moga checked checkpoints), so damage cannot be told from "
            f"data: delete it to start the run over, or, if you trust it, set {ALLOW_UNCHECKED}=1 "
            "(moga train --allow-unchecked) to resume it unchecked")


# --- RNG state, in types that torch.load(weights_only=True) accepts ----------------------------------

def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
