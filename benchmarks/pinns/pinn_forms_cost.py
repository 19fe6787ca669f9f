"""Cost of one SGN step on a physics-informed residual model, by how forward takes derivatives.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/pinns/pinn_forms_cost.py
    PYTHONPATH=src python benchmarks/pinns/pinn_forms_cost.py --forms autograd,hessian \\
        --out rec.json

The problem: the 2-D Poisson equation ``-(u_xx + u_yy) = f`` on the unit square,
``f = 2 pi^2 sin(pi x) sin(pi y)``, ``u = 0`` on the boundary. The network ``u`` is 2-32-32-1
tanh in float64; the batch is 900 interior and 200 boundary points. The model's ``forward(x)``
returns the residuals, Laplacian residuals on the interior points and ``u`` on the boundary
points, and the loss is ``"mse"`` against zeros: the usual PINN written as a residual model.
The forms differ in how ``forward`` takes the Laplacian:

* ``autograd``: ``torch.autograd.grad(..., create_graph=True)`` on ``x.requires_grad_(True)``;
* ``enable_grad``: the same inside ``with torch.enable_grad():`` on a detached copy of ``x``;
* ``hessian``: ``vmap(hessian(u))`` (forward over reverse) of the network;
* ``jacrev``: ``vmap(jacrev(jacrev(u)))`` (reverse over reverse);
* ``jacfwd``: ``vmap(jacfwd(jacrev(u)))``.

For each form and each engine that takes it (``auto``, ``traced``, ``functional``) it builds
``SGN(model, "mse", engine=...)`` with its defaults, runs ``--warmup`` steps, then ``--steps``
steps, and prints the median per step of the wall time (``time.perf_counter``) and of this
thread's CPU time (``time.thread_time``, less sensitive to other jobs on the machine), with
``torch.set_num_threads(1)``. A form an engine cannot run prints the error instead.

Results: one x86_64 CPU core of a machine shared with other jobs (load 5 to 9 on 2 cores, so
wall times are noisy; the thread's CPU time less so), torch 2.13, medians of 10 steps, CPU
milliseconds per step. Before: commit 606c92d (the benchmark alone); after: 7c35bd3.

============  ===================  ===================  ===================
form          auto before / after  traced               functional
============  ===================  ===================  ===================
autograd      fails / 110          fails / 126          fails / 239
enable_grad   90 / 116             127 / 125            fails / 231
hessian       397 (functional) /   fails / 200          474 / 416
              201 (traced)
jacrev        148 / 156            160 / 143            352 / 242
jacfwd        461 (functional) /   fails / 128          509 / 287
              197 (traced)
============  ===================  ===================  ===================

"fails": ``RuntimeError: element 0 of tensors does not require grad`` (the trial points'
forward pass under SGN's ``torch.no_grad``), or ``torch.func.jvp``'s refusal of
``requires_grad_()`` (functional engine), or ``Nested forward mode AD is not supported``
(traced engine). The ``enable_grad`` and ``jacrev`` rows ran the same code before and after:
their differences are the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict

import torch
from torch import Tensor, nn
from torch.func import hessian, jacfwd, jacrev, vmap

from torch_sgn import SGN

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402


@dataclass
class Config:
    forms: str = "autograd,enable_grad,hessian,jacrev,jacfwd"
    engines: str = "auto,traced,functional"
    interior: int = 900
    boundary: int = 200
    width: int = 32
    warmup: int = 3
    steps: int = 10
    threads: int = 1
    seed: int = 0
    out: str = ""


def _source(x: Tensor) -> Tensor:
    return 2 * math.pi**2 * torch.sin(math.pi * x[:, 0]) * torch.sin(math.pi * x[:, 1])


def _laplacian_autograd(net: nn.Module, x: Tensor) -> Tensor:
    x = x.requires_grad_(True)
    u = net(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (dux,) = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
    (duy,) = torch.autograd.grad(du[:, 1].sum(), x, create_graph=True)
    return dux[:, 0] + duy[:, 1]


def _laplacian_enable_grad(net: nn.Module, x: Tensor) -> Tensor:
    with torch.enable_grad():
        return _laplacian_autograd(net, x.detach())


def _transform(second: Callable) -> Callable[[nn.Module, Tensor], Tensor]:
    def laplacian(net: nn.Module, x: Tensor) -> Tensor:
        h = vmap(second(lambda p: net(p).squeeze(-1)))(x)
        return h[:, 0, 0] + h[:, 1, 1]

    return laplacian


LAPLACIANS: Dict[str, Callable[[nn.Module, Tensor], Tensor]] = {
    "autograd": _laplacian_autograd,
    "enable_grad": _laplacian_enable_grad,
    "hessian": _transform(hessian),
    "jacrev": _transform(lambda f: jacrev(jacrev(f))),
    "jacfwd": _transform(lambda f: jacfwd(jacrev(f))),
}


class Poisson(nn.Module):
    """Interior residuals ``-lap u - f`` on the first ``interior`` points, ``u`` on the rest."""

    def __init__(self, laplacian: Callable, interior: int, width: int):
        super().__init__()
        self.laplacian, self.interior = laplacian, interior
        self.net = nn.Sequential(
            nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
            nn.Linear(width, 1),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        inside, edge = x[: self.interior], x[self.interior :]
        residual = -self.laplacian(self.net, inside) - _source(inside)
        return torch.cat([residual, self.net(edge).squeeze(-1)])


def _points(cfg: Config) -> Tensor:
    g = torch.Generator().manual_seed(cfg.seed)
    inside = torch.rand(cfg.interior, 2, generator=g, dtype=torch.float64)
    t = torch.rand(cfg.boundary, generator=g, dtype=torch.float64)
    side = torch.arange(cfg.boundary) % 4
    edge = torch.stack([t, (side % 2).to(torch.float64)], 1)  # y = 0 or y = 1
    edge = torch.where((side >= 2)[:, None], edge.flip(1), edge)  # x = 0 or x = 1
    return torch.cat([inside, edge])


def measure(form: str, engine: str, cfg: Config) -> dict:
    torch.manual_seed(cfg.seed)
    model = Poisson(LAPLACIANS[form], cfg.interior, cfg.width).double()
    x = _points(cfg)
    zeros = torch.zeros(len(x), dtype=torch.float64)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = SGN(model, "mse", engine=engine)
            for _ in range(cfg.warmup):
                first = opt.step(x, zeros)
    except Exception as error:  # noqa: BLE001 - the engine cannot run this form: report it
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    wall, cpu = [], []
    for _ in range(cfg.steps):
        w0, c0 = time.perf_counter(), time.thread_time()
        info = opt.step(x, zeros)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {
        "wall_ms": 1e3 * statistics.median(wall),
        "cpu_ms": 1e3 * statistics.median(cpu),
        "loss_first": first.loss,
        "loss_last": info.loss_after,
        "warnings": sorted({str(w.message)[:160] for w in caught}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(Config()).items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    cfg = Config(**vars(parser.parse_args()))
    torch.set_num_threads(cfg.threads)
    commit = environment().get("commit", "")
    header = dict(
        torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
        processor=platform.processor(), threads=torch.get_num_threads(), commit=commit,
        config=asdict(cfg),
    )  # fmt: skip
    print(json.dumps(header))
    results: Dict[str, dict] = {}
    for form in cfg.forms.split(","):
        for engine in cfg.engines.split(","):
            row = results[f"{form}/{engine}"] = measure(form, engine, cfg)
            if "error" in row:
                print(f"{form:12s} {engine:11s} fails: {row['error']}")
                continue
            print(
                f"{form:12s} {engine:11s} wall {row['wall_ms']:8.1f} ms  cpu "
                f"{row['cpu_ms']:8.1f} ms  loss {row['loss_first']:.4g} -> "
                f"{row['loss_last']:.4g}"
            )
            for message in row["warnings"]:
                print(f"{'':25s} warns: {message}")
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(dict(header, results=results), f, indent=1)


if __name__ == "__main__":
    main()
