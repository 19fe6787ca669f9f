"""DeepXDE's Poisson_Lshape reference (``dataset/Poisson_Lshape.npz``: ``y_ref`` at 25,921
points ``X_test``, NaN outside the domain) against the solution of the example's problem,

    -u_xx - u_yy = 1 on the L-shape [-1, 1]^2 without its quadrant x > 0, y > 0,  u = 0 on its
    boundary,

by finite differences (the five-point Laplacian on the square grid of spacing h, the L-shape's
nodes, a sparse direct solve) for h = 1/200 and 1/400, interpolated bilinearly to the
reference's points (their difference says how accurate the solution is). Then, with
``--budget``, the example trained by ``torch_sgn.deepxde.SGN`` as ``deepxde_examples.py`` trains
it, its error against both: the reference file's and the finite-difference solution's (h =
1/400). Writes ``poisson_lshape_reference[_{budget}s].json`` here.

    cd benchmarks/results/2026-12-01_cpu_deepxde_examples_300s_curves
    python poisson_lshape_reference.py DEEPXDE/examples [--budget 1000] [--method M] [--out DIR]
"""

import json
from pathlib import Path

import numpy as np
import reference_runs
import scipy.sparse as sp
import scipy.sparse.linalg as spl
from scipy.interpolate import RegularGridInterpolator


def solve(m: int) -> RegularGridInterpolator:
    """u on the grid of spacing 1/m, as a bilinear interpolant."""
    g = np.linspace(-1, 1, 2 * m + 1)
    h = g[1] - g[0]
    xx, yy = np.meshgrid(g, g, indexing="ij")
    inside = ~((xx >= 0) & (yy >= 0))
    interior = inside & (np.abs(xx) < 1) & (np.abs(yy) < 1)
    index = -np.ones(xx.shape, int)
    index[interior] = np.arange(interior.sum())
    n = int(interior.sum())
    i, j = np.nonzero(interior)
    rows, cols, vals = [index[i, j]], [index[i, j]], [np.full(n, 4.0)]
    for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        nb = index[i + di, j + dj]
        ok = nb >= 0  # (a neighbour on the boundary is 0)
        rows.append(index[i, j][ok])
        cols.append(nb[ok])
        vals.append(np.full(int(ok.sum()), -1.0))
    a = sp.csc_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))))
    u = np.zeros(xx.shape)
    u[interior] = spl.spsolve(a / h**2, np.ones(n))
    return RegularGridInterpolator((g, g), u)


def main() -> None:
    args = reference_runs.arguments()
    ref = np.load(Path(args.examples) / "dataset" / "Poisson_Lshape.npz")
    known = np.isfinite(ref["y_ref"]).ravel()
    x, y_ref = ref["X_test"][known], ref["y_ref"][known].ravel()
    fine = {m: solve(m)(x) for m in (200, 400)}
    accurate = fine[400]
    rel = reference_runs.rel
    out = {
        "fd_200_vs_400": rel(fine[200], accurate),
        "reference_vs_fd": rel(y_ref, accurate),
        "reference_max": float(y_ref.max()),
        "fd_max": float(accurate.max()),
        "reference_scale_vs_fd": float(y_ref @ accurate / (accurate @ accurate)),
    }
    print(json.dumps(out))
    if args.budget is not None:

        def against_fd(model):
            return {"rel_l2_vs_fd": rel(np.asarray(model.predict(x)).ravel(), accurate)}

        out.update(reference_runs.train("Poisson_Lshape", args, against_fd))
    reference_runs.write(out, "poisson_lshape_reference", args)


if __name__ == "__main__":
    main()
