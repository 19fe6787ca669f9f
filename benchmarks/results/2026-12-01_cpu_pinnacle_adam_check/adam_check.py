"""Whether PINNacle's Adam (``benchmark.py``'s default method: ``torch.optim.Adam(lr=1e-3)``)
and its Adam then L-BFGS (``Adam_LBFGS``, switch at iteration 5,000) take the same iterations
before the switch: each PDE's model is built twice as ``benchmarks/pinns/pinnacle.py`` builds it
(float64, seed 0), trained ``ITERATIONS`` DeepXDE iterations by each method, and the networks'
parameters compared bit for bit.

    PYTHONPATH=src python benchmarks/results/2026-12-01_cpu_pinnacle_adam_check/adam_check.py \
        --pinnacle PINNACLE Burgers1D Poisson2D_Classic PoissonBoltzmann2D > adam_check.log
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

os.environ.setdefault("DDE_BACKEND", "pytorch")
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks" / "pinns"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import pinnacle  # noqa: E402

ITERATIONS = 50


def trained(pde_name: str, method: str, dde) -> tuple:
    dde.config.set_random_seed(0)
    module, cls = pinnacle.PDES[pde_name]
    pde = getattr(importlib.import_module(f"src.pde.{module}"), cls)()
    net = dde.nn.FNN([pde.input_dim] + [100] * 5 + [pde.output_dim], "tanh", "Glorot normal")
    model = pde.create_model(net)
    if method == "adam_lbfgs":
        from src.optimizer import Adam_LBFGS

        opt = Adam_LBFGS(net.parameters(), switch_epoch=pinnacle.SWITCH, adam_param={"lr": 1e-3})
    else:
        opt = torch.optim.Adam(net.parameters(), 1e-3)
    model.compile(opt, loss_weights=np.ones(pde.num_loss))
    start = [p.detach().clone() for p in net.parameters()]
    model.train(iterations=ITERATIONS, display_every=10**9, verbose=0)
    return start, [p.detach().clone() for p in net.parameters()], model.losshistory.loss_train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pinnacle", required=True)
    parser.add_argument("pdes", nargs="+", choices=list(pinnacle.PDES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(args.pinnacle).resolve()
    sys.path.append(str(root))
    import deepxde as dde

    pinnacle.patch_test(dde)
    dde.config.set_default_float("float64")
    os.chdir(root)
    print(f"torch {torch.__version__}, DeepXDE {dde.__version__}, {ITERATIONS} iterations each")
    for name in args.pdes:
        start_a, end_a, _ = trained(name, "adam", dde)
        start_b, end_b, _ = trained(name, "adam_lbfgs", dde)
        same_start = all(torch.equal(a, b) for a, b in zip(start_a, start_b))
        same_end = all(torch.equal(a, b) for a, b in zip(end_a, end_b))
        moved = max(float((a - s).abs().max()) for a, s in zip(end_a, start_a))
        print(
            f"{name}: same start {same_start}, same parameters after {ITERATIONS} iterations "
            f"{same_end} (largest change from the start {moved:.3g})",
            flush=True,
        )


if __name__ == "__main__":
    main()
