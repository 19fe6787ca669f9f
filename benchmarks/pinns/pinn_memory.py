"""Peak memory of SGN's default steps on a PINN of many points (the 2-D Poisson of
``benchmarks/pinns/pinn.py``), as the process's peak resident set size.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/pinns/pinn_memory.py --points 1000000 40000 --steps 5

It prints the peak RSS after the points are drawn and after the steps, and the points each step
sampled. One thread.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402
from pinn import PROBLEMS, network  # noqa: E402

from torch_sgn import SGN  # noqa: E402
from torch_sgn.pinn import Residuals  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def main(argv: list | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", type=int, nargs=2, default=[1_000_000, 40_000])
    p.add_argument("--net", default="2-64-64-48-48-1")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(environment(), flush=True)
    problem = PROBLEMS["poisson2d"](0, tuple(args.points))
    net = network(args.net, problem.dim, 0)
    residuals = Residuals(net, problem.blocks(net))
    inputs, targets = residuals.batch(0)
    drawn = peak_mib()
    opt = SGN(residuals, residuals.loss)
    t0 = time.process_time()
    for _ in range(args.steps):
        info = opt.step(inputs, targets)
    print(
        f"points {sum(args.points):,}, net {args.net}: peak RSS {drawn:.0f} MiB with the points "
        f"drawn, {peak_mib():.0f} MiB after {args.steps} steps ({time.process_time() - t0:.1f} "
        f"CPU s; sample {info.sample}, solver {info.solver})"
    )


if __name__ == "__main__":
    sys.exit(main())
