"""Where data lives: a path the user gives, else an environment variable, else known defaults."""

from __future__ import annotations

import os
from pathlib import Path

# This project's development machines keep real datasets here; it is only ever a fallback.
DEV_DATA_DIR = Path("/work/shared/data")


def cache_dir() -> Path:
    """Directory for decoded-data caches: $MOGA_CACHE, else ~/.cache/moga."""
    return Path(os.environ.get("MOGA_CACHE") or Path.home() / ".cache" / "moga").expanduser()


def resolve_path(explicit: str | os.PathLike | None, env_var: str, defaults: list[Path], hint: str) -> Path:
    """The explicit path if given, else $env_var, else the first default that exists.

    Raises FileNotFoundError ending with `hint` (how to get the data) when nothing is found.
    """
    if explicit is not None:
        path, origin = Path(explicit).expanduser(), "given path"
    elif os.environ.get(env_var):
        path, origin = Path(os.environ[env_var]).expanduser(), f"${env_var}"
    else:
        found = next((p for p in defaults if p.exists()), None)
        if found is None:
            tried = ", ".join(str(p) for p in defaults) or "none"
            raise FileNotFoundError(f"no path given, ${env_var} unset, and no default exists (tried: {tried}). {hint}")
        return found
    if not path.exists():
        raise FileNotFoundError(f"{path} ({origin}) does not exist. {hint}")
    return path
