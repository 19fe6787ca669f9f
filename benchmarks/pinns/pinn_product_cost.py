"""What one Gauss-Newton product costs on a PINN, in gradients of its loss.

Command (from the repository root; one thread, float64)::

    PYTHONPATH=src python benchmarks/pinns/pinn_product_cost.py --repeats 21

The 2-D Poisson problem of ``benchmarks/pinns/pinn.py`` (900 interior, 120 boundary points) with the
Laplacian propagated forward (``torch_sgn.pinn.laplacian``), for tanh nets 2-64-1 and
2-64-64-48-48-1. For each engine that takes the model: the median CPU time of one ``G v``
product (after the engine's set-up), divided by the median time of one gradient of the loss
(``torch.autograd.grad`` through the same residuals), both measured in interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from torch_sgn import GGN
from torch_sgn.pinn import Residual, Residuals, laplacian

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402

D = torch.float64


def problem(widths):
    g = torch.Generator().manual_seed(0)
    x_in, x_bd = torch.rand(900, 2, generator=g, dtype=D), torch.rand(120, 2, generator=g, dtype=D)
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(widths) - 2 else [])
    net = nn.Sequential(*layers).to(D)
    f = lambda x: 2 * math.pi**2 * torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])  # noqa: E731
    return Residuals(
        net,
        {
            "interior": Residual(lambda u, x: -laplacian(u, x) - f(x), points=x_in),
            "boundary": Residual(lambda u, x: u(x), points=x_bd),
        },
    )


def cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--engines", nargs="+", default=["traced", "functional"])
    p.add_argument("--out", default=None, help="a JSON file for the raw times")
    args = p.parse_args()
    torch.set_num_threads(1)
    env = environment()
    print(environment_line(env))
    rows = []
    for widths in ([2, 64, 1], [2, 64, 64, 48, 48, 1]):
        res = problem(widths)
        inputs, targets = res.batch()
        params = list(res.parameters())

        def gradient(res=res, inputs=inputs, params=params):
            loss = res(*inputs).square().sum()
            torch.autograd.grad(loss, params)

        for engine in args.engines:
            G = GGN(res, res.loss, inputs, targets, engine=engine)
            v = torch.randn(G.shape[0], dtype=D)
            G @ v, gradient()  # warm-up
            grads, products = [], []
            for _ in range(args.repeats):
                grads.append(cpu(gradient))
                products.append(cpu(lambda G=G, v=v: G @ v))
            g, pr = statistics.median(grads), statistics.median(products)
            rows.append(
                {
                    "net": "-".join(map(str, widths)),
                    "parameters": G.shape[0],
                    "engine": engine,
                    "gradient_ms": 1e3 * g,
                    "product_ms": 1e3 * pr,
                    "product_in_gradients": pr / g,
                }
            )
            print(
                f"{rows[-1]['net']:18s} P={G.shape[0]:6d} {engine:10s} gradient {1e3 * g:7.2f} ms"
                f"  G v {1e3 * pr:7.2f} ms  = {pr / g:.2f} gradients",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "repeats": args.repeats, "rows": rows}, f)


if __name__ == "__main__":
    main()
