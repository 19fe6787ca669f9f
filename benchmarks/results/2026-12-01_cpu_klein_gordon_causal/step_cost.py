"""CPU seconds of each of the first eight steps on DeepXDE's Klein_Gordon example (as
``klein_gordon.py`` builds it), SGN with causal weighting off and with ``Causal(epsilon=1.0)``,
with each step's route.

    OMP_NUM_THREADS=1 PYTHONPATH=src python \\
        benchmarks/results/2026-12-01_cpu_klein_gordon_causal/step_cost.py > step_cost.log
"""

import os
import time

os.environ["DDE_BACKEND"] = "pytorch"

import deepxde as dde  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_sgn.deepxde  # noqa: E402
from torch_sgn.pinn import Causal  # noqa: E402


def model_of_the_example():
    dde.config.set_random_seed(0)
    geomtime = dde.geometry.GeometryXTime(
        dde.geometry.Interval(-1, 1), dde.geometry.TimeDomain(0, 10)
    )

    def pde(x, y):
        dy_tt = dde.grad.hessian(y, x, i=1, j=1)
        dy_xx = dde.grad.hessian(y, x, i=0, j=0)
        x, t = x[:, 0:1], x[:, 1:2]
        return dy_tt - dy_xx + y**2 + x * torch.cos(t) - (x**2) * (torch.cos(t) ** 2)

    def func(x):
        return x[:, 0:1] * np.cos(x[:, 1:2])

    bc = dde.icbc.DirichletBC(geomtime, func, lambda _, on: on)
    ic_1 = dde.icbc.IC(geomtime, func, lambda _, on: on)
    ic_2 = dde.icbc.OperatorBC(
        geomtime, lambda x, y, _: dde.grad.jacobian(y, x, i=0, j=1), lambda _, on: on
    )
    data = dde.data.TimePDE(
        geomtime, pde, [bc, ic_1, ic_2], num_domain=30000, num_boundary=1500,
        num_initial=1500, solution=func, num_test=6000,
    )  # fmt: skip
    return dde.Model(data, dde.nn.FNN([2] + [40] * 2 + [1], "tanh", "Glorot uniform"))


class StepCost(dde.callbacks.Callback):
    def __init__(self, opt):
        super().__init__()
        self.opt = opt

    def on_epoch_begin(self):
        self.start = time.process_time()

    def on_epoch_end(self):
        i = self.opt.last_info
        print(
            f"{time.process_time() - self.start:.2f}s loss {i.loss:.3e} after "
            f"{i.loss_after:.3e} rows {i.plan.rows} jac {i.plan.jacobian} route {i.plan.route} "
            f"solver {i.solver} follow {self.opt.problem.residuals.factors_follow}",
            flush=True,
        )


def main() -> None:
    torch.set_num_threads(1)
    dde.config.set_default_float("float64")
    for causal in (False, Causal(epsilon=1.0)):
        model = model_of_the_example()
        opt = torch_sgn.deepxde.SGN(model, causal=causal)
        model.compile(opt)
        model.train(iterations=8, callbacks=[StepCost(opt)], display_every=10**9, verbose=0)
        print(flush=True)


if __name__ == "__main__":
    main()
