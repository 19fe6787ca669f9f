"""CPU seconds of SGN's steps on residual problems, at the checkout on ``PYTHONPATH``.

Run by ``run.sh`` at the commit before the rows engine and at the commit that added it, in
turns. Prints one JSON line: for each case the first step's process CPU seconds (where the
traced engine traced) and the median of the next ones, the last step's loss and its route.

Cases: the README's Poisson problem (1,020 points, a 2 x 64 x 1 network) with the defaults,
with ``solver="cg"`` (products by the engine chain) and with ``solver="cg",
engine="functional"`` (products by forward mode); a 5 x 100 network on 11,332 points (its
steps on samples of the points).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch
from torch import nn

from torch_sgn import SGN
from torch_sgn.pinn import Residual, Residuals, laplacian


def poisson(interior: int, width: int, depth: int, seed: int = 0) -> Residuals:
    torch.manual_seed(seed)

    def exact(x):
        return torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])

    side = interior // 30  # the README: 900 points inside, 30 on each edge
    t = torch.rand(side, 1, dtype=torch.float64)
    edges = [torch.cat(p, 1) for p in ((t, 0 * t), (t, 0 * t + 1), (0 * t, t), (0 * t + 1, t))]
    x_interior, x_boundary = torch.rand(interior, 2, dtype=torch.float64), torch.cat(edges)
    layers: list = [nn.Linear(2, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(width, 1)).double()
    return Residuals(
        net,
        {
            "interior": Residual(
                lambda u, x: -laplacian(u, x) - 2 * math.pi**2 * exact(x), points=x_interior
            ),
            "boundary": Residual(lambda u, x: u(x), points=x_boundary),
        },
    )


CASES = {
    "readme_poisson_auto": (dict(interior=900, width=64, depth=1), {}, 30),
    "readme_poisson_cg": (dict(interior=900, width=64, depth=1), dict(solver="cg"), 30),
    "readme_poisson_cg_functional": (
        dict(interior=900, width=64, depth=1),
        dict(solver="cg", engine="functional"),
        30,
    ),
    "5x100_10000_points_auto": (dict(interior=10000, width=100, depth=5), {}, 8),
}


def main() -> None:
    torch.set_num_threads(1)
    out = {"commit": sys.argv[1], "torch": torch.__version__}
    for name, (shape, options, steps) in CASES.items():
        problem = poisson(**shape)
        opt = SGN(problem, Residuals.loss, **options)
        batch = problem.batch()
        start = time.process_time()
        opt.step(*batch)
        first = time.process_time() - start
        times = []
        for _ in range(steps):
            start = time.process_time()
            info = opt.step(*batch)
            times.append(time.process_time() - start)
        route = info.plan.route if info.plan is not None else None
        out[name] = dict(
            first=first, median=statistics.median(times), loss=info.loss_after, route=route
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
