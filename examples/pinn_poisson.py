"""A physics-informed network for the 2-D Poisson equation, trained by SGN's exact steps.

Command: python examples/pinn_poisson.py [--steps 300] [--width 64]

-Laplace(u) = 2 pi^2 sin(pi x) sin(pi y) on the unit square, u = 0 on its boundary; the exact
solution is u = sin(pi x) sin(pi y). A 2-64-1 tanh network in float64, 900 interior and 120
boundary points. The Laplacian is propagated forward through the network
(``torch_sgn.pinn.laplacian``), so SGN differentiates the residuals as ordinary operations and
forms their Jacobian row by row for exact Levenberg-Marquardt steps.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from torch_sgn import SGN
from torch_sgn.pinn import Residual, Residuals, laplacian


def exact(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])


def boundary_points(n: int, g: torch.Generator) -> torch.Tensor:
    t = torch.rand(n, 1, generator=g, dtype=torch.float64)
    zero, one = torch.zeros_like(t), torch.ones_like(t)
    sides = [torch.cat(p, 1) for p in ((t, zero), (t, one), (zero, t), (one, t))]
    return torch.cat(sides)[torch.randperm(4 * n, generator=g)[:n]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a few steps on a small net (a test)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps, width = (20, 16) if args.quick else (args.steps, args.width)

    g = torch.Generator().manual_seed(0)
    interior = torch.rand(900, 2, generator=g, dtype=torch.float64)
    boundary = boundary_points(120, g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1)).double()

    problem = Residuals(
        net,
        {
            "interior": Residual(
                lambda u, x: -laplacian(u, x) - 2 * math.pi**2 * exact(x), points=interior
            ),
            "boundary": Residual(lambda u, x: u(x), points=boundary),
        },
    )
    opt = SGN(problem, problem.loss)  # solver="auto": exact steps on a least-squares problem

    test = torch.rand(10_000, 2, generator=g, dtype=torch.float64)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        info = opt.step(*problem.batch(step))
        if step % max(1, steps // 10) == 0 or step == steps:
            with torch.no_grad():
                error = (net(test) - exact(test)).norm() / exact(test).norm()
            print(
                f"step {step:5d}  loss {info.loss_after:.3e}  rel. L2 error {error:.3e}  "
                f"({info.solver}, damping {info.damping:.1e}, "
                f"{time.perf_counter() - start:.1f} s)"
            )


if __name__ == "__main__":
    main()
