"""L2RE against CPU seconds, one panel per PDE, one line per method, from this folder's records,
and the PDE's published best (PINNacle's main table, a GPU run of 20,000 iterations) dashed.

python benchmarks/results/2026-11-29_cpu_pinnacle/plot.py Poisson2D_Classic Burgers1D
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "pinns"))
from pinnacle import PUBLISHED  # noqa: E402  (the paper's best figure of each PDE)

LABELS = {"sgn": "SGN (torch_sgn.deepxde.SGN)", "adam_lbfgs": "PINNacle's Adam then L-BFGS",
          "adam": "Adam (lr 1e-3)"}  # fmt: skip


def main(pdes):
    fig, axes = plt.subplots(1, len(pdes), figsize=(5 * len(pdes), 3.6), squeeze=False)
    for ax, pde in zip(axes[0], pdes):
        for method, label in LABELS.items():
            path = HERE / f"{pde}_{method}_float64_seed0.json"
            if not path.is_file():
                continue
            curve = json.loads(path.read_text())["curve"]
            ax.loglog([max(c[0], 1.0) for c in curve], [c[2] for c in curve], label=label)
        best = PUBLISHED.get(pde)
        if best is not None:
            ax.axhline(best[0], color="gray", ls="--", lw=1, label=f"published best ({best[1]})")
        ax.set_title(f"{pde} (float64, seed 0)")
        ax.set_xlabel("CPU seconds (one thread)")
        ax.set_ylabel("L2RE")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = HERE / "l2re_cpu_seconds.png"
    fig.savefig(out, dpi=120)
    print(out.name)


if __name__ == "__main__":
    main(sys.argv[1:])
