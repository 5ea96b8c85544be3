"""Sharded checkpoints for ``train.parallel=fsdp``: ``torch.distributed.checkpoint`` (DCP), written atomically.

A sharded checkpoint is a directory, ``checkpoint.dcp/``: every rank writes its shards of the model and
optimizer state (``torch.distributed.checkpoint.state_dict.get_state_dict``) and rank 0 adds
``engine.pt``, an ordinary checkpoint file (:mod:`moga.train.checkpoint`) with everything else: step,
config and its hash, every rank's RNG state, the data position, the loss window. DCP stores each tensor
with its global shape and offsets, so a checkpoint saved on N processes loads on M: DCP reads each new
shard from whichever files hold it.

Atomic: the ranks write ``.checkpoint.dcp.tmp/``; once all are done rank 0 moves the old directory
aside, renames the new one in and deletes the old. A kill while writing leaves the previous checkpoint
as it was; a kill between the two renames leaves the previous one under ``.checkpoint.dcp.old``, which
:func:`find_sharded` reads. A kill -9 mid-save leaves ``.checkpoint.dcp.tmp``: :func:`discard_unfinished`.
A symlink at any of the three names is refused (:func:`refuse_links`): the shards would be written, or the
previous checkpoint moved, out of the run directory.

Checked: ``engine.pt`` (whose own SHA-256 is checked on load) holds the SHA-256 and size of every other
file in the directory (``.metadata`` and the ``.distcp`` shards), verified before anything is read, so a
flipped bit, a truncated, emptied, deleted or swapped shard is reported instead of trained on.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from moga.files import refuse_symlinks

from .checkpoint import (
    ALLOW_UNCHECKED, CheckpointError, allowed, load_checkpoint, restart_hint, save_checkpoint, unchecked
)
from .dcp_reader import SafeEmptyLoadPlanner, SafeLoadPlanner, SafeReader, first_failure, read_metadata

DIRECTORY, ENGINE = "checkpoint.dcp", "engine.pt"
IN_DCP = "torch.distributed.checkpoint"  # what engine.pt holds for the model and optimizer: look there
FILES = "files"  # engine.pt's {file name: {"sha256": hex, "bytes": size}} of the rest of the directory


def _aside(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}.{what}")


def find_sharded(path: str | Path) -> Path | None:
    """The complete sharded checkpoint at ``path`` (or the previous one, after a kill mid-rename)."""
    path = Path(path)
    for candidate in (path, _aside(path, "old")):
        if (candidate / ENGINE).is_file():
            return candidate
    return None


def refuse_links(path: str | Path) -> None:
    """Every rank calls this (so none waits at a barrier for one that refused): a symlink at the checkpoint
    directory, its temporary or its previous name is refused in one line, before anything is written."""
    path = Path(path)
    refuse_symlinks(path, _aside(path, "tmp"), _aside(path, "old"))


def discard_unfinished(path: str | Path) -> None:
    """Remove the temporary directory of a save that was killed (the one writer of the run calls this)."""
    shutil.rmtree(_aside(Path(path), "tmp"), ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(directory: Path) -> dict:
    """SHA-256 and size of every file in ``directory`` but ``engine.pt``."""
    return {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
            for p in sorted(directory.iterdir()) if p.name != ENGINE and p.is_file()}


def verify_files(directory: Path, recorded: dict) -> None:
    """Every file ``engine.pt`` lists is there, whole and unchanged."""
    for name, want in recorded.items():
        path = directory / name
        if not path.is_file():
            problem = f"its file {name} is missing"
        elif path.stat().st_size != want["bytes"]:
            problem = f"its file {name} has {path.stat().st_size} bytes, but was written with {want['bytes']}"
        elif _sha256(path) != want["sha256"]:
            problem = f"its file {name} does not match the SHA-256 stored in {ENGINE} (a changed bit on disk or in " \
                      "transfer, or a file from another checkpoint)"
        else:
            continue
        raise CheckpointError(f"{directory} is corrupted: {problem}. {restart_hint(directory)}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, engine: dict,
                 *, main: bool, barrier) -> Path:
    """Every rank calls this; ``engine`` (rank 0's) is the rest of the run's state."""
    path = Path(path)
    tmp, old = _aside(path, "tmp"), _aside(path, "old")
    refuse_links(path)  # planted while the run trained: the run's start checked them too
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
        tmp.mkdir(parents=True)
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    barrier()  # every rank's shards are on disk
    if main:
        save_checkpoint(tmp / ENGINE, {**engine, "model": IN_DCP, "optimizer": IN_DCP, FILES: file_digests(tmp)})
        _fsync_dir(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return path


def load_engine_state(path: str | Path, config: dict | None = None, config_hash: str | None = None) -> dict:
    """``engine.pt`` of a sharded checkpoint, checked like a one-file checkpoint."""
    found = find_sharded(path)
    if found is None:
        if Path(path).is_dir():  # save_sharded writes engine.pt before the directory gets its name
            raise CheckpointError(f"{path} is corrupted: its {ENGINE} is missing. {restart_hint(Path(path))}")
        raise CheckpointError(f"{path} holds no complete sharded checkpoint (no {ENGINE})")
    state = load_checkpoint(found / ENGINE, config, config_hash)
    if state.get("model") != IN_DCP:
        raise CheckpointError(f"{found / ENGINE} is not the engine state of a sharded checkpoint")
    if FILES in state:
        verify_files(found, state[FILES])
    elif not allowed(ALLOW_UNCHECKED):  # from before the file digests: every shard would go unchecked
        raise CheckpointError(unchecked(found / ENGINE, "SHA-256 digests of its shard files"))
    state["directory"] = str(found)
    return state


def _read_into(found: Path, state: dict, planner, no_dist: bool = False) -> None:
    """``dcp.load`` through moga's safe reader and planner; every failure becomes one CheckpointError."""
    try:
        if no_dist:  # into an empty dict, filled from the metadata (dcp.load would fill a copy)
            _load_state_dict(state, storage_reader=SafeReader(found), planner=planner, no_dist=True)
        else:
            dcp.load(state, storage_reader=SafeReader(found), planner=planner)
    except (Exception, CheckpointException) as e:  # a missing or truncated shard file, another model's keys
        cause = first_failure(e)
        if isinstance(cause, CheckpointError):
            raise cause from None
        first = (str(cause).strip().splitlines() or ["no message"])[0][:300]
        raise CheckpointError(f"{found} is corrupted or does not fit this model and optimizer "
                              f"({type(cause).__name__}: {first}). {restart_hint(found)}") from None


def load_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank calls this: load the model and optimizer shards into the sharded model (any process count)."""
    found = find_sharded(path)
    if found is None:
        raise CheckpointError(f"{path} holds no complete sharded checkpoint")
    read_metadata(found)  # refused here, before DCP reads it (and logs its tracebacks)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    _read_into(found, state, SafeLoadPlanner(found))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def consolidate(path: str | Path) -> dict:
    """The full (unsharded) ``{"model": ..., "optimizer": ...}`` of a sharded checkpoint, in one process.

    For inspection and export: ``consolidate("runs/x/checkpoint.dcp")["model"]`` is a plain state dict.
    """
    found = Path(load_engine_state(path)["directory"])
    read_metadata(found)
    state: dict = {}
    _read_into(found, state, SafeEmptyLoadPlanner(found), no_dist=True)
    return state
