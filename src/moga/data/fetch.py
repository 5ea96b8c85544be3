"""``moga data fetch NAME``: download a public dataset into the user data folder, where the loaders find it.

Only for machines with a network; everything else in moga reads local files. A download is checked
against its known size and SHA-256 before it is moved into place, so a broken or partial transfer never
becomes a dataset.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .paths import user_data_dir


@dataclass(frozen=True)
class Remote:
    filename: str
    url: str
    sha256: str
    size: int
    about: str


REMOTES = {
    "shakespeare": Remote(
        "tinyshakespeare.txt",
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        1115394,
        "tiny Shakespeare (40,000 lines of Shakespeare's plays; public domain), nanoGPT's shakespeare_char text",
    ),
}


class FetchError(RuntimeError):
    """A download that failed or did not match its checksum; nothing was written."""


def fetch(name: str, dest: Path | None = None, url: str | None = None, timeout: float = 60.0) -> Path:
    """Download dataset ``name`` to ``dest`` (default: the user data folder) and return its path.

    ``url`` replaces the source (a mirror, or a ``file://`` copy); size and checksum are still checked.
    """
    if name not in REMOTES:
        raise ValueError(f"unknown dataset {name!r}; moga data fetch knows: {', '.join(REMOTES)}")
    remote = REMOTES[name]
    dest = Path(dest) if dest is not None else user_data_dir()
    target = dest / remote.filename
    source = url or remote.url
    try:
        with urllib.request.urlopen(source, timeout=timeout) as response:
            payload = response.read(remote.size + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise FetchError(f"could not download {name} from {source}: {e}. Without a network, download "
                         f"{remote.url} elsewhere and pass the file (data.text_path, $MOGA_TEXT) or put it "
                         f"in $MOGA_DATA as {remote.filename}") from None
    digest = hashlib.sha256(payload).hexdigest()
    if len(payload) != remote.size or digest != remote.sha256:
        raise FetchError(f"{source} sent {len(payload)} bytes with SHA-256 {digest}; expected {remote.size} bytes "
                         f"with {remote.sha256}. Nothing was written")
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{remote.filename}.")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    os.replace(tmp, target)
    return target
