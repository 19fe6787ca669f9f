"""The direct solver on a GPU: exactness against a dense float64 solve, and the 133k-parameter
regression problem of ``benchmarks/convergence/regression.py`` against Adam, in wall-clock seconds.

Part of ``benchmarks/gpu/gpu_checks.sh``; alone, from the repository root on a CUDA machine::

    PYTHONPATH=src python benchmarks/gpu/gpu_solver_check.py --seconds 20 --out gpu_solver.json

1. Exactness: one undamped-trust-region step of ``SGN(solver="direct")`` in float64 on CUDA,
   through the batch's outputs (``J J^T``; squared error and cross-entropy) and through ``G``
   (with a gradient average), against ``theta - (G + rho I)^{-1} g`` formed on the CPU from
   dense Jacobians (``torch.func.jacrev``) and ``torch.linalg.solve``; then the same with the
   geodesic acceleration on targets a nearby network fits (where it is used), against
   ``theta + d + a / 2``, ``a = -(G + rho I)^{-1} J^T H f_dd`` with ``f_dd`` the same central
   difference on the CPU.
2. ``mlp133k`` (3-256-256-256-1 tanh, 50,000 points, batches of 1000, float32): ``SGN`` with its
   defaults and Adam over a few learning rates, each for ``--seconds`` of wall-clock time
   (synchronised), the full-data MSE at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from torch_sgn import SGN

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _regression():
    spec = importlib.util.spec_from_file_location(
        "regression", ROOT / "benchmarks/convergence/regression.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["regression"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _case(device: torch.device, loss: str, n_out: int, momentum: float, geodesic: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, n_out)).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randn(8, n_out).double() if loss == "mse" else torch.randint(0, n_out, (8,))
    if geodesic:  # targets of a nearby network: a small step, whose acceleration is used
        with torch.no_grad():
            teacher = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, n_out)).double()
            teacher.load_state_dict(model.state_dict())
            for p in teacher.parameters():
                p.add_(0.05 * torch.randn_like(p))
            y = teacher(x) if loss == "mse" else torch.softmax(teacher(x), dim=1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    theta = torch.cat([p.reshape(-1) for p in params.values()])
    fn = nn.functional.mse_loss if loss == "mse" else nn.functional.cross_entropy

    def f(flat):
        chunks = flat.split([p.numel() for p in params.values()])
        named = {k: c.view(p.shape) for (k, p), c in zip(params.items(), chunks)}
        return torch.func.functional_call(model, named, (x,))

    z = f(theta)
    J = torch.func.jacrev(f)(theta).reshape(z.numel(), -1)
    H = torch.func.hessian(lambda o: fn(o.view(z.shape), y))(z.reshape(-1))
    g = torch.func.grad(lambda t: fn(f(t), y))(theta)
    rho = 1e-3
    G = J.T @ H @ J
    A = G + rho * torch.eye(len(theta)).double()
    d = -torch.linalg.solve(A, g)  # the first gradient average is the gradient itself
    expected, used = theta + d, False
    if geodesic:
        h = 0.1  # torch_sgn.solve.core.STEP
        fdd = (f(theta + h * d) - 2 * z + f(theta - h * d)).reshape(-1) / h**2
        a = -torch.linalg.solve(A, J.T @ H @ fdd)
        used = 2 * float(a.norm()) <= 0.75 * float(d.norm())  # torch_sgn.solve.core.RATIO
        if used:
            expected = theta + d + 0.5 * a
    model = model.to(device)
    opt = SGN(
        model, loss, damping=rho, solver="direct", momentum=momentum, line_search=False,
        trust_region=False, geodesic_acceleration=geodesic, reject_uphill=False,
    )  # fmt: skip
    info = opt.step(x.to(device), y.to(device))
    got = nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
    error = float((got - expected).norm() / (expected - theta).norm())
    print(
        f"exactness {loss} momentum {momentum} geodesic {geodesic}: relative error {error:.2e} "
        f"({info.stop_reason}; accelerated {info.accelerated}, reference {used})"
    )
    return {
        "relative_error": error, "stop": info.stop_reason, "solver": info.solver,
        "accelerated": info.accelerated, "reference_accelerated": used,
    }  # fmt: skip


def exactness(device: torch.device) -> dict:
    cases = [("mse", 3, 0.0), ("cross_entropy", 4, 0.0), ("mse", 3, 0.5)]
    return {
        f"{loss} momentum {m} geodesic {geo}": _case(device, loss, n, m, geo)
        for geo in (False, True)
        for loss, n, m in cases
    }


def timed_fit(device: torch.device, seconds: float, methods) -> dict:
    problem = _regression().problems()["mlp133k"]
    x, y = (t.to(device) for t in problem.make_data(torch.float32))
    results = {}
    for label, make in methods:
        torch.manual_seed(0)
        model = problem.make_model().to(device)
        step = make(model)
        gen = torch.Generator(device=device).manual_seed(0)
        steps, elapsed = 0, 0.0
        while elapsed < seconds:
            perm = torch.randperm(len(x), generator=gen, device=device)
            for i in range(0, len(x) - problem.batch_size + 1, problem.batch_size):
                idx = perm[i : i + problem.batch_size]
                _sync(device)
                start = time.perf_counter()
                step(x[idx], y[idx])
                _sync(device)
                elapsed += time.perf_counter() - start
                steps += 1
                if elapsed >= seconds:
                    break
        with torch.no_grad():
            mse = float(((model(x) - y) ** 2).mean())
        results[label] = {"mse": mse, "steps": steps, "seconds": elapsed}
        print(f"mlp133k {label}: MSE {mse:.3e} after {steps} steps, {elapsed:.1f} s", flush=True)
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _adam(lr):
    def make(model):
        opt = torch.optim.Adam(model.parameters(), lr=lr)

        def step(xb, yb):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()

        return step

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--adam-lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    env = environment()
    print(environment_line(env))
    record = {"device": name, "environment": env}
    record["exactness"] = exactness(device)
    methods = [("SGN default", lambda m: SGN(m, "mse").step)]
    methods += [(f"Adam lr {lr:g}", _adam(lr)) for lr in args.adam_lrs]
    record["mlp133k"] = timed_fit(device, args.seconds, methods)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
