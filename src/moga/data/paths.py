"""Where data lives. A dataset is found, in order, at:

1. the path the user gives (a config's ``data.root`` / ``data.text_path``, a function argument);
2. the dataset's own environment variable (``$MOGA_FASHION_MNIST``, ``$MOGA_CIFAR10``, ``$MOGA_CIFAR100``,
   ``$MOGA_TEXT``);
3. ``$MOGA_DATA``, a directory of datasets under their usual names (``fashion-mnist/``,
   ``cifar-10-batches-py/``, ``cifar10-jpeg.tar.gz``, ``cifar-100-python/``, ``tinyshakespeare.txt``);
4. the user data cache, ``$MOGA_CACHE/data`` (default ``~/.cache/moga/data``), where ``moga data fetch`` puts
   what it downloads;
5. the system locations (Debian's ``/usr/share/datasets/...``).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Directory for decoded-data caches: $MOGA_CACHE, else ~/.cache/moga."""
    return Path(os.environ.get("MOGA_CACHE") or Path.home() / ".cache" / "moga").expanduser()


def user_data_dir() -> Path:
    """Where ``moga data fetch`` stores datasets: the ``data`` folder of the cache directory."""
    return cache_dir() / "data"


def data_dirs() -> list[Path]:
    """The directories of datasets searched by name: $MOGA_DATA (when set), then the user data folder."""
    dirs = [Path(os.environ["MOGA_DATA"]).expanduser()] if os.environ.get("MOGA_DATA") else []
    return dirs + [user_data_dir()]


def dataset_candidates(*names: str) -> list[Path]:
    """Every place a dataset stored under one of ``names`` may be, in search order."""
    return [d / name for d in data_dirs() for name in names]


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
