"""DeepXDE's Burgers reference (``dataset/Burgers.npz``: ``usol`` on 256 x 100 points of
x in [-1, 1], t in [0, 0.99]) against the exact solution by the Cole-Hopf transform, computed
as PINNacle's Burgers1D record computes it (its ``burgers_reference.exact``: the same equation,
nu = 0.01 / pi, u(x, 0) = -sin(pi x)).

    cd benchmarks/results/2026-12-01_cpu_deepxde_examples_300s_curves
    python burgers_reference.py DEEPXDE/examples
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-29_cpu_pinnacle"))
from burgers_reference import exact  # noqa: E402


def main() -> None:
    data = np.load(Path(sys.argv[1]) / "dataset" / "Burgers.npz")
    t, x, u = data["t"].ravel(), data["x"].ravel(), data["usol"]  # usol: (x, t)
    e = np.stack([exact(x, float(ti)) for ti in t], axis=1)
    out = {
        "reference_vs_exact_rel_l2": float(np.linalg.norm(u - e) / np.linalg.norm(e)),
        "reference_vs_exact_max_abs": float(np.abs(u - e).max()),
    }
    print(json.dumps(out))
    (Path(__file__).resolve().parent / "burgers_reference.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
