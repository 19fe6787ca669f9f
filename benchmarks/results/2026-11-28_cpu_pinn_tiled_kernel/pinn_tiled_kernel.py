"""The residual Gram matrix ``J J^T`` of a PINN's sample from the layers' factors, formed by
tiles and untiled (:data:`torch_sgn.pinn.layer_kernel.TILED_ABOVE`), on the CPU.

Command (from the repository root; one thread, float64)::

    PYTHONPATH=src python \\
        benchmarks/results/2026-11-28_cpu_pinn_tiled_kernel/pinn_tiled_kernel.py --repeats 3 \\
        --out benchmarks/results/<record>/tiled_kernel.json

The 2-D Poisson problem of ``benchmarks/pinns/pinn.py`` (seed 0) on the 2-64-64-48-48-1 net,
10,000 + 400 points; for each sample size (the points many points' steps draw: 1,024, 2,048 and
4,000, each block keeping its share, :func:`torch_sgn.solve.sampled.draw`), the CPU seconds of
this process to form the sample's ``J J^T`` from its factors, tiled and untiled taking turns,
median of ``--repeats``, and the largest difference between the two, relative to the largest
entry.
``--points`` sets the problem's points (a sample of all of them: their kernel), ``--tiled-above``
the blocks tiled (default: the library's :data:`~torch_sgn.pinn.layer_kernel.TILED_ABOVE`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [BENCHMARKS, os.path.join(BENCHMARKS, "pinns")]  # shared modules; pinns/pinn.py

from measuring import environment  # noqa: E402
from pinn import network, poisson2d  # noqa: E402

from torch_sgn.model.flat_model import FunctionalModel  # noqa: E402
from torch_sgn.pinn import Residuals, layer_kernel  # noqa: E402
from torch_sgn.solve.sampled import draw  # noqa: E402

TILED_ABOVE = layer_kernel.TILED_ABOVE  # the library's, restored after each size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4000])
    p.add_argument("--points", type=int, nargs=2, default=[10000, 400])
    p.add_argument("--tiled-above", type=int, default=layer_kernel.TILED_ABOVE)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    problem = poisson2d(0, points=tuple(args.points))
    net = network("2-64-64-48-48-1", 2, 0)
    residuals = Residuals(net, problem.blocks(net))
    inputs, _ = residuals.batch()
    fmodel = FunctionalModel(residuals)
    rows = []
    for size in args.sizes:
        index = draw(residuals.points(inputs), size, 0, torch.device("cpu"))
        sample = residuals.subset(inputs, index)
        factors = residuals.layer_factors(fmodel, fmodel.flat(), sample)
        times = {"tiled": [], "untiled": []}
        kernels = {}
        tiled_above = args.tiled_above
        for _ in range(args.repeats):
            for how in ("tiled", "untiled"):
                layer_kernel.TILED_ABOVE = tiled_above if how == "tiled" else 1 << 62
                start = time.process_time()
                kernels[how] = factors.kernel()
                times[how].append(time.process_time() - start)
        layer_kernel.TILED_ABOVE = TILED_ABOVE
        scale = float(kernels["untiled"].abs().max())
        row = {
            "points": [len(i) for i in index],
            "tiled_s": statistics.median(times["tiled"]),
            "untiled_s": statistics.median(times["untiled"]),
            "times": times,
            "max_rel_difference": float((kernels["tiled"] - kernels["untiled"]).abs().max())
            / scale,
        }
        rows.append(row)
        print(
            f"{size:5d} points {row['points']}: tiled {row['tiled_s']:.2f} s, untiled "
            f"{row['untiled_s']:.2f} s ({row['untiled_s'] / row['tiled_s']:.2f}x), largest "
            f"difference {row['max_rel_difference']:.1e}",
            flush=True,
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    record = {
        "command": "PYTHONPATH=src python " + " ".join(sys.argv),
        **environment(),
        "tile": layer_kernel.TILE,
        "tiled_above": args.tiled_above,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
