"""What forming the dense Gauss-Newton matrix costs, by the two routes the direct solver has.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/cost/direct_cost.py

For each model (one torch thread, the layer-wise engine, MSE), the median seconds of process CPU
time (comparable on a shared machine) of: one
``G v`` product; ``G`` from the per-sample output Jacobian (``Linearization.dense_ggn``, the
layer-wise engine's route); ``G`` from products with the identity's columns, one by one
(``linearization.ggn_matrix`` on a CPU, the route of every other engine) and batched by
``torch.func.vmap`` in chunks of 64 (its route on other devices); a Cholesky factorization of a
``P x P`` float64 matrix (the solver sums ``G`` and factors it in float64 for every model).
Models: the sinc benchmark's 1-20-1 tanh MLP (batch 1000), the paper's Boston MLP 13-100-100-1
sigmoid (batch 101), a 1-40-40-1 tanh MLP (batch 1000).

A second table times the route through the batch's outputs, for models with more parameters
than the batch has outputs ``R``: ``J J^T`` (``R x R``, from each sample's factored
cotangents), one exact solve through it (:func:`torch_sgn.solve.direct.solve_in_sample_space`,
including the product that measures its residual), and, for comparison, 10 CG iterations.
Models: the Boston MLP (batch 101) and the regression benchmark's 3-256-256-256-1 tanh MLP
(132,865 parameters, batch 1000).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from torch_sgn.engines.selection import select_engine
from torch_sgn.linearization import Batch, ggn_matrix
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.solve import direct as solvers
from torch_sgn.solve.cg import conjugate_gradient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402

MODELS = {
    "sinc 1-20-1 tanh, batch 1000": (
        lambda: nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 1)), 1000, 1
    ),
    "1-40-40-1 tanh, batch 1000": (
        lambda: nn.Sequential(
            nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 1)
        ),
        1000,
        1,
    ),
    "Boston 13-100-100-1 sigmoid, batch 101": (
        lambda: nn.Sequential(
            nn.Linear(13, 100), nn.Sigmoid(), nn.Linear(100, 100), nn.Sigmoid(), nn.Linear(100, 1)
        ),
        101,
        13,
    ),
}  # fmt: skip


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2]


def _vmapped(ggn_vp, n: int, like: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    out = like.new_empty((n, n))
    vmapped = torch.func.vmap(ggn_vp)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = like.new_zeros((stop - start, n))
        rows[:, start:stop].fill_diagonal_(1.0)
        out[start:stop] = vmapped(rows)
    return out


OUTPUT_MODELS = {
    "Boston 13-100-100-1 sigmoid, batch 101": MODELS["Boston 13-100-100-1 sigmoid, batch 101"],
    "3-256-256-256-1 tanh, batch 1000": (
        lambda: nn.Sequential(
            nn.Linear(3, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256),
            nn.Tanh(), nn.Linear(256, 1),
        ),
        1000,
        3,
    ),
}  # fmt: skip


def _solve_outputs(lin) -> None:
    solvers.solve_in_sample_space(lin.sample_space, lin.grad, 1e-4, lin.ggn_vp)


def _cg10(lin) -> None:
    conjugate_gradient(lambda v: lin.ggn_vp(v).add_(v, alpha=1e-4), -lin.grad, max_iters=10)


def through_outputs(dtypes) -> None:
    print()
    print("| model | dtype | P | R | product | J J^T | solve through outputs | CG, 10 iterations |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (build, batch, inputs) in OUTPUT_MODELS.items():
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            model = build().to(dtype)
            fmodel = FunctionalModel(model)
            x = torch.randn(batch, inputs, dtype=dtype)
            y = torch.randn(batch, 1, dtype=dtype)
            lin = select_engine(fmodel, resolve_loss("mse"), "layerwise")(
                fmodel.flat(), Batch(x, y)
            )
            space = lin.sample_space
            like = fmodel.flat()
            product = _median(partial(lin.ggn_vp, like), 11)
            kernel = _median(space.kernel, 5)
            space.kernel_matrix()  # formed once per step; the solve below reuses it

            solve = _median(partial(_solve_outputs, lin), 5)
            cg = _median(partial(_cg10, lin), 5)
            print(
                f"| {name} | {dtype_name} | {fmodel.numel} | {space.size} | {product:.2e} | "
                f"{kernel:.2e} | {solve:.2e} | {cg:.2e} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    env = environment()
    print(environment_line(env))
    print("1 thread; CPU seconds (median)")
    print(
        "| model | dtype | P | product | G via Jacobian | G via products | via vmap "
        "| Cholesky (float64) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (build, batch, inputs) in MODELS.items():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            model = build().to(dtype)
            fmodel = FunctionalModel(model)
            x = torch.randn(batch, inputs, dtype=dtype)
            y = torch.randn(batch, 1, dtype=dtype)
            loss = resolve_loss("mse")
            lin = select_engine(fmodel, loss, "layerwise")(fmodel.flat(), Batch(x, y))
            n = fmodel.numel
            big = n > 5000
            reps = 3 if big else 21
            like = fmodel.flat()
            vp = lin.ggn_vp
            product = _median(partial(vp, like), 21)
            # The Jacobian route, formed afresh each time (ggn_matrix() keeps its result).
            jac = _median(lin.dense_ggn, reps)
            loop = _median(partial(ggn_matrix, vp, n, like), 1 if big else 5)
            batched = _median(partial(_vmapped, vp, n, like), 1 if big else 5)
            # The direct solver factors in float64 whatever the model's dtype.
            a = torch.randn(n, n, dtype=torch.float64)
            a = a @ a.T + n * torch.eye(n, dtype=torch.float64)
            chol = _median(partial(torch.linalg.cholesky_ex, a), 1 if big else 5)
            print(
                f"| {name} | {dtype_name} | {n} | {product:.2e} | {jac:.2e} | {loop:.2e} | "
                f"{batched:.2e} | {chol:.2e} |",
                flush=True,
            )
    through_outputs(args.dtypes)


if __name__ == "__main__":
    main()
