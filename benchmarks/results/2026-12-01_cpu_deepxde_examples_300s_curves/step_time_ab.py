"""CPU milliseconds per SGN step of the README's Poisson problem (900 interior and 120 boundary
points, a 2 x 64 x 1 tanh network) and of a small one (60 points, 2 x 8 x 1), 40 steps after
three, one thread: the library given by PYTHONPATH, labelled by the first argument. Run for
two libraries in turn on the same machine, under the same load, it compares their step's cost.

    PYTHONPATH=/tmp/old/src python step_time_ab.py old
    PYTHONPATH=src python step_time_ab.py new
"""

import math
import sys
import time

import torch
from torch import nn

from torch_sgn import SGN
from torch_sgn.pinn import Residual, Residuals, laplacian


def exact(x):
    return torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])


def problem(n: int, width: int) -> Residuals:
    torch.manual_seed(0)
    t = torch.rand(30, 1, dtype=torch.float64)
    edges = [torch.cat(p, 1) for p in ((t, 0 * t), (t, 0 * t + 1), (0 * t, t), (0 * t + 1, t))]
    inner, edge = torch.rand(n, 2, dtype=torch.float64), torch.cat(edges)
    net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1)).double()
    return Residuals(
        net,
        {
            "interior": Residual(
                lambda u, x: -laplacian(u, x) - 2 * math.pi**2 * exact(x), points=inner
            ),
            "boundary": Residual(lambda u, x: u(x), points=edge),
        },
    )


def main() -> None:
    torch.set_num_threads(1)
    for n, width in ((900, 64), (60, 8)):
        res = problem(n, width)
        opt = SGN(res, res.loss)
        for s in range(3):
            opt.step(*res.batch(s))
        t0 = time.process_time()
        for s in range(3, 43):
            info = opt.step(*res.batch(s))
        ms = (time.process_time() - t0) / 40 * 1000
        print(sys.argv[1], n, width, f"ms/step {ms:.1f}", f"{info.loss:.3e}", info.solver)


if __name__ == "__main__":
    main()
