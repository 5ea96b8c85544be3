"""Who holds a sweep cell's claim: ``host:pid:nonce``, so a claim whose owner was a process on this host
that no longer exists (killed with SIGKILL) is retaken at once (``moga.sweep.store``); another host's
owner is judged by its heartbeat alone."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path


def new_owner() -> str:
    """host:pid:nonce, so a dead process's claims can be recognised on the same host."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_is_dead(owner: str | None) -> bool:
    if not owner:
        return True
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine: only the heartbeat can tell
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(int(pid))


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False
