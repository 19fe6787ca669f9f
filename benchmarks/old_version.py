"""Another version of torch-sgn beside the current one in one process, for A/B benchmarks."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["import_old"]


def import_old(old_src: str) -> str:
    """Copies ``old_src/torch_sgn`` (the ``src`` directory of another checkout, e.g. made with
    ``git worktree add /tmp/old <commit>``) to a temporary package ``torch_sgn_old`` and returns
    its name: its imports are relative, so it loads beside the current ``torch_sgn``."""
    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(Path(old_src) / "torch_sgn", tmp / "torch_sgn_old")
    sys.path.insert(0, str(tmp))
    return "torch_sgn_old"
