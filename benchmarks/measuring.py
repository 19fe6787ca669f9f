"""Timing, memory and the environment of a benchmark's record, shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "add_record_arguments", "environment", "peak_mib", "record_folder", "run_missing", "sync",
    "timed", "write_record",
]  # fmt: skip


def sync(device: torch.device) -> None:
    """Waits for ``device``'s queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of ``fn()``, the device synchronised around it."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def peak_mib(fn: Callable[[], object], device: torch.device, base: int) -> float:
    """Peak memory while ``fn`` runs, in MiB: ``base`` bytes (model and batch) plus the peak of
    what ``fn`` allocates."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return (base + torch.cuda.max_memory_allocated(device) - before) / 2**20
    from torch.profiler import ProfilerActivity, profile

    # The allocation events alone, summed in time order: the profiler's memory timeline
    # (``_memory_profile``, which needs stacks and shapes of every operator) ran out of memory
    # on the LSTM's step; on the other models both give the same peak.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return (base + peak) / 2**20


def environment() -> Dict[str, str]:
    """Python, torch, threads, the CPU's model name (``lscpu``), the GPU, the git commit."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                env["cpu"] = line.split(":", 1)[1].strip()
    except OSError:
        pass
    if torch.cuda.is_available():
        env["cuda"] = torch.cuda.get_device_name(0)
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        pass
    return env


def environment_line(env: Dict[str, str]) -> str:
    """``environment``'s result as the one line a script prints before its table."""
    return "environment: " + ", ".join(f"{k}={v}" for k, v in env.items())


def write_record(path: Path, result: dict) -> None:
    """``result`` with the :func:`environment`, as JSON at ``path``, written whole (a ``.tmp``
    file renamed): only a finished run leaves its file, so a resumed benchmark runs it again."""
    result = {**result, "environment": environment()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def run_missing(
    script: str,
    argv: Sequence[str],
    runs: Iterable[Tuple[str, Path]],
    log: Optional[Callable[[Path], Path]] = None,
) -> List[str]:
    """Runs ``script`` with ``argv`` plus ``--one SPEC`` in a process of its own for each
    ``(SPEC, record path)`` whose record does not exist yet (a resumed benchmark keeps its
    finished runs); with ``log``, each child's output goes to ``log(record path)`` and a
    failing child does not stop the others. Returns the specs run."""
    done = []
    for spec, path in runs:
        if path.exists():
            continue
        command = [sys.executable, script, *argv, "--one", spec]
        if log is None:
            subprocess.run(command, check=True)
        else:
            with open(log(path), "w") as f:
                subprocess.run(command, stdout=f, stderr=f)
        done.append(spec)
    return done


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a benchmark that writes one record per run in a folder:
    ``--out`` the folder, ``--table`` its table alone, ``--one`` (hidden) the run a child
    process of :func:`run_missing` makes."""
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--out", required=True)


def record_folder(args: argparse.Namespace, table: Callable[[Path], str]) -> Optional[Path]:
    """One torch thread and the record folder ``args.out``, made; ``None`` where ``--table``
    asked for the folder's table alone (printed here)."""
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table:
        print(table(out))
        return None
    return out
