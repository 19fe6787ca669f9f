"""The files a run writes: each written to a temporary name and renamed (a run killed at any
moment leaves the old file or the new one, never a torn one), JSON without NaN, and the
environment recorded beside the results."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from .. import __version__
from .. import distributed as sgn_dist

__all__ = [
    "FORMAT",
    "PathLike",
    "atomic_torch_save",
    "atomic_write_json",
    "device_name",
    "environment",
    "jsonable",
    "read_json",
]


FORMAT = "torch-sgn/results-1"
"""Value of ``"format"`` in every ``results.json`` this module writes."""


PathLike = Union[str, "os.PathLike[str]"]


def _atomic_write_bytes(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(jsonable(obj), indent=1) + "\n").encode())


def atomic_torch_save(path: Path, obj: Any) -> None:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _atomic_write_bytes(path, buffer.getvalue())


def jsonable(obj: Any) -> Any:
    # JSON has no NaN or infinity: write them as null (a diverged run's losses).
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def read_json(path: PathLike) -> Optional[dict]:
    """A JSON file's content, or ``None`` when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _git_commit() -> Optional[str]:
    """HEAD of the checkout this package was imported from, ``-dirty`` when the package's own
    files differ from it (untracked files included), or ``None`` outside a git checkout."""
    package = Path(__file__).resolve().parents[1]  # torch_sgn/, the library and this tooling
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=package,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    commit = out.stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "."],
        cwd=package,
        capture_output=True,
        text=True,
        timeout=5,
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


# Read once, when the code is imported: a long run records the code it runs, not the state of
# the checkout when it ends.
_GIT_COMMIT = _git_commit()


def device_name(device: torch.device) -> str:
    """A human name of the device: the GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    return {
        "torch_sgn": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "git_commit": _GIT_COMMIT,
        "world_size": sgn_dist.world_size(),
        "backend": dist.get_backend() if sgn_dist.world_size() > 1 else None,
    }
