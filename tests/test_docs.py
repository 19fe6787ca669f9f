"""Every Python block of README.md and docs/*.md runs.

A block runs on its own, in a fresh namespace, on one thread. A block whose first line is
``# an excerpt of examples/NAME.py`` is not run: each of its lines (without comments; ``...``
marks lines left out) is a line of that example, which a test file runs instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
EXCERPT = re.compile(r"#\s*an excerpt of (examples/\w+\.py)")


def blocks() -> list:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(pytest.param(match.group(1), id=f"{path.name}:{line}"))
    return found


def _code(line: str) -> str:
    """A line without its comment and surrounding blanks (no block quotes a ``#`` in a string)."""
    return line.split("#", 1)[0].strip()


def test_the_docs_have_blocks():
    assert len(blocks()) >= 10


@pytest.mark.parametrize("source", blocks())
def test_block_runs(source: str):
    excerpt = EXCERPT.match(source)
    if excerpt:
        example = (ROOT / excerpt.group(1)).read_text().splitlines()
        lines = {_code(line) for line in example}
        code = [c for c in map(_code, source.splitlines()) if c and c != "..."]
        missing = [c for c in code if c not in lines]
        assert not missing, f"not lines of {excerpt.group(1)}: {missing}"
        name = Path(excerpt.group(1)).stem
        assert any(name in test.read_text() for test in (ROOT / "tests").glob("test_*.py"))
        return
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    try:
        exec(compile(source, "<docs block>", "exec"), {"__name__": "__docs__"})
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
