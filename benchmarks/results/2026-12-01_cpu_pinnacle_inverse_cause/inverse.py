"""What SGN's steps do on PINNacle's PoissonInv and HeatInv: each loss term, the unknown
coefficient's values against the reference, the state's error by output, the step's gradient
norm and damping, at about 5, 10, 20, 40, ... CPU s of training.

    PYTHONPATH=src python benchmarks/results/2026-12-01_cpu_pinnacle_inverse_cause/inverse.py \
        --pinnacle PINNACLE PoissonInv 150 > poissoninv_sgn.log

The model is built as ``benchmarks/pinns/pinnacle.py`` builds it (float64, seed 0, FNN 5 x 100
tanh, Glorot normal, PINNacle's points and loss terms, weights 1); ``--weights W W W`` sets
DeepXDE's ``loss_weights`` instead (a diagnostic, not a setting any run of the benchmark uses).
At the start it also prints the loss terms at the reference solution (the PDE term of the exact
solution is zero by construction; the data term is the noise's mean square) and each block's
share of the Gauss-Newton matrix's trace, ``trace(J_b^T J_b)`` (from 32 of its points).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pinnacle", required=True)
    parser.add_argument("pde", choices=["PoissonInv", "HeatInv"])
    parser.add_argument("seconds", type=float)
    parser.add_argument("--weights", type=float, nargs=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(args.pinnacle).resolve()
    sys.path.append(str(root))
    import deepxde as dde

    import torch_sgn.deepxde

    pinnacle.patch_test(dde)
    dde.config.set_default_float("float64")
    dde.config.set_random_seed(0)
    os.chdir(root)
    module, cls = pinnacle.PDES[args.pde]
    import importlib

    pde = getattr(importlib.import_module(f"src.pde.{module}"), cls)()
    net = dde.nn.FNN([pde.input_dim] + [100] * 5 + [pde.output_dim], "tanh", "Glorot normal")
    model = pde.create_model(net)
    opt = torch_sgn.deepxde.SGN(model)
    weights = args.weights or [1.0, 1.0, 1.0]
    model.compile(opt, loss_weights=np.array(weights))
    x_ref, y_ref = pinnacle.reference(pde, model)
    names = [c["name"] for c in pde.loss_config]
    print(f"{args.pde}: loss terms {names}, weights {weights}, rows {len(model.data.train_x)}")

    data_bc = next(bc for bc in model.data.bcs if type(bc).__name__ == "PointSetBC")
    noise = np.asarray(data_bc.values.detach().cpu()).reshape(-1) - pde.u_ref(
        np.asarray(data_bc.points)
    ).reshape(-1)
    print(f"at the reference: pde 0 (exact), data_loss {np.mean(noise**2):.4g} (the noise), bc_a 0")

    residuals = opt.problem.residuals
    inputs, _ = residuals.batch()
    fmodel_params = [p for p in residuals.parameters()]
    traces = {}
    for block, (name, points) in zip(residuals.blocks, residuals.split(inputs).items()):
        # trace(J_b^T J_b) = w_b * mean over the block's points of |d r_i / d theta|^2, the
        # mean taken on 32 of them (r_i a point's unweighted residual)
        idx = torch.randperm(points[0].shape[0], generator=torch.Generator().manual_seed(0))[:32]
        r = residuals.residual(name, *[p[idx] for p in points]).reshape(len(idx), -1)
        total = 0.0
        for i in range(len(idx)):
            for ri in r[i]:
                g = torch.autograd.grad(ri, fmodel_params, retain_graph=True, allow_unused=True)
                total += sum(float((t * t).sum()) for t in g if t is not None)
        traces[name] = block.weight * total / len(idx)
    print("trace(J_b^T J_b) by block: " + ", ".join(f"{k} {v:.3g}" for k, v in traces.items()))

    def report(used: float, steps: int) -> None:
        pred = np.asarray(model.predict(x_ref))
        terms = residuals.losses(residuals.batch()[0])
        u, a = pred[:, 0], pred[:, 1]
        u_ref, a_ref = y_ref[:, 0], y_ref[:, 1]
        err = lambda p, r: float(np.linalg.norm(p - r) / np.linalg.norm(r))  # noqa: E731
        info = opt.last_info
        line = (
            f"{used:7.1f} s {steps:4d} steps | "
            + " ".join(f"{k} {v:.3g}" for k, v in terms.items())
            + f" | L2RE u {err(u, u_ref):.3g} a {err(a, a_ref):.3g}"
            + f" | a in [{a.min():.3g}, {a.max():.3g}] (ref [{a_ref.min():.3g}, {a_ref.max():.3g}])"
            + f" max|u| {np.abs(u).max():.3g} (ref {np.abs(u_ref).max():.3g})"
        )
        if info is not None:
            line += f" | grad {info.grad_norm:.3g} damping {info.damping:.3g} {info.solver}"
        print(line, flush=True)

    marks = [5.0 * 2**k for k in range(20)]
    clock = {"used": 0.0, "since": 0.0, "steps": 0}

    class Budget(dde.callbacks.Callback):
        def on_train_begin(self):
            report(0.0, 0)
            clock["since"] = time.process_time()

        def on_epoch_end(self):
            clock["used"] += time.process_time() - clock["since"]
            clock["steps"] += 1
            if clock["used"] >= args.seconds:
                self.model.stop_training = True
            elif clock["used"] >= marks[0]:
                marks.pop(0)
                report(clock["used"], clock["steps"])
            clock["since"] = time.process_time()

    model.train(iterations=10**9, display_every=10**9, callbacks=[Budget()], verbose=0)
    report(clock["used"], clock["steps"])


if __name__ == "__main__":
    main()
