"""Physics-informed networks: SGN against Adam, L-BFGS and the paper's SGN, by CPU seconds.

Command (from the repository root; one thread, float64)::

    PYTHONPATH=src python benchmarks/pinns/pinn.py --problem poisson2d --net 2-64-1 --seconds 300 \\
        --out benchmarks/results/<record>

Problems (Dangel, Mueller, Zeinhofer, NeurIPS 2024, "Kronecker-Factored Approximate Curvature
for Physics-Informed Neural Networks", as its public experiments set them up):

* ``poisson2d``: -Laplace(u) = 2 pi^2 sin(pi x) sin(pi y) on [0, 1]^2, u = 0 on the boundary;
  exact u = sin(pi x) sin(pi y); 900 interior and 120 boundary points drawn once.
* ``heat1d``: du/dt = (1/4) d2u/dx2 on (t, x) in [0, 1]^2, u(0, x) = sin(pi x), u = 0 at x = 0
  and x = 1; exact u = exp(-pi^2 t / 4) sin(pi x); 900 interior, 120 boundary and initial points.
* ``poisson5d``: -Laplace(u) = pi^2 sum cos(pi x_i) on [0, 1]^5, boundary values of the exact
  u = sum cos(pi x_i); 3000 interior and 500 boundary points drawn anew at each step.

``--points INTERIOR BOUNDARY`` sets the numbers of points (the published ones by default; for
``heat1d`` the second number counts the boundary and initial points, a third of them initial),
``--fixed`` draws ``poisson5d``'s points once instead of at every step.

Loss: the mean squared interior residual plus the mean squared boundary (and initial) residual.
The error is the relative L2 error against the exact solution on 10,000 held-out uniform points
(drawn once from their own seed). Each method runs for ``--seconds`` of this process's CPU time
(evaluations excluded), one thread; the record holds the error against time and steps.
``--device cuda`` runs on the GPU instead: points, network and evaluation on it, and the budget
in wall-clock seconds (the GPU synchronized before each reading).

Methods: ``sgn`` (SGN's defaults on :class:`torch_sgn.pinn.Residuals`: exact Gauss-Newton steps
through the residuals' Gram matrix), ``sgn-nystrom`` (CG preconditioned by a randomized Nystrom
approximation of ``G``, for nets too large for exact steps: rank 100 rebuilt every 10 steps, at
most 100 iterations to a relative residual of 1e-3), ``sgn-cg`` (the same CG without the
preconditioner), ``sgn-paper``
(:meth:`SGN.paper`, CG with 10 iterations), ``adam-<lr>``, ``lbfgs`` (torch's, strong Wolfe line
search, history 100). A finished run is not run again (its JSON is kept): an interrupted
benchmark resumes where it stopped; a run in progress keeps its curve so far in a ``.partial``
file beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
from torch import Tensor, nn

from torch_sgn import SGN
from torch_sgn.pinn import Residual, Residuals, laplacian, time_derivative

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from measuring import environment  # noqa: E402

D = torch.float64

#: SGN's setting for nets too large for exact steps: Nystrom-preconditioned CG.
NYSTROM = dict(
    solver="cg", preconditioner="nystrom", preconditioner_rank=100, preconditioner_every=10,
    cg_iters=100, cg_rtol=1e-3,
)  # fmt: skip


@dataclass
class Problem:
    name: str
    dim: int
    exact: Callable[[Tensor], Tensor]
    blocks: Callable[[nn.Module], dict]
    resample: bool


def _boundary_square(n: int, g: torch.Generator) -> Tensor:
    """``n`` points on the boundary of [0, 1]^2, a quarter on each edge."""
    t = torch.rand(n, 1, generator=g, dtype=D)
    side = torch.arange(n) % 4
    zero, one = torch.zeros_like(t), torch.ones_like(t)
    x = torch.where((side == 0)[:, None], zero, torch.where((side == 1)[:, None], one, t))
    y = torch.where((side == 2)[:, None], zero, torch.where((side == 3)[:, None], one, t))
    return torch.cat([x, y], 1)


def _boundary_cube(n: int, d: int, g: torch.Generator) -> Tensor:
    """``n`` points on the boundary of [0, 1]^d: one coordinate set to 0 or 1."""
    x = torch.rand(n, d, generator=g, dtype=D)
    face = torch.randint(0, d, (n,), generator=g)
    x[torch.arange(n), face] = torch.randint(0, 2, (n,), generator=g).to(D)
    return x


def poisson2d(seed: int, points: Tuple[int, int] = (900, 120), fixed: bool = True) -> Problem:
    g = torch.Generator().manual_seed(seed)
    x_in, x_bd = torch.rand(points[0], 2, generator=g, dtype=D), _boundary_square(points[1], g)
    pi = math.pi

    def exact(x: Tensor) -> Tensor:
        return torch.sin(pi * x[:, :1]) * torch.sin(pi * x[:, 1:2])

    def f(x: Tensor) -> Tensor:
        return 2 * pi**2 * exact(x)

    def blocks(net: nn.Module) -> dict:
        return {
            "interior": Residual(lambda u, x: -laplacian(u, x) - f(x), points=x_in),
            "boundary": Residual(lambda u, x: u(x), points=x_bd),
        }

    return Problem("poisson2d", 2, exact, blocks, False)


def heat1d(seed: int, points: Tuple[int, int] = (900, 120), fixed: bool = True) -> Problem:
    g = torch.Generator().manual_seed(seed)
    x_in = torch.rand(points[0], 2, generator=g, dtype=D)  # (t, x)
    t_b = torch.rand(points[1], 1, generator=g, dtype=D)
    side = (torch.arange(points[1]) % 3)[:, None]
    x_b = torch.where(side == 0, torch.zeros_like(t_b), torch.ones_like(t_b))
    pts = torch.where(
        side == 2, torch.cat([torch.zeros_like(t_b), t_b], 1), torch.cat([t_b, x_b], 1)
    )
    pi, kappa = math.pi, 0.25

    def exact(x: Tensor) -> Tensor:
        return torch.exp(-kappa * pi**2 * x[:, :1]) * torch.sin(pi * x[:, 1:2])

    def pde(u: nn.Module, x: Tensor) -> Tensor:
        return time_derivative(u, x, 0) - kappa * laplacian(u, x, dims=[1])

    def blocks(net: nn.Module) -> dict:
        return {
            "interior": Residual(pde, points=x_in),
            "boundary": Residual(lambda u, x: u(x) - exact(x), points=pts),
        }

    return Problem("heat1d", 2, exact, blocks, False)


def poisson5d(seed: int, points: Tuple[int, int] = (3000, 500), fixed: bool = False) -> Problem:
    pi, d = math.pi, 5
    g = torch.Generator().manual_seed(seed)
    n_in, n_bd = points

    def exact(x: Tensor) -> Tensor:
        return torch.cos(pi * x).sum(1, keepdim=True)

    def f(x: Tensor) -> Tensor:
        return pi**2 * torch.cos(pi * x).sum(1, keepdim=True)

    def blocks(net: nn.Module) -> dict:
        if fixed:  # drawn once
            x_in, x_bd = torch.rand(n_in, d, generator=g, dtype=D), _boundary_cube(n_bd, d, g)
            return {
                "interior": Residual(lambda u, x: -laplacian(u, x) - f(x), points=x_in),
                "boundary": Residual(lambda u, x: u(x) - exact(x), points=x_bd),
            }
        return {
            "interior": Residual(
                lambda u, x: -laplacian(u, x) - f(x),
                sample=lambda step: torch.rand(n_in, d, generator=g, dtype=D),
            ),
            "boundary": Residual(
                lambda u, x: u(x) - exact(x), sample=lambda step: _boundary_cube(n_bd, d, g)
            ),
        }

    return Problem("poisson5d", d, exact, blocks, not fixed)


PROBLEMS = {"poisson2d": poisson2d, "heat1d": heat1d, "poisson5d": poisson5d}


def network(spec: str, dim: int, seed: int) -> nn.Module:
    """A tanh MLP from ``"2-64-64-1"`` (the first number must be the problem's dimension)."""
    widths = [int(w) for w in spec.split("-")]
    if widths[0] != dim:
        raise SystemExit(f"--net {spec}: the input width must be the problem's dimension {dim}")
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(D)


def run(
    problem: Problem,
    net_spec: str,
    method: str,
    seconds: float,
    seed: int,
    progress: Callable[[dict], None] = lambda partial: None,
    stop_below: float = 0.0,
    device: str = "cpu",
) -> dict:
    net = network(net_spec, problem.dim, seed).to(device)
    residuals = Residuals(net, problem.blocks(net))
    if device != "cpu":
        _to_device(residuals, torch.device(device))
    g = torch.Generator().manual_seed(10_000 + seed)
    x_eval = torch.rand(10_000, problem.dim, generator=g, dtype=D).to(device)
    u_eval = problem.exact(x_eval)
    cuda = torch.device(device).type == "cuda"

    def now() -> float:  # CPU seconds of this process; on a GPU, wall-clock seconds
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def error() -> float:
        with torch.no_grad():
            return float((net(x_eval) - u_eval).norm() / u_eval.norm())

    step_fn = _method(method, residuals, net)
    curve: List[Tuple[float, int, float, float]] = [(0.0, 0, error(), float("nan"))]
    clock, steps, next_eval = 0.0, 0, 0.5
    while clock < seconds:
        inputs, targets = residuals.batch(steps)
        t0 = now()
        loss = step_fn(inputs, targets)
        clock += now() - t0
        steps += 1
        if not math.isfinite(loss):
            break
        if clock >= next_eval or clock >= seconds:
            curve.append((clock, steps, error(), loss))
            next_eval = clock * 1.25
            progress({"net": net_spec, "method": method, "steps": steps, "curve": curve})
            if curve[-1][2] <= stop_below:
                break
    result = {
        "problem": problem.name,
        "net": net_spec,
        "parameters": sum(p.numel() for p in net.parameters()),
        "method": method,
        "seconds": seconds,
        "seed": seed,
        "device": device,
        "steps": steps,
        "final_error": curve[-1][2],
        "best_error": min(c[2] for c in curve),
        "curve": curve,
    }
    if stop_below > 0 and curve[-1][2] <= stop_below:
        result["stopped_below"] = stop_below  # the run ended early, at the target error
    return result


def _to_device(residuals: Residuals, device: torch.device) -> None:
    """Moves the blocks' fixed points to ``device``, and makes their samplers draw there."""
    for block in residuals.blocks:
        if block.points is not None:
            block.points = tuple(p.to(device) for p in block.points)
        if block.sample is not None:

            def sample(step: int, draw: Callable = block.sample) -> Tuple[Tensor, ...]:
                points = draw(step)
                points = (points,) if torch.is_tensor(points) else points
                return tuple(p.to(device) for p in points)

            block.sample = sample


def _method(method: str, residuals: Residuals, net: nn.Module) -> Callable:
    if method in ("sgn", "sgn-nystrom", "sgn-cg", "sgn-paper"):
        if method == "sgn":
            opt = SGN(residuals, residuals.loss)
        elif method == "sgn-nystrom":
            opt = SGN(residuals, residuals.loss, **NYSTROM)
        elif method == "sgn-cg":
            opt = SGN(residuals, residuals.loss, **{**NYSTROM, "preconditioner": False})
        else:
            opt = SGN.paper(residuals, residuals.loss)
        return lambda inputs, targets: opt.step(inputs, targets).loss_after
    if method.startswith("adam-"):
        adam = torch.optim.Adam(net.parameters(), lr=float(method[5:]))

        def adam_step(inputs, targets):
            adam.zero_grad()
            loss = residuals(*inputs).square().sum()
            loss.backward()
            adam.step()
            return float(loss.detach())

        return adam_step
    if method == "lbfgs":
        lbfgs = torch.optim.LBFGS(
            net.parameters(), lr=1.0, history_size=100, max_iter=20,
            line_search_fn="strong_wolfe", tolerance_grad=0.0, tolerance_change=0.0,
        )  # fmt: skip

        def lbfgs_step(inputs, targets):
            def closure():
                lbfgs.zero_grad()
                loss = residuals(*inputs).square().sum()
                loss.backward()
                return loss

            return float(lbfgs.step(closure))

        return lbfgs_step
    raise SystemExit(f"unknown method {method!r}")


def table(folder: str) -> str:
    """The markdown table of the finished runs in ``folder``: the error at the end of each
    run's budget, and the CPU seconds at which it first reached each order of magnitude."""
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                row = json.load(f)
            if "curve" in row:  # a run (the folder may hold other records)
                rows.append(row)
    out = [
        "| problem | net (parameters) | points | method | seed | budget | steps | rel. L2 error | "
        "first <= 1e-4 / 1e-6 / 1e-8 (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = lambda r: (r["problem"], r["parameters"], str(r.get("points")), r["method"], r["seed"])  # noqa: E731
    for r in sorted(rows, key=order):
        budget = f"{r['seconds']:.0f} s"
        if r.get("device", "cpu") != "cpu":  # wall-clock seconds on a GPU
            budget += f" {r['meta'].get('gpu', r['device'])}"
        if "stopped_at_seconds" in r:  # a run stopped by hand: its curve up to there
            budget += f", stopped at {r['stopped_at_seconds']:.0f} s"
        if "stopped_below" in r:  # ended at its target error
            budget += f", ended at {r['curve'][-1][0]:.0f} s (<= {r['stopped_below']:.0e})"
        reach = []
        for level in (1e-4, 1e-6, 1e-8):
            t = next((c[0] for c in r["curve"] if c[2] <= level), None)
            reach.append("-" if t is None else f"{t:.0f}")
        points = r.get("points", "published")
        if isinstance(points, list):
            points = " + ".join(f"{p:,}" for p in points)
            points += "" if r.get("fixed", True) else ", drawn anew"
        out.append(
            f"| {r['problem']} | {r['net']} ({r['parameters']:,}) | {points} | {r['method']} | "
            f"{r['seed']} | {budget} | {r['steps']} | {r['final_error']:.1e} | "
            f"{' / '.join(reach)} |"
        )
    return "\n".join(out)


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problem", choices=sorted(PROBLEMS), default="poisson2d")
    p.add_argument("--net", default="2-64-1")
    p.add_argument("--methods", nargs="+", default=["sgn", "sgn-paper", "adam-0.001", "lbfgs"])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument(
        "--points", type=int, nargs=2, metavar=("INTERIOR", "BOUNDARY"),
        help="collocation points (default: the published 900 120, 3000 500 for poisson5d)",
    )  # fmt: skip
    p.add_argument(
        "--fixed", action="store_true",
        help="poisson5d: draw the points once rather than at every step",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--device", default="cpu",
        help="cpu (budget in CPU seconds) or cuda (budget in wall-clock seconds)",
    )  # fmt: skip
    p.add_argument(
        "--stop-below", type=float, default=0.0,
        help="end a run once its error is at or below this value (default: run the budget)",
    )  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument("--table", action="store_true", help="print the table of --out's runs, run none")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.out))
        return
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    meta = {
        "command": "PYTHONPATH=src python benchmarks/pinns/pinn.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu": env["cpu"],  # the model name (lscpu)
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "commit": env.get("commit", ""),
        "device": args.device,
    }
    if torch.device(args.device).type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    rows = []
    for seed in args.seeds:
        for method in args.methods:
            points = "" if args.points is None else "_{}+{}".format(*args.points)
            points += "_fixed" if args.fixed else ""
            points += "" if args.device == "cpu" else "_" + args.device.replace(":", "")
            name = f"{args.problem}_{args.net}{points}_{method}_s{seed}_{int(args.seconds)}s.json"
            path = os.path.join(args.out, name)
            if os.path.exists(path):  # finished before: resume without running it again
                with open(path) as f:
                    result = json.load(f)
            else:
                kwargs = {} if args.points is None else {"points": tuple(args.points)}
                if args.fixed:
                    kwargs["fixed"] = True
                problem = PROBLEMS[args.problem](seed, **kwargs)

                def progress(partial: dict, path: str = path) -> None:  # the curve so far
                    with open(path + ".partial", "w") as f:
                        json.dump({**partial, "meta": meta}, f)

                result = run(
                    problem, args.net, method, args.seconds, seed, progress, args.stop_below,
                    args.device,
                )  # fmt: skip
                result["meta"] = meta
                result["points"] = args.points or "published"
                result["fixed"] = not problem.resample
                with open(path + ".tmp", "w") as f:
                    json.dump(result, f)
                os.replace(path + ".tmp", path)
                if os.path.exists(path + ".partial"):
                    os.remove(path + ".partial")
            rows.append(result)
            print(
                f"{args.problem:10s} {args.net:22s} {method:12s} seed {seed}: "
                f"rel. L2 {result['final_error']:.2e} (best {result['best_error']:.2e}) "
                f"after {result['steps']} steps, {args.seconds:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
