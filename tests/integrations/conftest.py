"""Real text for the trainer tests: the corpus moga finds ($MOGA_TEXT, tiny Shakespeare in $MOGA_DATA, ...)."""

import pytest

CHARS = 12_000  # enough for a few dozen steps of 8 x 32 characters


@pytest.fixture(scope="session")
def corpus() -> str:
    from moga.data.text import resolve_text_corpus

    try:
        found = resolve_text_corpus()
    except FileNotFoundError:
        pytest.skip("no text corpus: set MOGA_DATA to a directory holding tinyshakespeare.txt (scripts/test.sh "
                    "does where ../shared/data exists), or MOGA_TEXT to a text file")
    return found.read_text(encoding="utf-8")[:CHARS]
