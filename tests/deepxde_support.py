"""DeepXDE for the test modules that use it."""

import os

import pytest


def import_deepxde():
    """DeepXDE, imported with its PyTorch backend; the calling test module is skipped where
    DeepXDE is not installed or another backend was loaded first."""
    os.environ.setdefault("DDE_BACKEND", "pytorch")
    dde = pytest.importorskip("deepxde")
    if dde.backend.backend_name != "pytorch":  # pragma: no cover - another backend chosen
        pytest.skip("DeepXDE's PyTorch backend is not the one loaded", allow_module_level=True)
    return dde
