"""Cost of a PINN's Laplacian: the forward Laplacian against nested differentiation.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/pinns/pinn_operators_cost.py --threads 1
    PYTHONPATH=src python benchmarks/pinns/pinn_operators_cost.py --threads 1 --repeats 21 \\
        --out raw.json

For a tanh MLP 2-64-64-48-48-1 on 900 points, float64 on the CPU, this times the Laplacian
:math:`\\Delta u(x_n)` of every point by three routes, beside the plain value:

* ``model``: the plain value ``u(x)``, for scale;
* ``forward``: :func:`torch_sgn.pinn.operators.laplacian` with ``method="forward"`` (value,
  gradient and Laplacian pushed through the layers);
* ``func``: the same function with ``method="func"``, ``vmap`` of ``jacfwd(jacrev(...))``, i.e.
  ``torch.func.hessian`` of the one-point function;
* ``autograd``: nested ``torch.autograd.grad(create_graph=True)``, one second derivative per
  coordinate, on the whole batch.

each in two modes: ``fwd`` (the Laplacian alone, parameters not requiring gradients) and
``fwd+bwd`` (the Laplacian and the gradient of its mean square with respect to the
parameters). It prints medians over ``--repeats`` interleaved rounds after ``--warmup``, in
milliseconds, and each route's time over the forward Laplacian's.

Result (2-core AMD EPYC shared with other jobs, load average about 8: absolute times are
inflated several-fold and noisy, the ratios less so), torch 2.13, ``--threads 1``; the record
is ``results/2026-11-27_cpu_pinn_operators_cost``::

    mode     route     median ms   x forward
    fwd      model           7.2         0.3
    fwd      forward        25.8         1.0
    fwd      func           77.9         3.0
    fwd      autograd       41.7         1.6
    fwd+bwd  model          18.8         0.2
    fwd+bwd  forward        78.0         1.0
    fwd+bwd  func          183.8         2.4
    fwd+bwd  autograd      108.3         1.4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from torch_sgn.pinn.operators import laplacian

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402


@dataclass(frozen=True)
class Config:
    widths: tuple = (2, 64, 64, 48, 48, 1)
    points: int = 900
    threads: int = 1
    repeats: int = 15
    warmup: int = 3
    seed: int = 0
    out: str = ""


def _mlp(widths: tuple) -> nn.Module:
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def _autograd_laplacian(u: nn.Module, x: Tensor) -> Tensor:
    x = x.detach().requires_grad_(True)
    value = u(x)
    (g,) = torch.autograd.grad(value.sum(), x, create_graph=True)
    lap = 0
    for k in range(x.shape[1]):
        (h,) = torch.autograd.grad(g[:, k].sum(), x, create_graph=True)
        lap = lap + h[:, k : k + 1]
    return lap


ROUTES = {
    "model": lambda u, x: u(x),  # the value alone: the unit of a forward pass
    "forward": lambda u, x: laplacian(u, x, method="forward"),
    "func": lambda u, x: laplacian(u, x, method="func"),
    "autograd": _autograd_laplacian,
}


def _run(route, u: nn.Module, x: Tensor, backward: bool) -> None:
    lap = route(u, x)
    if backward:
        # the last bias does not reach the Laplacian
        torch.autograd.grad(lap.square().mean(), list(u.parameters()), allow_unused=True)


def main(config: Config) -> dict:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    u = _mlp(config.widths)
    x = torch.rand(config.points, config.widths[0], dtype=torch.float64)
    u.requires_grad_(False)
    reference = ROUTES["autograd"](u, x).detach()
    for name, route in list(ROUTES.items())[1:]:
        err = (route(u, x) - reference).abs().max().item()
        assert err < 1e-10, f"{name} disagrees with nested autograd by {err}"
    times = {}
    for backward in (False, True):
        mode = "fwd+bwd" if backward else "fwd"
        u.requires_grad_(backward)
        samples = {name: [] for name in ROUTES}
        for i in range(config.warmup + config.repeats):
            for name, route in ROUTES.items():  # interleaved, so drifting load hits all alike
                start = time.perf_counter()
                _run(route, u, x, backward)
                if i >= config.warmup:
                    samples[name].append(time.perf_counter() - start)
        times[mode] = {name: 1e3 * statistics.median(s) for name, s in samples.items()}
    print(f"{'mode':8} {'route':9} {'median ms':>9}   x forward")
    for mode, row in times.items():
        for name, ms in row.items():
            print(f"{mode:8} {name:9} {ms:9.1f}   {ms / row['forward']:9.1f}")
    record = {
        "config": asdict(config),
        # measuring's environment (python, torch, threads, cpu, commit), and the processor key
        # of the earlier records
        "environment": {
            **environment(),
            "processor": platform.processor() or platform.machine(),
        },
        "median_ms": times,
    }
    if config.out:
        with open(config.out, "w") as f:
            json.dump(record, f, indent=2)
    return record


def _parse() -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for field in fields(Config):
        if field.name == "widths":
            parser.add_argument("--widths", type=int, nargs="+", default=list(field.default))
        else:
            parser.add_argument(f"--{field.name}", type=type(field.default), default=field.default)
    args = vars(parser.parse_args())
    args["widths"] = tuple(args["widths"])
    return Config(**args)


if __name__ == "__main__":
    main(_parse())
