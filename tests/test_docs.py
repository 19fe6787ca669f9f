"""Every Python block of README.md and docs/*.md runs; the documentation site builds.

A block runs on its own, in a fresh namespace, on one thread. A block whose first line is
``# an excerpt of examples/NAME.py`` is not run: each of its lines (without comments; ``...``
marks lines left out) is a line of that example, which a test file runs instead. A block that
is one line ``--8<-- "examples/NAME.py"`` shows that example whole on the site (docs/EXAMPLES.md).

Each row of docs/RESULTS.md names the commits, clock and processors its records state
(scripts/check_results.py). The site (mkdocs.yml) builds with warnings as errors, its API
reference has an entry for every public name, and the public names' docstrings leave out
nothing beyond the listed gaps (scripts/check_docstrings.py, scripts/docstring_gaps.txt).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
EXCERPT = re.compile(r"#\s*an excerpt of (examples/\w+\.py)")
SNIPPET = re.compile(r'--8<-- "(examples/\w+\.py)"\s*')
#: A training loop of a hundred iterations or more (``range(200)``): a block runs it for three.
LONG_LOOP = re.compile(r"\brange\((\d{3,})\)")
sys.path.insert(0, str(ROOT / "scripts"))
import check_docstrings  # noqa: E402
import check_results  # noqa: E402
from docs_hooks import public_names  # noqa: E402


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
    """Every Python block of the README and docs/ runs as written, its long training loops
    (``range(200)``) cut to three iterations: every line runs; how far the loop gets is the
    business of the example scripts that run the same problems (tests/test_examples.py)."""
    snippet = SNIPPET.fullmatch(source)
    if snippet:
        assert (ROOT / snippet.group(1)).is_file(), snippet.group(1)
        return
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
        code = LONG_LOOP.sub("range(3)", source)
        exec(compile(code, "<docs block>", "exec"), {"__name__": "__docs__"})
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)


def test_the_site_builds_without_a_warning_and_its_api_reference_has_every_public_name(
    tmp_path,
):
    """One test (one build: the site takes seconds, and test processes share no fixture)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    assert (tmp_path / "index.html").is_file() and (tmp_path / "api" / "torch_sgn.html").is_file()
    pages = "".join(p.read_text() for p in (tmp_path / "api").glob("*.html"))
    for module in ["torch_sgn", "torch_sgn.pinn", "torch_sgn.deepxde", "torch_sgn.distributed"]:
        names = public_names(module)
        assert names
        missing = [n for n in names if f'id="{module}.{n}"' not in pages]
        assert not missing, f"{module}: no API entry for {missing}"


def test_docstring_gaps_are_the_listed_ones():
    listed = {
        line
        for line in (ROOT / "scripts" / "docstring_gaps.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    found = set(check_docstrings.gaps())
    assert not found - listed, f"document these (Args/Returns/Raises): {sorted(found - listed)}"
    assert not listed - found, f"no longer gaps, delete from the list: {sorted(listed - found)}"


def test_the_changelog_names_the_package_version():
    import torch_sgn

    newest = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest and newest.group(1) == torch_sgn.__version__


def test_results_rows_match_their_records():
    assert check_results.problems(check_results.RESULTS.read_text()) == []


def test_the_results_check_finds_a_commit_that_is_not_the_runs():
    # The Boston grid's row named a docs commit once; its record says cf445c0.
    text = check_results.RESULTS.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| Boston"))
    wrong = text.replace(row, row.replace("| cf445c0 |", "| 477356d |"))
    assert wrong != text
    found = check_results.problems(wrong)
    assert any("not named: ['cf445c0']" in p for p in found), found
    assert any("do not state: ['477356d']" in p for p in found), found
