"""The package's shape: the optimizer library stands apart from the experiment tooling."""

import re
import subprocess
import sys
from pathlib import Path

import torch_sgn


def test_importing_the_library_loads_no_tooling():
    # A fresh interpreter: this test process has the tooling loaded by other tests.
    code = (
        "import sys, torch; before = set(sys.modules); import torch_sgn; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "torch_sgn" in loaded
    tooling = [m for m in loaded if m.startswith("torch_sgn.experiments")]
    extras = [m for m in loaded if m.split(".")[0] in ("matplotlib", "tqdm", "numpy")]
    assert tooling == [] and extras == [], (tooling, extras)


def test_public_api_is_what_init_exports():
    for name in torch_sgn.__all__:
        assert getattr(torch_sgn, name) is not None
    assert "experiments" not in torch_sgn.__all__
    assert isinstance(torch_sgn.__version__, str)


def test_command_line_entry_points():
    out = subprocess.run(
        [sys.executable, "-m", "torch_sgn", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--preset" in out


def test_the_version_is_written_once():
    # pyproject.toml reads it from the package; no other file of the package states it.
    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "torch_sgn.__version__" }' in pyproject
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M)  # no static version
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", torch_sgn.__version__)
    stated = [
        p.relative_to(root)
        for p in (root / "src").rglob("*.py")
        if f'"{torch_sgn.__version__}"' in p.read_text()
    ]
    assert [str(p) for p in stated] == ["src/torch_sgn/__init__.py"], stated
