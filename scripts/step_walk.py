"""The walk of one ``SGN.step`` through the library's files, measured.

Builds the README's Poisson problem (a ``torch_sgn.pinn.Residuals`` problem: a 2 x 64 x 1
network on 1,020 points), takes a few steps (the first traces and caches), then profiles one
step with ``sys.setprofile``: every Python call from one file of ``src/torch_sgn`` into
another is a move. Prints the files visited in order of first visit, the number of moves, the
calls into ``optimizer.py`` from another file (its re-entries), and the same counts without the
problem's own evaluation (``pinn/`` and ``model/``: the network and its operators, which any
walk runs).

    PYTHONPATH=src python scripts/step_walk.py
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

import torch
from torch import nn

import torch_sgn
from torch_sgn import SGN
from torch_sgn.pinn import Residual, Residuals, laplacian

ROOT = os.path.dirname(torch_sgn.__file__) + os.sep
EVALUATION = ("pinn" + os.sep, "model" + os.sep)


def problem() -> Residuals:
    torch.manual_seed(0)

    def exact(x):
        return torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])

    t = torch.rand(30, 1, dtype=torch.float64)
    edges = [torch.cat(p, 1) for p in ((t, 0 * t), (t, 0 * t + 1), (0 * t, t), (0 * t + 1, t))]
    x_interior, x_boundary = torch.rand(900, 2, dtype=torch.float64), torch.cat(edges)
    net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    return Residuals(
        net,
        {
            "interior": Residual(
                lambda u, x: -laplacian(u, x) - 2 * math.pi**2 * exact(x), points=x_interior
            ),
            "boundary": Residual(lambda u, x: u(x), points=x_boundary),
        },
    )


def walk(calls: list[tuple[str, str]], skip: tuple[str, ...] = ()) -> tuple[list[str], int, int]:
    """Files in order of first visit, moves between files, calls into optimizer.py."""
    files: list[str] = []
    moves = entries = 0
    for caller, callee in calls:
        if callee.startswith(skip):
            continue
        if callee not in files:
            files.append(callee)
        if caller != callee:
            moves += 1
            entries += callee == "optimizer.py"
    return files, moves, entries


def measure() -> list[tuple[str, str]]:
    """``(caller's file, callee's file)`` of every call into the library during one step
    (after three)."""
    res = problem()
    opt = SGN(res, res.loss)
    for step in range(3):
        opt.step(*res.batch(step))
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(ROOT):
            return
        back = frame.f_back
        while back is not None and not back.f_code.co_filename.startswith(ROOT):
            back = back.f_back  # (through torch's and Python's own frames)
        caller = back.f_code.co_filename[len(ROOT) :] if back is not None else "<user>"
        calls.append((caller, callee[len(ROOT) :]))

    batch = res.batch(3)
    sys.setprofile(profile)
    try:
        opt.step(*batch)
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    torch.set_num_threads(1)
    calls = measure()
    for label, skip in (("every call", ()), ("without the problem's evaluation", EVALUATION)):
        files, moves, entries = walk(calls, skip)
        print(f"{label}: {len(files)} files, {moves} moves, {entries} calls into optimizer.py")
        print("  " + " -> ".join(files))
    print("calls per file:", dict(Counter(callee for _, callee in calls).most_common()))


if __name__ == "__main__":
    main()
