"""The one way moga writes a file in a run or sweep directory: never through a symlink.

Run and sweep directories are shared, copied and unpacked from archives, so a file in one may be a symlink
planted to point elsewhere; writing through it would overwrite (or empty) the file it points to. Whole files
(:func:`write_text`, :func:`write_json`, :func:`replacing`) are written to a new temporary file beside the
target (``O_EXCL``: never an existing file) and renamed over it: a rename replaces a symlink, it does not
follow it, and a kill mid-write leaves the previous file. Files that grow in place (:func:`open_append`,
metrics) and lock files (:func:`open_lock`) are opened with ``O_NOFOLLOW``: a symlink there is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

_UMASK = os.umask(0o022)  # read once (os.umask can only be read by setting it): new files get 0o666 & ~umask
os.umask(_UMASK)


class UnsafeFile(OSError):
    """A file moga writes is a symlink (or not a regular file): refused, nothing written through it."""

    def __init__(self, path: Path, what: str = "a symlink"):
        super().__init__(errno.ELOOP, f"{path} is {what}; moga never writes through one. Remove it (rm {path}) "
                         "and run the same command again", str(path))

    def __str__(self) -> str:
        return self.strerror


@contextlib.contextmanager
def replacing(path: str | Path, mode: str = "w", *, encoding: str | None = "utf-8", newline: str | None = None,
              fsync: bool = False):
    """A new file that becomes ``path`` (replacing a file or a symlink, never writing through it) when the
    block ends without an error; on an error the previous ``path`` is left as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0o600 would hide a shared run's files from its readers
        binary = "b" in mode
        with os.fdopen(fd, mode, encoding=None if binary else encoding, newline=None if binary else newline) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except IsADirectoryError:  # name the file that is a directory, not the temporary one
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path)) from None
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:  # a write on a full disk
            e.filename = str(path)  # names no file: name the target
        raise


def write_text(path: str | Path, text: str, *, encoding: str = "utf-8") -> Path:
    with replacing(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    with replacing(path, "wb") as f:
        f.write(data)
    return Path(path)


def write_json(path: str | Path, data, *, indent: int | None = 1, **dumps) -> Path:
    """``data`` as JSON at ``path``, all or nothing: a kill mid-write leaves the previous file."""
    return write_text(path, json.dumps(data, indent=indent, **dumps) + "\n")


def shown_path(path: str | Path, base: str | Path) -> str:
    """``path`` as a stored summary names it: relative to the working directory where it lies under it, else
    to ``base`` (a run's directory), so that a summary kept in a repository names no directory of the machine
    that made it; as given where it lies under neither."""
    resolved = Path(path).resolve()
    for root in (Path.cwd().resolve(), Path(base).resolve()):
        if resolved.is_relative_to(root):
            return str(resolved.relative_to(root))
    return str(path)


def copy_file(source: str | Path, target: str | Path) -> Path:
    """``source``'s bytes at ``target`` (replacing it; a symlink at ``target`` is replaced, not followed)."""
    with open(source, "rb") as src, replacing(target, "wb") as out:
        while block := src.read(1 << 20):
            out.write(block)
    return Path(target)


def _open_nofollow(path: Path, flags: int) -> int:
    try:  # O_NONBLOCK: a FIFO planted there must not block the open (it has no effect on a regular file)
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():
            raise UnsafeFile(path) from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader
            raise UnsafeFile(path, "not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or write elsewhere
        os.close(fd)
        raise UnsafeFile(path, "not a regular file")
    if st.st_nlink > 1:  # a hard link planted there would carry the writes to its other name, outside the run
        os.close(fd)
        raise UnsafeFile(path, "a hard link to another file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def open_append(path: str | Path, *, encoding: str = "utf-8") -> IO[str]:
    """``path`` opened to append text (created when missing); a symlink there is refused."""
    fd = _open_nofollow(Path(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    return os.fdopen(fd, "a", encoding=encoding)


def open_lock(path: str | Path) -> IO[str]:
    """A lock file, read-write, created when missing and never truncated; a symlink there is refused."""
    fd = _open_nofollow(Path(path), os.O_RDWR | os.O_CREAT)
    return os.fdopen(fd, "r+")


def read_only(directory: str | Path) -> bool:
    """Whether ``directory`` is to be read and not written: on a read-only mount, not writable by this process,
    or writable by no one (mode bits without a w: for root too, who may write it anyway)."""
    directory = Path(directory)
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return True
        return not os.access(directory, os.W_OK) or not directory.stat().st_mode & 0o222
    except OSError:
        return False


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit


def out_of_space(error: BaseException) -> OSError | None:
    """The write that failed for want of space behind ``error`` (its cause or context), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in NO_SPACE:
            return error
        error = error.__cause__ or error.__context__
    return None


def refuse_symlinks(*paths: Path) -> None:
    """For files another library opens (SQLite and its -wal, -shm, -journal): refuse while one is a symlink."""
    for path in paths:
        if path.is_symlink():
            raise UnsafeFile(path)


def fsync_file(handle: IO) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def save_figure(fig, path: str | Path, **savefig) -> Path:
    """A matplotlib figure at ``path`` (its format from the suffix), written like :func:`write_text`."""
    path = Path(path)
    with replacing(path, "wb") as f:
        fig.savefig(f, format=path.suffix.lstrip(".") or None, **savefig)
    return path
