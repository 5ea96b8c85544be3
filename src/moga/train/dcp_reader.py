"""Reading a sharded (DCP) checkpoint without running code from it.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and its load planners read
every non-tensor value with ``torch.load(weights_only=False)``, so a hostile checkpoint directory runs
whatever it likes on load. Here ``.metadata`` goes through an unpickler that only builds DCP's own
metadata classes (and ``torch.Size``, dtypes, layouts and paths), and values go through
``torch.load(weights_only=True)``, the loader ``checkpoint.pt`` already uses.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .checkpoint import CheckpointError, restart_hint

METADATA = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                         "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),  # a layout by its name, from a fixed table
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}


class _Forbidden(pickle.UnpicklingError):
    """A global outside the allowed list (a damaged pickle raises UnpicklingError itself)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Forbidden(f"asks to build {module}.{name}")


def _refused(directory: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{directory} is corrupted or unsafe: {what}, which a checkpoint written by moga never holds (damaged, "
        f"written by another program, or made to run code when loaded; nothing in it was run). "
        f"{restart_hint(directory)}")


def read_metadata(directory: str | Path) -> Metadata:
    """``directory/.metadata``, checked: only DCP metadata classes, and shard files inside ``directory``."""
    directory = Path(directory)
    path = directory / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is corrupted: its {METADATA} file is missing. "
                              f"{restart_hint(directory)}") from None
    except _Forbidden as e:
        raise _refused(directory, f"its {METADATA} {e}") from None
    except Exception as e:  # truncated or garbage bytes
        raise CheckpointError(f"{directory} is corrupted: its {METADATA} cannot be read ({type(e).__name__}: "
                              f"{str(e)[:200]}). {restart_hint(directory)}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise _refused(directory, f"its {METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    for info in metadata.storage_data.values():  # every read stays inside the checkpoint directory
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name:
            raise _refused(directory, f"its {METADATA} points at the file {name!r} outside the checkpoint")
    return metadata


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata comes from :func:`read_metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: moga never writes them
            raise FileNotFoundError("no per-rank metadata")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """``load_bytes`` with ``torch.load(weights_only=True)``: plain values (floats, strings, tuples) load."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            raise _refused(Path(self._directory), f"its value {fqn} cannot be read safely "
                           f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    def __init__(self, directory: str | Path, **kwargs):
        super().__init__(**kwargs)
        self._directory = directory


class SafeEmptyLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (for consolidating in one process)."""

    def __init__(self, directory: str | Path, **kwargs):
        super().__init__(**kwargs)
        self._directory = directory


def first_failure(error: BaseException) -> BaseException:
    """The exception inside DCP's ``CheckpointException`` (a ``BaseException``: ``except Exception`` misses it)."""
    failures = getattr(error, "failures", None) or {}
    for exc, _trace in failures.values():
        return exc
    return error
