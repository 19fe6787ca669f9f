"""Output-space Hessian products of a loss callable: forward-over-reverse against double backward.

A loss given as a callable has no closed-form Hessian; its products ``H u`` come from autograd
in output space, by one of two exact routes:

* ``jvp_of_grad``: ``torch.func.jvp(torch.func.grad(loss), (z,), (u,))`` for each product
  (forward-over-reverse);
* ``double_backward``: the graph of ``z -> grad(z)`` recorded once (``create_graph``), then one
  backward pass through it per product (reverse-over-reverse; what ``torch_sgn.losses`` uses).

For each loss and output shape it prints the medians over ``--repeats`` interleaved rounds of
``first`` (set-up plus one product) and ``each`` (one more product, of ``--products``), float32
on the CPU, and ``FAIL`` where a route raises (``F.mse_loss``: forward mode writes into the
targets' zero tangent in place, "ZeroTensors are immutable"). Command (from the repository
root)::

    PYTHONPATH=src python benchmarks/cost/loss_hessian_cost.py --threads 1 \\
        --name cpu_loss_hessian_cost

Result (2-core shared x86 CPU, torch 2.13, 1 thread, record
``results/2026-11-27_cpu_loss_hessian_cost``): ``double_backward`` is 6 to 100 times cheaper per
product than ``jvp_of_grad`` on every loss and shape, and its set-up too; ``jvp_of_grad`` fails
on ``F.mse_loss`` and ``F.huber_loss``.

Output: a table and ``record.json`` under ``benchmarks/results/<YYYY-MM-DD>_<name>/`` (with
``--name``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

LOSSES: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], str]] = {
    "mse_loss": (lambda o, t: F.mse_loss(o, t), "real"),
    "squared_error": (lambda o, t: ((o - t) ** 2).mean(), "real"),
    "cross_entropy": (lambda o, t: F.cross_entropy(o, t), "index"),
    "cross_entropy_smoothed": (lambda o, t: F.cross_entropy(o, t, label_smoothing=0.1), "index"),
    "bce_with_logits": (lambda o, t: F.binary_cross_entropy_with_logits(o, t), "unit"),
    "gaussian_nll": (lambda o, t: F.gaussian_nll_loss(o, t, torch.full_like(t, 0.5)), "real"),
    "poisson_nll": (lambda o, t: F.poisson_nll_loss(o, t), "unit"),
    "kl_div": (lambda o, t: F.kl_div(F.log_softmax(o, 1), t, reduction="batchmean"), "probs"),
    "smooth_l1": (lambda o, t: F.smooth_l1_loss(o, t), "real"),
    "huber": (lambda o, t: F.huber_loss(o, t), "real"),
}
SHAPES = [(256, 10), (4096, 1), (64, 1000)]


def jvp_of_grad(fn, z: Tensor, t: Tensor) -> Callable[[Tensor], Tensor]:
    grad = torch.func.grad(lambda w: fn(w, t))
    return lambda u: torch.func.jvp(grad, (z,), (u,))[1]


def double_backward(fn, z: Tensor, t: Tensor) -> Callable[[Tensor], Tensor]:
    w = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(w, t), w, create_graph=True)
    return lambda u: torch.autograd.grad(g, w, u, retain_graph=True)[0]


ROUTES = {"jvp_of_grad": jvp_of_grad, "double_backward": double_backward}


def _targets(kind: str, n: int, c: int, g: torch.Generator) -> Tensor:
    if kind == "index":
        return torch.randint(0, c, (n,), generator=g)
    if kind == "unit":
        return torch.rand(n, c, generator=g)
    if kind == "probs":
        return torch.softmax(torch.randn(n, c, generator=g), 1)
    return torch.randn(n, c, generator=g)


def _time(route, fn, z, t, us) -> tuple[float, float]:
    start = time.perf_counter()
    product = route(fn, z, t)
    product(us[0])
    first = time.perf_counter()
    for u in us[1:]:
        product(u)
    return first - start, (time.perf_counter() - first) / (len(us) - 1)


def _cell(times) -> str:
    if isinstance(times, str):
        return times
    return f"first {times['first_us']:8.0f} us, each {times['each_us']:7.0f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--products", type=int, default=10)
    parser.add_argument("--name", default=None, help="write a record under benchmarks/results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, c in SHAPES:
        for name, (fn, kind) in LOSSES.items():
            z, t = torch.randn(n, c, generator=g), _targets(kind, n, c, g)
            us = [torch.randn(n, c, generator=g) for _ in range(args.products + 1)]
            times: dict = {}
            for route_name, route in ROUTES.items():
                try:
                    route(fn, z, t)(us[0])  # warm-up, and whether the route works at all
                    times[route_name] = []
                except (RuntimeError, NotImplementedError) as error:
                    times[route_name] = f"FAIL ({str(error).splitlines()[0][:40]})"
            for _ in range(args.repeats):  # rounds interleave the routes
                for route_name, route in ROUTES.items():
                    if isinstance(times[route_name], list):
                        times[route_name].append(_time(route, fn, z, t, us))
            row = {"loss": name, "shape": [n, c]}
            for route_name, got in times.items():
                if isinstance(got, str):
                    row[route_name] = got
                else:
                    row[route_name] = {
                        "first_us": 1e6 * statistics.median(f for f, _ in got),
                        "each_us": 1e6 * statistics.median(e for _, e in got),
                    }
            rows.append(row)
            cells = [_cell(row[r]) for r in ROUTES]
            table = " | ".join(f"{r}: {x}" for r, x in zip(ROUTES, cells))
            print(f"{n}x{c:<5} {name:24s} {table}")
    if args.name:
        out = ROOT / "benchmarks" / "results" / f"{datetime.date.today()}_{args.name}"
        out.mkdir(parents=True, exist_ok=True)
        commit = environment().get("commit", "")
        record = {
            "command": "PYTHONPATH=src python benchmarks/cost/loss_hessian_cost.py "
            f"--threads {args.threads} --repeats {args.repeats} --products {args.products} "
            f"--name {args.name}",
            "commit": commit,
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "threads": args.threads,
            "rows": rows,
        }
        (out / "record.json").write_text(json.dumps(record, indent=1))
        print(f"wrote {out / 'record.json'}")


if __name__ == "__main__":
    main()
