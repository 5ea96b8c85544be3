"""Where data lives: user-given paths first, then environment variables, then known defaults."""

from __future__ import annotations

import os
from pathlib import Path

# This project's development machines keep real datasets here; it is only ever a fallback.
DEV_DATA_DIR = Path("/work/shared/data")


def cache_dir() -> Path:
    """Directory for decoded-data caches: $MOGA_CACHE, else ~/.cache/moga."""
    return Path(os.environ.get("MOGA_CACHE") or Path.home() / ".cache" / "moga").expanduser()


def resolve_path(explicit: str | os.PathLike | None, env_var: str, defaults: list[Path]) -> Path | None:
    """The explicit path if given (it must exist), else $env_var, else the first default that exists."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        return path
    if os.environ.get(env_var):
        path = Path(os.environ[env_var]).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"${env_var} points to {path}, which does not exist")
        return path
    return next((p for p in defaults if p.exists()), None)
