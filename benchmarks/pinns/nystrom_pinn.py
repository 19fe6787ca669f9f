"""CG on a PINN's damped Gauss-Newton system: plain against the randomized Nystrom preconditioner.

Command (from the repository root; one thread, float64)::

    PYTHONPATH=src python benchmarks/pinns/nystrom_pinn.py --nets 2-64-64-48-48-1 \\
        --out benchmarks/results/<record>

The problem is ``poisson2d`` of ``benchmarks/pinns/pinn.py``:
-Laplace(u) = 2 pi^2 sin(pi x) sin(pi y) on [0, 1]^2, u = 0 on the boundary, 900 interior and
120 boundary points drawn once. The residual vector (interior residuals by the forward Laplacian,
boundary values) is one module's output, weighted so that its mean square is the PINN loss (mean
interior plus mean boundary squared residual); ``G = J^T H J`` is :class:`torch_sgn.GGN` of that
module with the ``"mse"`` loss and zero targets, at a tanh net trained first by
``--adam-steps`` Adam steps.

For damping rho = c trace(G) / P, c in ``--dampings``, the system ``(G + rho I) d = -g`` is
solved by CG to a relative residual ``||r|| <= rtol ||g||`` for each ``--rtols``: plain, and
preconditioned by a Nystrom approximation of each rank in ``--ranks``. Costs are products with
``G`` and CPU seconds (``time.process_time``, one thread); the preconditioner's build (its
``rank`` products, batched, and its factorizations) is reported apart and in the total. One
approximation serves all dampings (it is built once per rank, as an optimizer would rebuild it
every few steps); CG iteration counts are deterministic for a fixed draw, the seconds are the
median of ``--repeats`` runs (one run for plain CG at the two smallest dampings, the long ones).

The build's products loop over columns (``--vmap`` batches them; GGN's products on this model
vmap through a slow batching fallback for ``addmm_``, 5.2 s against 3.6 s looped for rank 100).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List

import torch
from pinn import network  # benchmarks/pinns/pinn.py: the tanh MLPs of the PINN benchmark
from torch import Tensor, nn

from torch_sgn import GGN, conjugate_gradient, nystrom
from torch_sgn.pinn import laplacian

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from measuring import environment  # noqa: E402

D = torch.float64


@dataclass
class Config:
    nets: List[str] = field(default_factory=lambda: ["2-64-64-48-48-1"])
    ranks: List[int] = field(default_factory=lambda: [50, 100, 200, 400])
    dampings: List[float] = field(default_factory=lambda: [1e-4, 1e-6, 1e-8])
    rtols: List[float] = field(default_factory=lambda: [1e-2, 1e-4])
    adam_steps: int = 500
    adam_lr: float = 1e-3
    max_iters: int = 3000
    repeats: int = 3
    seed: int = 0
    chunk_size: int = 50
    vmap: bool = False
    out: str = ""


class PoissonResiduals(nn.Module):
    """The weighted residual vector of the 2-D Poisson PINN: its mean square is the loss."""

    def __init__(self, net: nn.Module, n_interior: int, n_boundary: int):
        super().__init__()
        self.net = net
        m = n_interior + n_boundary
        self.w_interior = math.sqrt(m / n_interior)
        self.w_boundary = math.sqrt(m / n_boundary)

    def forward(self, x_interior: Tensor, x_boundary: Tensor) -> Tensor:
        pi = math.pi
        f = 2 * pi**2 * torch.sin(pi * x_interior[:, :1]) * torch.sin(pi * x_interior[:, 1:2])
        interior = -laplacian(self.net, x_interior) - f
        boundary = self.net(x_boundary)
        return torch.cat([self.w_interior * interior, self.w_boundary * boundary]).reshape(-1)


def points(seed: int) -> tuple:
    """The points of ``benchmarks/pinns/pinn.py``'s ``poisson2d``, drawn the same way."""
    g = torch.Generator().manual_seed(seed)
    x_in = torch.rand(900, 2, generator=g, dtype=D)
    t = torch.rand(120, 1, generator=g, dtype=D)
    side = torch.arange(120) % 4
    zero, one = torch.zeros_like(t), torch.ones_like(t)
    x = torch.where((side == 0)[:, None], zero, torch.where((side == 1)[:, None], one, t))
    y = torch.where((side == 2)[:, None], zero, torch.where((side == 3)[:, None], one, t))
    return x_in, torch.cat([x, y], 1)


def pretrain(model: PoissonResiduals, inputs: tuple, steps: int, lr: float) -> List[float]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ggn_trace(model: PoissonResiduals, inputs: tuple, chunk: int = 64) -> float:
    """trace(G) = (2 / M) ||J||_F^2 for the mean-reduced squared loss, from J's rows."""
    params = dict(model.named_parameters())
    names = list(params)
    out = torch.func.functional_call(model, params, inputs)
    m = out.shape[0]
    total = 0.0
    for start in range(0, m, chunk):
        rows = torch.eye(m, dtype=D)[start : start + chunk]
        grads = torch.autograd.grad(
            out, [params[n] for n in names], rows, is_grads_batched=True, retain_graph=True
        )
        total += sum(float(g.square().sum()) for g in grads)
    return 2.0 * total / m


def timed(fn, repeats: int):
    """``fn()``'s result and the median CPU seconds of ``repeats`` runs."""
    seconds, result = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        result = fn()
        seconds.append(time.process_time() - t0)
    return result, statistics.median(seconds), seconds


def run_net(spec: str, cfg: Config) -> dict:
    x_in, x_bd = points(cfg.seed)
    model = PoissonResiduals(network(spec, 2, cfg.seed), len(x_in), len(x_bd))
    inputs = (x_in, x_bd)
    n = sum(p.numel() for p in model.parameters())
    t0 = time.process_time()
    losses = pretrain(model, inputs, cfg.adam_steps, cfg.adam_lr)
    print(f"{spec}: P={n}, Adam {cfg.adam_steps} steps -> loss {losses[-1]:.3e} "
          f"({time.process_time() - t0:.1f}s)", flush=True)  # fmt: skip
    zeros = torch.zeros(len(x_in) + len(x_bd), dtype=D)
    G = GGN(model, "mse", inputs, zeros)
    b = -G.gradient
    trace = ggn_trace(model, inputs)
    scale = trace / n
    v = torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(1))
    _, product_s, _ = timed(lambda: G @ v, 10)
    print(f"  trace(G)/P = {scale:.3e}, one product {product_s * 1e3:.2f} ms", flush=True)

    record = {
        "net": spec,
        "parameters": n,
        "adam_final_loss": losses[-1],
        "trace_over_p": scale,
        "product_seconds": product_s,
        "plain": [],
        "nystrom": [],
    }
    for c in cfg.dampings:
        rho = c * scale
        for rtol in cfg.rtols:

            def solve(rho=rho, rtol=rtol):
                return conjugate_gradient(
                    lambda u: G @ u + rho * u, b, max_iters=cfg.max_iters, rtol=rtol
                )

            res, sec, all_s = timed(solve, cfg.repeats if c > 1e-6 else 1)
            row = dict(damping=c, rtol=rtol, iterations=res.iterations, reason=res.reason)
            row.update(products=res.iterations, seconds=sec, seconds_all=all_s)
            record["plain"].append(row)
            print(f"  plain   rho={c:.0e} rtol={rtol:.0e}: {res.iterations:5d} it "
                  f"{res.reason:9s} {sec:8.2f}s", flush=True)  # fmt: skip
    for rank in cfg.ranks:
        if rank > n:
            continue

        def build(rank=rank):
            g = torch.Generator().manual_seed(cfg.seed)
            return nystrom(
                lambda u: G @ u, n, rank, b, generator=g, vmap=cfg.vmap, chunk_size=cfg.chunk_size
            )

        approx, build_s, build_all = timed(build, cfg.repeats)
        lam = approx.eigenvalues
        for c in cfg.dampings:
            rho = c * scale
            precondition = approx.preconditioner(rho)
            for rtol in cfg.rtols:

                def solve(rho=rho, rtol=rtol, precondition=precondition):
                    return conjugate_gradient(
                        lambda u: G @ u + rho * u,
                        b,
                        max_iters=cfg.max_iters,
                        rtol=rtol,
                        preconditioner=precondition,
                    )

                res, sec, all_s = timed(solve, cfg.repeats)
                d_eff = float((lam / (lam + rho)).sum())
                row = dict(rank=rank, damping=c, rtol=rtol, iterations=res.iterations)
                row.update(reason=res.reason, build_products=rank, build_seconds=build_s)
                row.update(build_seconds_all=build_all, cg_seconds=sec, cg_seconds_all=all_s)
                row.update(products=rank + res.iterations, seconds=build_s + sec)
                row.update(d_eff_of_approximation=d_eff)
                record["nystrom"].append(row)
                print(f"  nys{rank:4d} rho={c:.0e} rtol={rtol:.0e}: {res.iterations:5d} it "
                      f"{res.reason:9s} build {build_s:6.2f}s + cg {sec:7.2f}s "
                      f"(d_eff~{d_eff:.0f})", flush=True)  # fmt: skip
        record.setdefault("eigenvalues", {})[rank] = lam.tolist()
    return record


def main(argv=None) -> None:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):
            kind = type(value[0]) if value else str
            parser.add_argument(flag, type=kind, nargs="+", default=value)
        elif isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    cfg = Config(**vars(parser.parse_args(argv)))
    torch.set_num_threads(1)
    meta = {
        "config": asdict(cfg),
        "commit": environment().get("commit") or "unknown",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
    }
    results = []
    for spec in cfg.nets:
        results.append(run_net(spec, cfg))
        if cfg.out:
            os.makedirs(cfg.out, exist_ok=True)
            with open(os.path.join(cfg.out, "results.json"), "w") as fh:
                json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
