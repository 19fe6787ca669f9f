"""A DeepXDE model's steps by ``torch_sgn.deepxde.SGN``, saved for a comparison to the bit.

    DDE_BACKEND=pytorch PYTHONPATH=<checkout>/src python deepxde_steps_bits.py OUT.pt
    python deepxde_steps_bits.py compare BEFORE.pt AFTER.pt

DeepXDE's Poisson problem on [-1, 1] (-u'' = pi^2 sin(pi x), u(+-1) = 0; FNN 1 x 20 x 20 x 1,
tanh, Glorot normal; 64 domain and 2 boundary points; float64; seed 0) and Burgers' (its
example's geometry and conditions, FNN 2 x 20 x 20 x 20 x 1, 500 domain, 80 boundary, 160
initial points), 20 steps each by the adapter's defaults in DeepXDE's ``train``; the
parameters after every step.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DDE_BACKEND", "pytorch")
import numpy as np  # noqa: E402
import torch  # noqa: E402


def models():
    import deepxde as dde

    dde.config.set_default_float("float64")

    def poisson():
        def pde(x, y):
            return -dde.grad.hessian(y, x) - np.pi**2 * torch.sin(np.pi * x)

        geom = dde.geometry.Interval(-1, 1)
        bc = dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on)
        data = dde.data.PDE(geom, pde, bc, 64, 2)
        return dde.Model(data, dde.nn.FNN([1, 20, 20, 1], "tanh", "Glorot normal"))

    def burgers():
        def pde(x, y):
            dy_x = dde.grad.jacobian(y, x, i=0, j=0)
            dy_t = dde.grad.jacobian(y, x, i=0, j=1)
            dy_xx = dde.grad.hessian(y, x, i=0, j=0)
            return dy_t + y * dy_x - 0.01 / np.pi * dy_xx

        geom = dde.geometry.GeometryXTime(
            dde.geometry.Interval(-1, 1), dde.geometry.TimeDomain(0, 0.99)
        )
        bc = dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on)
        ic = dde.icbc.IC(geom, lambda x: -np.sin(np.pi * x[:, 0:1]), lambda _, on: on)
        data = dde.data.TimePDE(geom, pde, [bc, ic], 500, 80, num_initial=160)
        return dde.Model(data, dde.nn.FNN([2, 20, 20, 20, 1], "tanh", "Glorot normal"))

    return {"poisson": poisson, "burgers": burgers}


def record(out: str) -> None:
    import deepxde as dde

    from torch_sgn.deepxde import SGN

    torch.set_num_threads(1)
    saved = {}
    for name, build in models().items():
        dde.config.set_random_seed(0)
        model = build()
        model.compile(SGN(model))
        params = []

        class Keep(dde.callbacks.Callback):
            def __init__(self, net, kept):
                super().__init__()
                self.net, self.kept = net, kept

            def on_batch_end(self):
                flat = [p.detach().reshape(-1) for p in self.net.parameters()]
                self.kept.append(torch.cat(flat).clone())

        keep = Keep(model.net, params)
        model.train(iterations=20, display_every=1000, callbacks=[keep], verbose=0)
        saved[name] = torch.stack(params)
        print(name, "parameters' norm after 20 steps:", float(params[-1].norm()))
    torch.save(saved, out)


def compare(before: str, after: str) -> None:
    a, b = torch.load(before), torch.load(after)
    for key in a:
        same = [torch.equal(p, q) for p, q in zip(a[key], b[key])]
        first = same.index(False) if False in same else None
        print(
            f"{key}: {len(same)} steps,",
            "identical" if first is None else f"differs from step {first}",
        )


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        record(sys.argv[1])
