"""The package's shape: the optimizer library stands apart from the experiment tooling."""

import subprocess
import sys

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
