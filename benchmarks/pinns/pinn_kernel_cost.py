"""The residual Gram matrix ``J J^T`` of a PINN: from the layers' factors against from ``J``'s rows.

Command (from the repository root; one thread, float64)::

    PYTHONPATH=src python benchmarks/pinns/pinn_kernel_cost.py --repeats 3 \\
        --out benchmarks/results/<record>/kernel_cost.json

For each problem and net of ``benchmarks/pinns/pinn.py`` (its points at step 0), the CPU seconds of
this process to form ``J J^T`` and one ``J^T u`` two ways, interleaved, median of ``--repeats``:
``factors``, :meth:`torch_sgn.pinn.Residuals.layer_factors` (:mod:`torch_sgn.pinn.layer_kernel`),
and ``rows``, ``J`` by ``vmap`` of ``jacrev`` over the points
(:func:`torch_sgn.engines.functional.jacobian_rows`) and ``J J^T`` from it, as exact steps formed
it before. The largest difference between the two matrices, relative to the largest entry, is
recorded as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

from measuring import environment  # noqa: E402
from pinn import PROBLEMS, network  # noqa: E402

from torch_sgn.engines.functional import jacobian_rows  # noqa: E402
from torch_sgn.linearization import Batch  # noqa: E402
from torch_sgn.model.flat_model import FunctionalModel  # noqa: E402
from torch_sgn.pinn import Residuals  # noqa: E402

CASES = [
    ("poisson2d", "2-64-1"),
    ("poisson2d", "2-64-64-48-48-1"),
    ("poisson2d", "2-256-256-128-128-1"),
    ("heat1d", "2-64-64-48-48-1"),
    ("poisson5d", "5-64-64-48-48-1"),
]


def _cpu(fn):
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def measure(problem_name: str, spec: str, repeats: int) -> dict:
    """One net's two ways to ``J J^T`` and ``J^T u``, interleaved."""
    problem = PROBLEMS[problem_name](0)
    net = network(spec, problem.dim, 0)
    res = Residuals(net, problem.blocks(net))
    fm = FunctionalModel(res)
    inputs, targets = res.batch(0)
    flat = fm.flat()
    u = torch.randn(res.count(inputs), dtype=torch.float64)
    res.layer_factors(fm, flat, inputs)  # its one-time check against rows of J

    def by_factors():
        f = res.layer_factors(fm, flat, inputs)
        return f.kernel(), f.vjp(u)

    def by_rows():
        with torch.enable_grad():
            j = jacobian_rows(fm, flat, Batch(inputs, targets))[1]
        return j @ j.T, j.T @ u

    times = {"factors": [], "rows": []}
    diff = 0.0
    for _ in range(repeats):
        t, (k_factors, _) = _cpu(by_factors)
        times["factors"].append(t)
        t, (k_rows, _) = _cpu(by_rows)
        times["rows"].append(t)
        scale = float(k_rows.abs().max())
        diff = max(diff, float((k_factors - k_rows).abs().max()) / scale)
        del k_factors, k_rows
    row = {
        "problem": problem_name,
        "net": spec,
        "parameters": fm.numel,
        "residuals": int(u.numel()),
        "factors_s": statistics.median(times["factors"]),
        "rows_s": statistics.median(times["rows"]),
        "times": times,
        "max_relative_difference": diff,
    }
    row["speedup"] = row["rows_s"] / row["factors_s"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for problem_name, spec in CASES:
        row = measure(problem_name, spec, args.repeats)
        rows.append(row)
        print(
            f"{problem_name:10s} {spec:22s} P={row['parameters']:7d} R={row['residuals']:5d}  "
            f"factors {row['factors_s']:.2f} s  rows {row['rows_s']:.2f} s  "
            f"x{row['speedup']:.1f}  diff {row['max_relative_difference']:.1e}",
            flush=True,
        )
    meta = {
        "command": "PYTHONPATH=src python benchmarks/pinns/pinn_kernel_cost.py "
        + " ".join(sys.argv[1:]),
        **environment(),
        "cpus": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
