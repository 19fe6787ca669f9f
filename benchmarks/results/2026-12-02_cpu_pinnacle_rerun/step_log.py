"""Per-step record of SGN on one PINNacle PDE: each step's CPU seconds, its plan (the rows it
used: the batch's, a sample, all; the route), the sample's points, attempts, CG iterations,
loss, and the L2RE every ``--every`` steps.

    R=benchmarks/results/2026-12-02_cpu_pinnacle_rerun
    python $R/step_log.py --pinnacle PINNACLE --pde PoissonBoltzmann2D --seconds 700 --out $R

The JSON names the library's commit (``commit``); ``--tag`` is appended to its name.
"""

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DDE_BACKEND", "pytorch")
HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "pinns"))

import numpy as np  # noqa: E402
import pinnacle as bench  # noqa: E402
import sgn_methods  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pinnacle", required=True)
    p.add_argument("--pde", required=True)
    p.add_argument("--method", default="sgn")
    p.add_argument("--seconds", type=float, default=400)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="", help="appended to the output's name")
    args = p.parse_args()
    root = Path(args.pinnacle).resolve()
    sys.path.append(str(root))
    import deepxde as dde
    import torch

    torch.set_num_threads(1)
    bench.patch_test(dde)
    dde.config.set_default_float("float64")
    dde.config.set_random_seed(0)
    module, cls = bench.PDES[args.pde]
    cwd = os.getcwd()
    os.chdir(root)
    pde = getattr(importlib.import_module(f"src.pde.{module}"), cls)()
    net = dde.nn.FNN([pde.input_dim] + [100] * 5 + [pde.output_dim], "tanh", "Glorot normal")
    model = pde.create_model(net)
    opt = sgn_methods.optimizer(model, args.method)
    model.compile(opt, loss_weights=np.ones(pde.num_loss))
    x_ref, y_ref = bench.reference(pde, model)
    os.chdir(cwd)
    rows = []
    clock = {"used": 0.0, "since": 0.0, "step": 0}

    class Log(dde.callbacks.Callback):
        def on_train_begin(self):
            clock["since"] = time.process_time()

        def on_epoch_end(self):
            dt = time.process_time() - clock["since"]
            clock["used"] += dt
            clock["step"] += 1
            info = opt.last_info
            plan = info.plan
            row = {
                "step": clock["step"],
                "cpu_s": round(dt, 3),
                "used_s": round(clock["used"], 1),
                "rows": None if plan is None else plan.rows,
                "jacobian": None if plan is None else plan.jacobian,
                "route": None if plan is None or plan.phase is None else plan.route,
                "solver": info.solver,
                "sample": None if info.sample is None else [int(s) for s in info.sample],
                "attempts": info.attempts,
                "iterations": info.iterations,
                "loss": info.loss,
                "damping": info.damping,
                "step_size": info.step_size,
            }
            if clock["step"] % args.every == 0:
                row["l2re"] = bench.l2re(model, x_ref, y_ref, np.float64)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if clock["used"] >= args.seconds:
                self.model.stop_training = True
            clock["since"] = time.process_time()

    model.train(
        iterations=10**9,
        display_every=10**9,
        callbacks=sgn_methods.callbacks(args.method) + [Log()],
        verbose=0,
    )
    out = Path(args.out) / f"step_log_{args.pde}_{args.method}{args.tag}.json"
    import subprocess

    import torch_sgn

    lib = Path(torch_sgn.__file__).resolve().parents[2]
    commit = subprocess.run(
        ["git", "-C", str(lib), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out.write_text(
        json.dumps(
            {
                "pde": args.pde,
                "method": args.method,
                "seconds": args.seconds,
                "commit": commit,
                "steps": rows,
            },
            indent=0,
        )
    )


if __name__ == "__main__":
    main()
