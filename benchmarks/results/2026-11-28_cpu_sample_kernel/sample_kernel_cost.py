"""What forming ``J J^T`` pair by pair of output units costs against all pairs at once, in a step.

Command (from the repository root)::

    PYTHONPATH=src python \\
        benchmarks/results/2026-11-28_cpu_sample_kernel/sample_kernel_cost.py --out results.json

An exact step through the batch's outputs (``SGN(model, "mse", solver="direct")``, the
layer-wise engine, float32, one torch thread) forms the ``R x R`` kernel ``J J^T`` from each
parameter's per-output-unit factors. With ``n_out`` output units per sample the loop over pairs
runs about ``n_out^2 / 2`` times per parameter tensor; a parameter with one factor per output
unit and one shared right factor (an untied linear layer) adds all its pairs in one product.
Both ways run side by side in one process on the same factors' code (``by_pairs=True`` is the
loop), interleaved, each on a fresh copy of the model and optimizer; the median over the
repeats of one step's wall-clock and process CPU seconds, and of ``J J^T`` alone. The two
steps' parameters are compared (largest absolute difference).

Result (2-core x86-64 CPU (AMD EPYC, KVM guest), one thread, torch 2.13.0+cpu; record
``benchmarks/results/2026-11-28_cpu_sample_kernel``): one step 0.110 -> 0.015 s on
Linear(3000, 30) (``R = 300``), 1.165 -> 0.094 s on a 20-64-100 tanh MLP (``R = 1000``), 7.92
-> 1.56 s on Linear(20, 300) (``R = 3000``), batch 10 each.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from torch_sgn import SGN
from torch_sgn.batch import Batch
from torch_sgn.engines.layerwise import engine as layerwise
from torch_sgn.engines.selection import select_engine
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402

# name -> (model maker, batch size, input features)
MODELS = {
    "Linear(3000, 30), batch 10 (R = 300)": (lambda: nn.Linear(3000, 30), 10, 3000),
    "MLP 20-64-100 tanh, batch 10 (R = 1000)": (
        lambda: nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 100)), 10, 20
    ),
    "Linear(20, 300), batch 10 (R = 3000)": (lambda: nn.Linear(20, 300), 10, 20),
}  # fmt: skip

KERNELS = {
    "pairs": partial(layerwise.kernel_of_factors, by_pairs=True),
    "stacked": layerwise.kernel_of_factors,
}


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _kernel_seconds(model: nn.Module, x, y) -> tuple:
    fm = FunctionalModel(model)
    lin = select_engine(fm, resolve_loss("mse"), "layerwise")(fm.flat(), Batch(x, y))
    assert lin.sample_space is not None
    return _timed(lin.sample_space.kernel)


def run(repeats: int) -> list:
    rows = []
    for name, (make, batch, features) in MODELS.items():
        torch.manual_seed(0)
        model = make()
        x = torch.randn(batch, features)
        y = torch.randn(batch, model(x).shape[1])
        n_params = sum(p.numel() for p in model.parameters())
        times = {k: {"step_wall": [], "step_cpu": [], "kernel_wall": []} for k in KERNELS}
        after, kernels = {}, {}
        for r in range(repeats + 1):  # the first round warms up and is not counted
            for kind, kernel in KERNELS.items():
                layerwise.kernel_of_factors = kernel
                opt = SGN(copy.deepcopy(model), "mse", solver="direct")
                info, wall, cpu = _timed(partial(opt.step, x, y))
                assert info.solver == "direct" and y.numel() < n_params  # through the outputs
                K, kernel_wall, _ = _kernel_seconds(copy.deepcopy(model), x, y)
                if r:
                    times[kind]["step_wall"].append(wall)
                    times[kind]["step_cpu"].append(cpu)
                    times[kind]["kernel_wall"].append(kernel_wall)
                after[kind] = nn.utils.parameters_to_vector(opt.param_groups[0]["params"])
                kernels[kind] = K
        layerwise.kernel_of_factors = KERNELS["stacked"]
        row = {
            "model": name,
            "P": n_params,
            "R": y.numel(),
            "n_out": y.shape[1],
            "max_abs_param_diff": float((after["pairs"] - after["stacked"]).abs().max().detach()),
            "max_rel_kernel_diff": float(
                (kernels["pairs"] - kernels["stacked"]).abs().max() / kernels["pairs"].abs().max()
            ),
        }
        for kind in KERNELS:
            for key, values in times[kind].items():
                row[f"{kind}_{key}_median"] = statistics.median(values)
                row[f"{kind}_{key}"] = values
        rows.append(row)
        print(
            f"| {name} | {n_params} | {row['R']} | {row['pairs_step_wall_median']:.3f} | "
            f"{row['stacked_step_wall_median']:.3f} | "
            f"{row['pairs_step_wall_median'] / row['stacked_step_wall_median']:.1f}x | "
            f"{row['pairs_kernel_wall_median']:.3f} | {row['stacked_kernel_wall_median']:.4f} | "
            f"{row['max_abs_param_diff']:.1e} |",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    commit = environment().get("commit", "")
    print(f"torch {torch.__version__}, 1 thread, {platform.machine()}, commit {commit}")
    print(
        "| model | P | R | step, pairs (s) | step, at once (s) | speed-up | J J^T, pairs (s) "
        "| J J^T, at once (s) | max abs parameter difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = run(args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"torch": torch.__version__, "threads": 1, "commit": commit,
                 "repeats": args.repeats, "rows": rows},
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
