"""docs/math.md is the formula reference that docstrings cite by section ("docs/math.md §2.1"): every
cited section must exist, and section numbers must be unique and in order."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MATH = REPO / "docs" / "math.md"
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.M)
CITATION = re.compile(r"math\.md,? §\s?(\d+(?:\.\d+)?)")


def sections() -> list[str]:
    return HEADING.findall(MATH.read_text(encoding="utf-8"))


def test_section_numbers_are_unique_and_in_order():
    numbers = sections()
    assert len(numbers) == len(set(numbers)), f"duplicate sections: {numbers}"
    keys = [tuple(int(x) for x in n.split(".")) for n in numbers]
    assert keys == sorted(keys), f"sections out of order: {numbers}"
    for n in numbers:  # every subsection sits under its own top-level section
        if "." in n:
            assert n.split(".")[0] in numbers, f"§{n} has no parent section"


def test_every_cited_section_exists():
    known = set(sections())
    cited = []
    for path in [*sorted((REPO / "src").rglob("*.py")), REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        cited += [(path.relative_to(REPO), m) for m in CITATION.findall(text)]
    dangling = [f"{path}: §{m}" for path, m in cited if m not in known]
    assert not dangling, f"citations of docs/math.md sections that do not exist: {dangling}"


def test_no_fill_in_placeholder_is_left_in_the_docs():
    """A placeholder such as ``__RESULT_TABLE__`` (written while a measurement runs, filled when it ends) must not
    land: one did, unfilled, in README.md and docs/results.md."""
    left = [f"{path.relative_to(REPO)}: {m}" for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
            for m in re.findall(r"__[A-Z][A-Z0-9_]*__", path.read_text(encoding="utf-8"))]
    assert not left, left
