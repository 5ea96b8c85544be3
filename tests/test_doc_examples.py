"""Every ```python block in README.md and docs/*.md runs, as written, on CPU.

A block runs in a fresh namespace, in a temporary working directory. An HTML comment right before it
(invisible on GitHub) can give it context or say why it cannot run:

    <!-- doctest setup: model = tiny_model() -->      code run first, in the block's namespace
    <!-- doctest skip: needs 8 GPUs -->               not run; the reason is the skip's

The setup may span lines. ``REPO`` (the checkout), ``pytest`` and ``monkeypatch`` are in the namespace, so a
setup can ``pytest.importorskip`` an extra the block needs or set an environment variable for it alone.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*doctest (?P<kind>setup|skip):(?P<body>.*?)-->\s*\Z", re.S)


def doc_blocks() -> list[tuple[str, str, str | None, str | None]]:
    """(id, code, setup, skip reason) for every python block, in file order."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip()
            marker = MARKER.search(before[before.rfind("<!--"):]) if before.endswith("-->") else None
            kind, body = (marker["kind"], textwrap.dedent(marker["body"]).strip()) if marker else (None, None)
            code = textwrap.dedent(match["code"])
            found.append((f"{path.relative_to(REPO)}:{line}", code, body if kind == "setup" else None,
                          body if kind == "skip" else None))
    return found


BLOCKS = doc_blocks()


def test_the_docs_have_python_blocks_and_markers_parse():
    assert len(BLOCKS) >= 10, [b[0] for b in BLOCKS]
    for where, _, setup, skip in BLOCKS:
        assert skip is None or skip, f"{where}: a skip marker must say why"
        if setup:
            compile(setup, f"{where} (setup)", "exec")


@pytest.mark.parametrize("where, code, setup, skip", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_doc_block_runs(where, code, setup, skip, tmp_path, monkeypatch):
    if skip:
        pytest.skip(skip)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOGA_CACHE", str(tmp_path / "cache"))
    namespace = {"__name__": "__doc_block__", "REPO": REPO, "pytest": pytest, "monkeypatch": monkeypatch}
    if setup:
        exec(compile(setup, f"{where} (setup)", "exec"), namespace)
    exec(compile(code, where, "exec"), namespace)
