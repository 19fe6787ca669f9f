"""A PINN written the usual way (derivatives by ``torch.autograd.grad`` in ``forward``) under
SGN's defaults, L-BFGS and Adam, and the same problem written with ``torch_sgn.pinn``.

The problem: the nonlinear Poisson equation -Laplace(u) + u^3 = f on the unit square, u = g on
its boundary, exact solution u = sin(pi x) sin(pi y); a 2-24-24-1 tanh network (697 parameters),
400 interior and 84 boundary points drawn once per seed; float64, one CPU thread; the loss is the
mean of the 484 squared residuals for every method. Methods (each in a process of its own,
``--budget`` CPU seconds):

* ``sgn``: ``SGN(model, "mse")`` with its defaults, ``step(points, zeros)`` on the module whose
  forward returns the residual vector (nested autograd);
* ``sgn-cg10``: the same with the paper's CG settings (``solver="cg"``, 10 iterations,
  ``cg_tol=1e-6``), SGN's defaults before ``solver="auto"`` planned one-batch CG;
* ``lbfgs``: ``torch.optim.LBFGS`` (strong Wolfe, history 100, 20 iterations per call);
* ``adam``: lr 1e-3;
* ``sgn-pinn``: SGN's defaults on the same problem, points and initial network written with
  ``torch_sgn.pinn`` (``Residuals``, ``laplacian``; block weights give the same loss).

The relative L2 error on 2,000 random points is recorded along the way (not counted). One JSON
per method and seed in ``--out``; a finished one is not run again; ``--table`` prints them.

    python benchmarks/pinns/pinn_autograd.py --seeds 0,1,2 --budget 40 \\
        --out benchmarks/results/<dir>
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import add_record_arguments, record_folder, run_missing, write_record  # noqa: E402

METHODS = ("sgn", "sgn-cg10", "lbfgs", "adam", "sgn-pinn")
PI = math.pi


def exact(x: Tensor) -> Tensor:
    return torch.sin(PI * x[:, :1]) * torch.sin(PI * x[:, 1:])


def source(x: Tensor) -> Tensor:
    u = exact(x)
    return 2 * PI**2 * u + u**3


def network(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(2, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 1)
    ).double()


def points(seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    interior = torch.rand(400, 2, generator=g, dtype=torch.float64)
    t = torch.rand(84, generator=g, dtype=torch.float64)
    side = torch.arange(84) % 4
    zero, one = torch.zeros_like(t), torch.ones_like(t)
    xs = torch.where(side == 0, t, torch.where(side == 1, t, torch.where(side == 2, zero, one)))
    ys = torch.where(side == 0, zero, torch.where(side == 1, one, t))
    boundary = torch.stack([xs, ys], 1)
    test = torch.rand(2000, 2, generator=g, dtype=torch.float64)
    return interior, boundary, test


class AutogradPINN(nn.Module):
    """The residual vector, its Laplacian by nested autograd in ``forward`` (the usual way)."""

    def __init__(self, net: nn.Module, boundary_points: int):
        super().__init__()
        self.net, self.nb = net, boundary_points

    def forward(self, x: Tensor) -> Tensor:
        x = x if x.requires_grad else x.requires_grad_(True)
        u = self.net(x)
        (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        lap = sum(
            torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i : i + 1]
            for i in range(x.shape[1])
        )
        interior = (-lap + u**3 - source(x))[: -self.nb]
        boundary = (u - exact(x))[-self.nb :]
        return torch.cat([interior, boundary]).squeeze(1)


def run(method: str, seed: int, budget: float, every: float) -> Dict[str, object]:
    from torch_sgn import SGN
    from torch_sgn.pinn import Residual, Residuals, laplacian

    net = network(seed)
    interior, boundary, test = points(seed)
    x = torch.cat([interior, boundary])
    zeros = torch.zeros(len(x), dtype=torch.float64)
    model = AutogradPINN(net, len(boundary))
    u_test = exact(test)

    def error() -> float:
        with torch.no_grad():
            return float((net(test) - u_test).norm() / u_test.norm())

    if method in ("sgn", "sgn-cg10"):
        opts = {} if method == "sgn" else dict(solver="cg", cg_iters=10, cg_tol=1e-6)
        opt = SGN(model, "mse", **opts)

        def step() -> None:
            opt.step(x, zeros)
    elif method == "sgn-pinn":
        n = len(x)
        problem = Residuals(
            net,
            {
                "interior": Residual(
                    lambda u, p: -laplacian(u, p) + u(p) ** 3 - source(p),
                    points=interior,
                    weight=len(interior) / n,
                ),
                "boundary": Residual(
                    lambda u, p: u(p) - exact(p), points=boundary, weight=len(boundary) / n
                ),
            },
        )
        opt = SGN(problem, problem.loss)
        batch = problem.batch()

        def step() -> None:
            opt.step(*batch)
    elif method == "lbfgs":
        opt = torch.optim.LBFGS(
            net.parameters(), lr=1, max_iter=20, history_size=100, line_search_fn="strong_wolfe"
        )

        def closure():
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        def step() -> None:
            opt.step(closure)
    elif method == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    else:
        raise ValueError(method)
    clock, steps, curve, next_mark = 0.0, 0, [[0.0, 0, error()]], every
    while clock < budget:
        t0 = time.process_time()
        step()
        clock += time.process_time() - t0
        steps += 1
        if clock >= next_mark or clock >= budget:
            curve.append([clock, steps, error()])
            next_mark += every
    return {
        "method": method,
        "seed": seed,
        "budget_s": budget,
        "steps": steps,
        "per_step_s": clock / steps,
        "final_error": curve[-1][2],
        "curve": curve,
        "params": sum(p.numel() for p in net.parameters()),
        "points": [len(interior), len(boundary)],
    }


def table(folder: Path) -> str:
    runs: Dict[str, List[dict]] = {}
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        runs.setdefault(r["method"], []).append(r)
    rows = [
        "| method | seeds | final rel. L2 (median) | per seed | steps (median) | ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        rs = sorted(runs.get(method, []), key=lambda r: r["seed"])
        if not rs:
            continue
        errs = [r["final_error"] for r in rs]
        rows.append(
            f"| {method} | {len(rs)} | {statistics.median(errs):.2e} | "
            f"{' / '.join(f'{e:.1e}' for e in errs)} | "
            f"{statistics.median(r['steps'] for r in rs):.0f} | "
            f"{1e3 * statistics.median(r['per_step_s'] for r in rs):.1f} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--budget", type=float, default=40.0)
    parser.add_argument("--every", type=float, default=2.0, help="CPU s between errors")
    add_record_arguments(parser)
    args = parser.parse_args(argv)
    out = record_folder(args, table)
    if out is None:
        return
    if args.one:
        method, seed = args.one.split(":")
        write_record(out / f"{method}_{seed}.json", run(method, int(seed), args.budget, args.every))
        return
    runs = [
        (f"{method}:{seed}", out / f"{method}_{seed}.json")
        for seed in args.seeds.split(",")
        for method in args.methods.split(",")
    ]
    run_missing(__file__, argv if argv is not None else sys.argv[1:], runs)
    print(table(out))


if __name__ == "__main__":
    main()
