"""One SGN step's CPU seconds on DeepXDE models whose networks the forward jets take since
``torch_sgn.deepxde.networks`` (a ``PFNN``, an ``FNN`` with a feature transform), beside the route
they took before (``torch.func`` jets, ``J`` by rows), and on PINNacle's ``FNN`` 5 x 100.

Each case is a DeepXDE ``dde.Model`` trained by ``torch_sgn.deepxde.SGN`` (defaults), float64,
one thread, by two routes: ``func``, the adapter with its network's chain removed
(``problem.network.chain = None``), the route every network but a plain ``FNN`` took before
``torch_sgn.deepxde.networks`` (its jets by ``torch.func``, the layers' factors refused, ``J``
formed row by row); ``forward``, the adapter as it is (forward jets, the layers' factors). The
two are interleaved in one process, ``--repeats`` times, each from the same initial parameters:
a first step (not timed: its one-time work, the factors' check), then ``--steps`` timed steps;
the median per-step CPU seconds (``time.process_time``) of each and their ratio.

Cases (``--cases``):

* ``pfnn``: PINNacle's ``PoissonInv`` network, ``dde.nn.PFNN([2] + 5 * [[50, 50]] + [2])``
  (two sub-networks of 5 x 50, tanh, 20,802 parameters), on a coupled 2-D Poisson system
  ``-Lap u + v = f``, ``-Lap v - u = g`` on the unit square, both zero on the boundary;
* ``fnn-periodic``: ``FNN([4] + [100] * 5 + [1])`` (41,001 parameters) on periodic features
  ``[cos(pi x), sin(pi x)]`` of each coordinate (``apply_feature_transform``), on the 2-D
  Poisson problem of ``deepxde_pinn.py``;
* ``fnn``: PINNacle's network, ``FNN([2] + [100] * 5 + [1])`` (40,801 parameters), on the same
  problem. A plain ``FNN`` took the forward route before this change too: its ``func`` route is
  shown for what the forward route is worth at this size, not as a former cost.

    PYTHONPATH=src python benchmarks/pinns/deepxde_networks_cost.py \\
        --out benchmarks/results/<date>_cpu_deepxde_networks_cost
    PYTHONPATH=src python benchmarks/pinns/deepxde_networks_cost.py --table --out ...
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
from measuring import add_record_arguments, record_folder, write_record  # noqa: E402

PI = np.pi
CASES = ("pfnn", "fnn-periodic", "fnn")


def _periodic(x):
    return torch.cat([torch.cos(PI * x), torch.sin(PI * x)], 1)


def model_of(case: str, domain: int, boundary: int, seed: int = 0):
    """The case's DeepXDE model (float64, seeded)."""
    import deepxde as dde

    dde.config.set_default_float("float64")
    dde.config.set_random_seed(seed)
    geom = dde.geometry.Rectangle([0, 0], [1, 1])

    def source(x):
        return 2 * PI**2 * torch.sin(PI * x[:, 0:1]) * torch.sin(PI * x[:, 1:2])

    def lap(y, x, c=0):
        return dde.grad.hessian(y, x, component=c, i=0, j=0) + dde.grad.hessian(
            y, x, component=c, i=1, j=1
        )

    if case == "pfnn":

        def pde(x, y):
            return [-lap(y, x, 0) + y[:, 1:2] - source(x), -lap(y, x, 1) - y[:, 0:1]]

        bcs = [
            dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on, component=c) for c in range(2)
        ]
        net = dde.nn.PFNN([2] + 5 * [[50, 50]] + [2], "tanh", "Glorot normal")
    else:

        def pde(x, y):
            return -lap(y, x) - source(x)

        bcs = [dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on)]
        width = 4 if case == "fnn-periodic" else 2
        net = dde.nn.FNN([width] + [100] * 5 + [1], "tanh", "Glorot normal")
        if case == "fnn-periodic":
            net.apply_feature_transform(_periodic)
    data = dde.data.PDE(geom, pde, bcs, num_domain=domain, num_boundary=boundary)
    return dde.Model(data, net)


def measure(case: str, args) -> Dict[str, object]:
    import torch_sgn.deepxde

    model = model_of(case, args.domain, args.boundary)
    model.compile(torch_sgn.deepxde.SGN(model))
    model.train_state.set_data_train(*model.data.train_next_batch())
    init = [p.detach().clone() for p in model.net.parameters()]
    times: Dict[str, List[float]] = {"func": [], "forward": []}
    losses: Dict[str, List[float]] = {"func": [], "forward": []}
    solvers: Dict[str, List[str]] = {"func": [], "forward": []}
    follow: Dict[str, bool] = {}
    for _ in range(args.repeats):
        for route in ("func", "forward"):
            with torch.no_grad():
                for p, q in zip(model.net.parameters(), init):
                    p.copy_(q)
            opt = torch_sgn.deepxde.SGN(model)
            if route == "func":  # every network's route but a plain FNN's before
                opt.problem.network.__dict__["chain"] = None
            model.compile(opt)
            opt.step()  # the one-time work (the factors' check) is not timed
            t0 = time.process_time()
            for _ in range(args.steps):
                loss = opt.step().item()
                solvers[route].append(str(opt.last_info.solver))
            times[route].append((time.process_time() - t0) / args.steps)
            losses[route].append(loss)
            follow[route] = bool(opt.problem.residuals.factors_follow)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "case": case,
        "parameters": sum(p.numel() for p in model.net.parameters()),
        "domain": args.domain,
        "boundary": args.boundary,
        "steps": args.steps,
        "repeats": args.repeats,
        "per_step_s": times,
        "median_s": med,
        "ratio_func_over_forward": med["func"] / med["forward"],
        "last_loss": losses,
        "solvers": {k: sorted(set(v)) for k, v in solvers.items()},
        "factors_follow": follow,
    }


def table(out: Path) -> str:
    lines = [
        "| case | parameters | points | func route (s/step) | forward route (s/step) | ratio | "
        "solver func, forward | factors follow (forward) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(out.glob("*.json")):
        r = json.loads(path.read_text())
        m = r["median_s"]
        lines.append(
            f"| {r['case']} | {r['parameters']:,} | {r['domain']} + {r['boundary']} | "
            f"{m['func']:.3f} | {m['forward']:.3f} | {r['ratio_func_over_forward']:.1f} | "
            f"{'/'.join(r['solvers']['func'])}, {'/'.join(r['solvers']['forward'])} | "
            f"{r['factors_follow']['forward']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--domain", type=int, default=1000)
    parser.add_argument("--boundary", type=int, default=200)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    add_record_arguments(parser)
    args = parser.parse_args()
    out = record_folder(args, table)
    if out is None:
        return
    for case in args.cases:
        path = out / f"{case}_{args.domain}_{args.boundary}.json"
        if path.exists():
            continue
        result = measure(case, args)
        write_record(path, result)
        print(json.dumps({k: result[k] for k in ("case", "median_s", "solvers")}), flush=True)
    print(table(out))


if __name__ == "__main__":
    main()
