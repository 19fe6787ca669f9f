"""SGN on a DeepXDE model (torch_sgn.deepxde) against the same problem written with
torch_sgn.pinn, and against DeepXDE's own recipes, on one CPU thread, float64.

The problem: DeepXDE's form of the 2-D Poisson equation -u_xx - u_yy = 2 pi^2 sin(pi x) sin(pi y)
on the unit square, u = 0 on its boundary (exact solution sin(pi x) sin(pi y)), with the network
and points of DeepXDE's Poisson examples: FNN [2] + [50] * 4 + [1], tanh, Glorot uniform;
1,200 domain and 120 boundary points ("Hammersley").

* ``--task cost``: CPU seconds of one SGN step through ``torch_sgn.deepxde.SGN`` (its ``step``,
  points and jets included) and through ``torch_sgn.pinn.Residuals`` written by hand over the
  same network, points and initial parameters; interleaved, ``--repeats`` times ``--steps``
  steps each; the median per-step time of each and their ratio.
* ``--task train``: each method in a process of its own for ``--budget`` CPU seconds in
  DeepXDE's ``model.train``: ``sgn`` (``torch_sgn.deepxde.SGN``, defaults), ``adam`` (lr 1e-3),
  ``adam+lbfgs`` (DeepXDE's examples' recipe: Adam lr 1e-3 for ``--adam-iterations``, then
  DeepXDE's L-BFGS; ``adam<N>+lbfgs`` for ``N`` Adam iterations), ``lbfgs``, ``lbfgs+nncg``
  (DeepXDE's L-BFGS for half the budget, then its NNCG with its default options). The
  budget is checked after each of DeepXDE's iterations: one that overruns it (an NNCG
  iteration) counts whole. The relative L2 error on 2,000 random points is recorded along the
  way (its evaluation is not counted). One JSON per method and seed in ``--out``; a finished
  one is not run again.

    python benchmarks/pinns/deepxde_pinn.py --task cost --out benchmarks/results/<date>_cpu_deepxde
    python benchmarks/pinns/deepxde_pinn.py --task train --budget 120 --out ...
    python benchmarks/pinns/deepxde_pinn.py --table --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("DDE_BACKEND", "pytorch")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import add_record_arguments, record_folder, run_missing, write_record  # noqa: E402

PI = np.pi
METHODS = ("sgn", "adam", "adam+lbfgs", "lbfgs")


def problem(seed: int, layers: List[int], domain: int, boundary: int):
    import deepxde as dde

    dde.config.set_default_float("float64")
    dde.config.set_random_seed(seed)

    def pde(x, y):
        dy_xx = dde.grad.hessian(y, x, i=0, j=0)
        dy_yy = dde.grad.hessian(y, x, i=1, j=1)
        f = 2 * PI**2 * torch.sin(PI * x[:, 0:1]) * torch.sin(PI * x[:, 1:2])
        return -dy_xx - dy_yy - f

    geom = dde.geometry.Rectangle([0, 0], [1, 1])
    bc = dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on)
    data = dde.data.PDE(geom, pde, bc, num_domain=domain, num_boundary=boundary)
    net = dde.nn.FNN(layers, "tanh", "Glorot uniform")
    return dde.Model(data, net)


def _test_points(seed: int):
    rng = np.random.default_rng(10_000 + seed)
    x = rng.random((2000, 2))
    return x, np.sin(PI * x[:, :1]) * np.sin(PI * x[:, 1:])


def cost(args) -> Dict[str, object]:
    """Interleaved per-step CPU seconds: the DeepXDE adapter and torch_sgn.pinn by hand."""
    import torch_sgn.deepxde
    from torch_sgn import SGN
    from torch_sgn.pinn import Residual, Residuals, laplacian

    model = problem(0, args.layers, args.domain, args.boundary)
    adapter = torch_sgn.deepxde.SGN(model)
    model.compile(adapter)
    model.train_state.set_data_train(*model.data.train_next_batch())
    init = [p.detach().clone() for p in model.net.parameters()]
    start = int(sum(model.data.num_bcs))
    x_all = torch.tensor(model.data.train_x)
    x_bc, x_in = x_all[:start], x_all[start:]

    chain = adapter.problem.network.chain  # the same nn.Linear modules as DeepXDE's net
    by_hand = Residuals(
        chain,
        {
            "interior": Residual(
                lambda u, x: (
                    -laplacian(u, x)
                    - 2 * PI**2 * torch.sin(PI * x[:, :1]) * torch.sin(PI * x[:, 1:])
                ),
                points=x_in,
            ),
            "boundary": Residual(lambda u, x: u(x), points=x_bc),
        },
    )
    times: Dict[str, List[float]] = {"deepxde": [], "pinn": []}
    losses: Dict[str, List[float]] = {"deepxde": [], "pinn": []}
    for _ in range(args.repeats):
        for name in ("deepxde", "pinn"):
            with torch.no_grad():
                for p, q in zip(model.net.parameters(), init):
                    p.copy_(q)
            if name == "deepxde":
                opt = torch_sgn.deepxde.SGN(model)
                model.compile(opt)

                def step(opt=opt):
                    return opt.step().item()
            else:
                opt = SGN(by_hand, by_hand.loss)
                batch = by_hand.batch()

                def step(opt=opt, batch=batch):
                    return opt.step(*batch).loss

            step()  # the first step's one-time work (counts, factors' check) is not timed
            t0 = time.process_time()
            for _ in range(args.steps):
                loss = step()
            times[name].append((time.process_time() - t0) / args.steps)
            losses[name].append(loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "task": "cost",
        "per_step_s": times,
        "median_s": med,
        "ratio_deepxde_over_pinn": med["deepxde"] / med["pinn"],
        "last_loss": losses,
        "params": sum(p.numel() for p in model.net.parameters()),
        "points": [int(len(x_in)), int(len(x_bc))],
        "solver": opt.last_info.solver if hasattr(opt, "last_info") else None,
    }


def train(method: str, seed: int, args) -> Dict[str, object]:
    """One method for ``args.budget`` CPU seconds in DeepXDE's training loop."""
    import deepxde as dde

    import torch_sgn.deepxde

    model = problem(seed, args.layers, args.domain, args.boundary)
    x_test, u_test = _test_points(seed)
    curve: List[List[float]] = []
    clock = {"used": 0.0, "since": time.process_time()}

    class Budget(dde.callbacks.Callback):
        def on_epoch_end(self):
            clock["used"] += time.process_time() - clock["since"]
            it = model.train_state.step
            if it % args.every == 0 or clock["used"] >= args.budget:
                err = dde.metrics.l2_relative_error(u_test, model.predict(x_test))
                curve.append([clock["used"], it, float(err)])
            if clock["used"] >= args.budget:
                model.stop_training = True
            clock["since"] = time.process_time()

    big = 10**9
    if method == "sgn":
        model.compile(torch_sgn.deepxde.SGN(model))
        model.train(iterations=big, callbacks=[Budget()], display_every=big, verbose=0)
    elif method == "adam":
        model.compile("adam", lr=1e-3)
        model.train(iterations=big, callbacks=[Budget()], display_every=big, verbose=0)
    else:
        if method.startswith("adam") and method.endswith("+lbfgs"):
            adam = int(method[4:-6] or args.adam_iterations)
            model.compile("adam", lr=1e-3)
            model.train(iterations=adam, callbacks=[Budget()], display_every=big, verbose=0)
        if clock["used"] < args.budget:
            lbfgs_budget = args.budget / 2 if method == "lbfgs+nncg" else args.budget
            dde.optimizers.set_LBFGS_options(maxiter=big)
            dde.optimizers.config.LBFGS_options["iter_per_step"] = 10

            class Half(dde.callbacks.Callback):
                def on_epoch_end(self):
                    if clock["used"] >= lbfgs_budget:
                        model.stop_training = True

            model.compile("L-BFGS")
            clock["since"] = time.process_time()
            model.train(callbacks=[Budget(), Half()], display_every=big, verbose=0)
        if method == "lbfgs+nncg" and clock["used"] < args.budget:
            model.compile("NNCG")
            clock["since"] = time.process_time()
            model.train(iterations=big, callbacks=[Budget()], display_every=big, verbose=0)
    return {
        "task": "train",
        "method": method,
        "seed": seed,
        "budget_s": args.budget,
        "curve": curve,
        "final_error": curve[-1][2] if curve else None,
        "params": sum(p.numel() for p in model.net.parameters()),
    }


def table(folder: Path) -> str:
    rows = ["| method | seed | final rel. L2 | CPU s | iterations |", "|---|---|---|---|---|"]
    for path in sorted(folder.glob("train_*.json")):
        r = json.loads(path.read_text())
        last = r["curve"][-1] if r["curve"] else [float("nan")] * 3
        rows.append(f"| {r['method']} | {r['seed']} | {last[2]:.2e} | {last[0]:.0f} | {last[1]} |")
    cost_path = folder / "cost.json"
    if cost_path.exists():
        c = json.loads(cost_path.read_text())
        m = c["median_s"]
        rows.append("")
        rows.append(
            f"step cost (median of {len(c['per_step_s']['pinn'])}): torch_sgn.deepxde "
            f"{m['deepxde'] * 1e3:.1f} ms, torch_sgn.pinn {m['pinn'] * 1e3:.1f} ms, ratio "
            f"{c['ratio_deepxde_over_pinn']:.2f}"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("cost", "train"), default="train")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--every", type=int, default=10, help="iterations between errors")
    parser.add_argument("--adam-iterations", type=int, default=5000)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 50, 50, 50, 50, 1])
    parser.add_argument("--domain", type=int, default=1200)
    parser.add_argument("--boundary", type=int, default=120)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    add_record_arguments(parser)
    args = parser.parse_args(argv)
    out = record_folder(args, table)
    if out is None:
        return
    if args.one:
        method, seed = args.one.split(":")
        write_record(out / f"train_{method}_{seed}.json", train(method, int(seed), args))
        return
    if args.task == "cost":
        write_record(out / "cost.json", cost(args))
        print(table(out))
        return
    runs = [
        (f"{method}:{seed}", out / f"train_{method}_{seed}.json")
        for seed in args.seeds.split(",")
        for method in args.methods.split(",")
    ]
    run_missing(__file__, argv if argv is not None else sys.argv[1:], runs)
    print(table(out))


if __name__ == "__main__":
    main()
