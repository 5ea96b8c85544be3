"""An exclusive lock on a file shared by processes (``flock``): held until the block ends, and dropped by
the OS when its holder dies, so a killed process never blocks the next one."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive_lock(path: Path):
    """Block until this process holds ``path`` (created, with its directory, when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
