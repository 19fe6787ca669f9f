"""This record's SGN column beside the recipes' (2026-11-28 record) and the last SGN rerun's
(2026-12-01 curves record): prints the README's table.

    python benchmarks/results/2026-12-02_cpu_deepxde_examples_300s_final/compare_table.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECIPES = HERE.parent / "2026-11-28_cpu_deepxde_examples_300s"
BEFORE = HERE.parent / "2026-12-01_cpu_deepxde_examples_300s_curves"
EXAMPLES = (
    "Poisson_Dirichlet_1d", "Poisson_Lshape", "Helmholtz_Dirichlet_2d", "diffusion_1d", "heat",
    "wave_1d", "Klein_Gordon", "Burgers", "Allen_Cahn", "diffusion_reaction", "Kovasznay_flow",
    "Beltrami_flow", "Euler_beam", "ode_system", "diffusion_1d_inverse", "reaction_inverse",
)  # fmt: skip


def read(folder: Path, example: str, method: str) -> dict | None:
    path = folder / f"{example}_{method}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    print("| example | recipe rel. L2 (2026-11-28) | SGN, 2026-12-01 (steps) | SGN here (steps) "
          "| recipe / SGN here | here / 2026-12-01 | commit at the run's end |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    below = hundred = 0
    for example in EXAMPLES:
        recipe, before, here = (
            read(RECIPES, example, "recipe"),
            read(BEFORE, example, "sgn"),
            read(HERE, example, "sgn"),
        )
        if here is None or here.get("rel_l2") is None:
            print(f"| {example} | | | (no run) | | | |")
            continue
        r, b, h = recipe["rel_l2"], before["rel_l2"], here["rel_l2"]
        below += h < r
        hundred += h * 100 <= r
        print(
            f"| {example} | {r:.2e} | {b:.2e} ({before['iterations']}) | {h:.2e} "
            f"({here['iterations']}) | {r / h:.3g} | {h / b:.2f} "
            f"| {here['environment']['commit']} |"
        )
    print(
        f"\nSGN below the recipe on {below} of {len(EXAMPLES)}, at least 100x below on {hundred}."
    )


if __name__ == "__main__":
    main()
