"""DeepXDE's Klein_Gordon example (as written, float64, seed 0) trained by torch_sgn.deepxde.SGN,
with and without causal weighting of the PDE along time.

Prints each block's trace of ``J_b^T J_b`` at the start, then at 10, 20, 40, ... CPU seconds and
at the end: each block's mean squared residual, the relative L2 error over the domain and in
five time slabs of width 2, the last step's gradient norm and damping, and with causal weighting
its epsilon and the smallest slab weight. ``CAUSAL=eps`` (or ``CAUSAL=e1,e2,...``, a schedule)
trains with ``SGN(model, causal=Causal(epsilon=eps, slabs=SLABS))`` (``SLABS``: 32 by default).

    PYTHONPATH=src python benchmarks/results/2026-12-01_cpu_klein_gordon_causal/klein_gordon.py 300
    CAUSAL=1 PYTHONPATH=src python benchmarks/results/2026-12-01_cpu_klein_gordon_causal/\
klein_gordon.py 300
"""

import os
import sys
import time

os.environ["DDE_BACKEND"] = "pytorch"

import deepxde as dde  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_sgn.deepxde  # noqa: E402
from torch_sgn.batch import Batch  # noqa: E402
from torch_sgn.engines.jacobian import jacobian_rows  # noqa: E402
from torch_sgn.model.flat_model import FunctionalModel  # noqa: E402
from torch_sgn.pinn import Causal  # noqa: E402


def causal_setting():
    """``CAUSAL``'s setting, or ``False``."""
    text = os.environ.get("CAUSAL")
    if not text:
        return False
    values = tuple(float(v) for v in text.split(","))
    epsilon = values[0] if len(values) == 1 else values
    return Causal(epsilon=epsilon, slabs=int(os.environ.get("SLABS", "32")))


def block_traces(res, m=200, seed=0):
    """trace(J_b^T J_b) of each block's weighted rows, estimated from ``m`` points a block."""
    inputs, targets = res.batch()
    counts = res.points(inputs)
    gen = torch.Generator().manual_seed(seed)
    index = [torch.randperm(c, generator=gen)[:m].sort().values for c in counts]
    sub = res.subset(inputs, index)
    fm = FunctionalModel(res)
    _, jac = jacobian_rows(fm, fm.flat(), Batch(sub, targets.new_zeros(res.count(sub))))
    traces, start = {}, 0
    for b, (name, count) in enumerate(zip(res.names, counts)):
        alone = res.subset(inputs, [i if k == b else i[:0] for k, i in enumerate(index)])
        rows = res.count(alone)
        block = jac[start : start + rows]
        start += rows
        traces[name] = float(block.square().sum()) * count / max(1, index[b].numel())
    return traces


def main(budget: float) -> None:
    torch.set_num_threads(1)
    dde.config.set_default_float("float64")
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

    bc = dde.icbc.DirichletBC(geomtime, func, lambda _, on_boundary: on_boundary)
    ic_1 = dde.icbc.IC(geomtime, func, lambda _, on_initial: on_initial)
    ic_2 = dde.icbc.OperatorBC(
        geomtime,
        lambda x, y, _: dde.grad.jacobian(y, x, i=0, j=1),
        lambda _, on_initial: on_initial,
    )
    data = dde.data.TimePDE(
        geomtime, pde, [bc, ic_1, ic_2], num_domain=30000, num_boundary=1500,
        num_initial=1500, solution=func, num_test=6000,
    )  # fmt: skip
    net = dde.nn.FNN([2] + [40] * 2 + [1], "tanh", "Glorot uniform")
    model = dde.Model(data, net)
    causal = causal_setting()
    print("causal", causal, flush=True)
    model.compile(torch_sgn.deepxde.SGN(model, causal=causal))
    traces = block_traces(model.opt.problem.residuals)
    print("traces at start", {k: f"{v:.3e}" for k, v in traces.items()}, flush=True)
    if os.environ.get("NTK"):
        total = sum(traces.values())
        weights = [total / traces[k] for k in model.opt.problem.residuals.names]
        weights = [w / weights[0] for w in weights]
        print("loss_weights", weights, flush=True)
        model.compile(torch_sgn.deepxde.SGN(model, causal=causal), loss_weights=weights)
    x, t = np.meshgrid(np.linspace(-1, 1, 101), np.linspace(0, 10, 201))
    grid = np.stack([x, t], -1).reshape(-1, 2)
    ref = func(grid)
    slabs = [(grid[:, 1] >= a) & (grid[:, 1] < a + 2) for a in range(0, 10, 2)]

    class Report(dde.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.start, self.next = time.process_time(), 10.0

        def on_epoch_end(self):
            cpu = time.process_time() - self.start
            if cpu < self.next and cpu < budget:
                return
            self.next *= 2
            opt = model.opt
            u = model.predict(grid)
            err = np.linalg.norm(u - ref) / np.linalg.norm(ref)
            by_slab = [np.linalg.norm((u - ref)[s]) / np.linalg.norm(ref[s]) for s in slabs]
            losses = " ".join(f"{k} {v:.2e}" for k, v in opt.problem.residuals.losses().items())
            info = opt.last_info
            weights = opt.problem.residuals.causal_weights().get("pde")
            if weights is not None:
                smallest = float(weights.slabs.min())
                losses += f" epsilon {weights.epsilon:g} min_weight {smallest:.2e}"
            print(
                f"cpu {cpu:7.1f} it {model.train_state.step} loss {losses} relL2 {err:.3e} "
                f"by t-slab {np.array2string(np.array(by_slab), precision=2)} "
                f"grad_norm {info.grad_norm:.2e} damping {info.damping:.2e}",
                flush=True,
            )
            if cpu >= budget:
                self.model.stop_training = True

    model.train(iterations=10**7, callbacks=[Report()], display_every=10**9, verbose=0)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 120.0)
