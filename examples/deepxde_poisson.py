"""A DeepXDE model trained by SGN in DeepXDE's own loop (``torch_sgn.deepxde``).

Command: python examples/deepxde_poisson.py [--iterations 100]

Needs DeepXDE (``pip install "torch-sgn[deepxde]"``); its PyTorch backend is chosen here.
DeepXDE's 2-D Poisson problem -u_xx - u_yy = 2 pi^2 sin(pi x) sin(pi y) on the unit square,
u = 0 on its boundary, a [2, 20, 20, 20, 1] tanh FNN in float64: the only change from a
DeepXDE script is the optimizer handed to ``model.compile``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("DDE_BACKEND", "pytorch")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="40 iterations (the tests' mode)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import deepxde as dde

    dtype = torch.get_default_dtype()
    try:
        _train(dde, args)
    finally:  # DeepXDE's float setting is torch's default dtype: leave it as it was
        dde.config.set_default_float(str(dtype).replace("torch.", ""))


def _train(dde, args) -> None:
    import torch_sgn.deepxde

    dde.config.set_default_float("float64")
    dde.config.set_random_seed(0)

    def pde(x, y):
        dy_xx = dde.grad.hessian(y, x, i=0, j=0)
        dy_yy = dde.grad.hessian(y, x, i=1, j=1)
        f = 2 * np.pi**2 * torch.sin(np.pi * x[:, 0:1]) * torch.sin(np.pi * x[:, 1:2])
        return -dy_xx - dy_yy - f

    def solution(x):
        return np.sin(np.pi * x[:, 0:1]) * np.sin(np.pi * x[:, 1:2])

    geom = dde.geometry.Rectangle([0, 0], [1, 1])
    bc = dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on_boundary: on_boundary)
    data = dde.data.PDE(
        geom, pde, bc, num_domain=400, num_boundary=80, solution=solution, num_test=1000
    )
    net = dde.nn.FNN([2] + [20] * 3 + [1], "tanh", "Glorot uniform")
    model = dde.Model(data, net)
    model.compile(torch_sgn.deepxde.SGN(model), metrics=["l2 relative error"])
    iterations = 40 if args.quick else args.iterations
    model.train(iterations=iterations, display_every=max(1, iterations // 5))
    x = geom.random_points(2000)
    error = dde.metrics.l2_relative_error(solution(x), model.predict(x))
    print(f"rel. L2 error {error:.2e} after {iterations} iterations")


if __name__ == "__main__":
    main()
