import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from moga.data.paths import dataset_candidates

# Inductor's on-disk cache (torch 2.13) is keyed without ATEN_CPU_CAPABILITY: a step compiled under one vector
# ISA and reused under another gave wrong numbers here (momentum off by 0.6 after a default run, then one with
# ATEN_CPU_CAPABILITY=avx2). Each session compiles into its own cache, unless one is named.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moga-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# Texts for tests whose assertions hold for any text: tiny Shakespeare where moga finds it, else this stand-in.
STAND_IN_TEXT = "".join(f"To be, or not to be, line {i}: that is the question.\n" for i in range(600))


def dataset_file(name: str) -> Path | None:
    """A dataset where moga looks for it ($MOGA_DATA, the user data folder), or None."""
    return next((p for p in dataset_candidates(name) if p.exists()), None)


def dataset_or_skip(name: str, what: str) -> Path:
    found = dataset_file(name)
    if found is None:
        pytest.skip(f"{what} not found: set MOGA_DATA to a directory holding {name} "
                    "(scripts/test.sh does where ../shared/data exists)")
    return found


def corpus_text(chars: int = 30_000) -> str:
    """The first ``chars`` characters of tiny Shakespeare, or the stand-in text."""
    found = dataset_file("tinyshakespeare.txt")
    return found.read_text(encoding="utf-8")[:chars] if found else STAND_IN_TEXT


@pytest.fixture
def text_file(tmp_path, monkeypatch) -> Path:
    """30k characters of tiny Shakespeare (or the stand-in), with the token cache in tmp_path."""
    path = tmp_path / "corpus.txt"
    path.write_text(corpus_text(), encoding="utf-8")
    monkeypatch.setenv("MOGA_CACHE", str(tmp_path / "cache"))
    return path


@pytest.fixture
def float64_by_default():
    """Tight tolerances need float64; restored after each test so other tests keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
