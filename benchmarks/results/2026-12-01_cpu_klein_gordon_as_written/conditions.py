"""Where the conditions of DeepXDE's Klein_Gordon example hold, as DeepXDE 1.15 samples them
(the example's geometry, conditions and point counts, seed 0), and each condition's mean
squared residual at the exact solution ``u = x cos t``.

    python benchmarks/results/2026-12-01_cpu_klein_gordon_as_written/conditions.py > conditions.txt
"""

import os

os.environ.setdefault("DDE_BACKEND", "pytorch")

import deepxde as dde  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    dde.config.set_random_seed(0)
    geomtime = dde.geometry.GeometryXTime(
        dde.geometry.Interval(-1, 1), dde.geometry.TimeDomain(0, 10)
    )

    def func(x):
        return x[:, 0:1] * np.cos(x[:, 1:2])

    bc = dde.icbc.DirichletBC(geomtime, func, lambda _, on_boundary: on_boundary)
    ic_1 = dde.icbc.IC(geomtime, func, lambda _, on_initial: on_initial)
    ic_2 = dde.icbc.OperatorBC(  # as the example writes it
        geomtime,
        lambda x, y, _: dde.grad.jacobian(y, x, i=0, j=1),
        lambda _, on_initial: on_initial,
    )
    data = dde.data.TimePDE(
        geomtime, lambda x, y: y, [bc, ic_1, ic_2], num_domain=30000, num_boundary=1500,
        num_initial=1500, solution=func, num_test=6000,
    )  # fmt: skip
    x_all = data.train_x_all
    u_t = lambda p: -p[:, 0] * np.sin(p[:, 1])  # noqa: E731 - the exact solution's u_t
    for name, cond in (
        ("DirichletBC u = x cos t", bc),
        ("IC u = x", ic_1),
        ("OperatorBC u_t = 0", ic_2),
    ):
        p = cond.collocation_points(x_all)
        on_edge = np.mean(np.isclose(np.abs(p[:, 0]), 1))
        print(
            f"{name}: {len(p)} points, x in [{p[:, 0].min():.3g}, {p[:, 0].max():.3g}], "
            f"t in [{p[:, 1].min():.3g}, {p[:, 1].max():.3g}], share on x = +-1: {on_edge:.3g}"
        )
    p = ic_2.collocation_points(x_all)
    print(
        "the exact solution's OperatorBC mean squared residual (u_t asked to be 0): "
        f"{np.mean(u_t(p) ** 2):.4g}"
    )


if __name__ == "__main__":
    main()
