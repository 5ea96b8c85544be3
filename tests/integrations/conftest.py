"""Real text for the trainer tests: tiny Shakespeare from $MOGA_DATA, else the corpus moga finds itself."""

import os
from pathlib import Path

import pytest

CHARS = 12_000  # enough for a few dozen steps of 8 x 32 characters


@pytest.fixture(scope="session")
def corpus() -> str:
    candidates = []
    if os.environ.get("MOGA_DATA"):
        candidates.append(Path(os.environ["MOGA_DATA"]) / "tinyshakespeare.txt")
    try:
        from moga.data.text import resolve_text_corpus

        candidates.append(resolve_text_corpus())  # $MOGA_TEXT, then the corpora moga knows of
    except FileNotFoundError:
        pass
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        pytest.skip("no text corpus: set MOGA_DATA to a directory holding tinyshakespeare.txt, or MOGA_TEXT to a text file")
    return found.read_text(encoding="utf-8")[:CHARS]
