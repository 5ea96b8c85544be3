"""Exclusive locks on files shared by processes (``flock``): held until the block ends, and dropped by
the OS when the holder dies, so a killed process never blocks the next one. :func:`exclusive_lock` waits;
:func:`writer_lock` (one writer per run directory) refuses, naming the holder's PID, unless told to wait."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from moga.files import open_lock


@contextmanager
def exclusive_lock(path: Path):
    """Block until this process holds ``path`` (created, with its directory, when missing; a symlink there is
    refused: :class:`moga.files.UnsafeFile`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_lock(path) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class DirectoryBusy(RuntimeError):
    """Another live process writes this directory."""

    def __init__(self, directory: Path, holder: int | None):
        self.directory, self.holder = directory, holder
        who = f"PID {holder}" if holder else "a process that has just started (its PID is not written yet)"
        super().__init__(
            f"{directory} is in use by another moga process ({who}): two writers would interleave its metrics "
            "and checkpoints. Wait for it to finish or stop it, or run the same command with --wait to start "
            "once it is done.")


def lock_holder(path: Path) -> int | None:
    """The PID written into the lock file ``path`` by its holder, if any."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@contextmanager
def writer_lock(path: Path, *, wait: bool = False, on_wait=None):
    """The one writer of ``path.parent``: an exclusive lock on ``path`` that holds this process's PID.

    Without ``wait`` a held lock raises :class:`DirectoryBusy` naming the holder; with it, ``on_wait(pid)``
    is called and this blocks until the holder ends (or dies: the OS drops its lock).
    """
    path = Path(path)
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open_lock(path)  # not truncated: that would erase the holder's PID before we hold the lock
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = lock_holder(path)
                if not wait:
                    raise DirectoryBusy(path.parent, holder) from None
                if on_wait is not None:
                    on_wait(holder)
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:  # the holder may have removed the file (and its directory) while we waited: lock the new one
                current = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                current = False
        except BaseException:
            handle.close()
            raise
        if current:
            break
        handle.close()
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing drops the lock
