"""DeepXDE's Allen_Cahn reference (``dataset/Allen_Cahn.mat``: u on a 201 x 101 grid of
x in [-1, 1], t in [0, 1]) against an accurate solution of the example's PDE,

    u_t = d u_xx + 5 (u - u^3),  d = 0.001,  u(x, 0) = x^2 cos(pi x),  u(-1, t) = u(1, t) = -1,

by the method of lines: fourth-order central differences on n nodes (second order next to the
ends), Radau IIA (scipy's ``solve_ivp``, rtol 1e-10, atol 1e-12), for n = 2,001 and 4,001 (their
difference says how accurate the solution is). Then, with ``--budget``, the example trained
by ``torch_sgn.deepxde.SGN`` as ``deepxde_examples.py`` trains it (the same run, the same
budget) and its error measured against both: the reference file's and the accurate solution's;
written to ``allen_cahn_reference_{budget}s.json`` here.

    cd benchmarks/results/2026-12-01_cpu_deepxde_examples_300s_curves
    python allen_cahn_reference.py DEEPXDE/examples [--budget 300] [--method sgn_rad] [--out DIR]
"""

import json
from pathlib import Path

import numpy as np
import reference_runs
from scipy.integrate import solve_ivp
from scipy.io import loadmat
from scipy.sparse import diags

D = 0.001


def solve(n: int, times: np.ndarray) -> np.ndarray:
    """u at ``times`` (rows) on n equally spaced nodes of [-1, 1] (columns)."""
    x = np.linspace(-1, 1, n)
    h = x[1] - x[0]
    m = n - 2  # the interior nodes; the ends are -1

    def rhs(t, v):
        u = np.concatenate([[-1.0], v, [-1.0]])
        uxx = (u[2:] - 2 * u[1:-1] + u[:-2]) / h**2
        uxx[1:-1] = (-u[4:] + 16 * u[3:-1] - 30 * u[2:-2] + 16 * u[1:-3] - u[:-4]) / (12 * h**2)
        return D * uxx + 5 * (v - v**3)

    lap = diags([np.ones(m - 1), -2 * np.ones(m), np.ones(m - 1)], [-1, 0, 1]) * (D / h**2)
    u0 = (x**2 * np.cos(np.pi * x))[1:-1]
    sol = solve_ivp(
        rhs, (times[0], times[-1]), u0, method="Radau", t_eval=times, rtol=1e-10, atol=1e-12,
        jac=lambda t, v: lap + diags(5 - 15 * v**2),
    )  # fmt: skip
    out = np.full((len(times), n), -1.0)
    out[:, 1:-1] = sol.y.T
    return out


def main() -> None:
    args = reference_runs.arguments()
    ref = loadmat(Path(args.examples) / "dataset" / "Allen_Cahn.mat")
    x, t, u_ref = ref["x"].ravel(), ref["t"].ravel(), ref["u"]  # u: (t, x)
    fine = {n: solve(n, t)[:, :: (n - 1) // (len(x) - 1)] for n in (2001, 4001)}
    accurate = fine[4001]
    rel = reference_runs.rel
    out = {
        "accurate_2001_vs_4001": rel(fine[2001], accurate),
        "reference_vs_accurate": rel(u_ref, accurate),
    }
    print(json.dumps(out))
    if args.budget is None:
        return
    xx, tt = np.meshgrid(x, t)
    grid = np.vstack((np.ravel(xx), np.ravel(tt))).T

    def against_accurate(model):
        pred = model.predict(grid).reshape(u_ref.shape)
        return {"rel_l2_vs_accurate": rel(pred, accurate)}

    out.update(reference_runs.train("Allen_Cahn", args, against_accurate))
    reference_runs.write(out, "allen_cahn_reference", args)


if __name__ == "__main__":
    main()
