"""Wall-clock seconds to reach a train loss: SGN (fast and functional engine) against SGD and Adam.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/convergence/time_to_loss.py --threads 1

For Boston housing and the sine wave (the paper's models, data, batch sizes and init; SGN with
the paper's settings: 10 CG iterations, 10 warm-up steps of 10, damping 1e-4, line search and
trust region on) each optimizer trains for ``--budget`` seconds of optimizer time. After every
epoch the loss on the whole training set is evaluated (not timed). The table gives the seconds
of optimizer time until that loss first falls to the target (``-`` if never within the
budget), the best loss reached and the epochs run. Each run is preceded by one untimed epoch
of the same optimizer on a fresh model (one-time costs: ``torch.func`` set-up, caches). SGD
and Adam run with a few learning rates of the paper's grid; the table keeps every one. One
seed per run (the network init is the paper's fixed one; the batch order is seeded with 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from torch_sgn import SGN
from torch_sgn.experiments import data as datasets
from torch_sgn.experiments.models import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402


@dataclass
class Config:
    datasets: List[str] = field(default_factory=lambda: ["boston", "sine"])
    budget: float = 20.0  # seconds of optimizer time per run
    targets: Dict[str, float] = field(default_factory=lambda: {"boston": 0.012, "sine": 0.05})
    threads: int = 1
    out: str = ""


def _runs() -> List[tuple]:
    sgn = dict(cg_iters=10, warmup_cg_iters=10, warmup_steps=10, solver="cg")
    return [
        ("SGN(10) fast", "sgn", dict(sgn, engine="layerwise")),
        ("SGN(10) functional", "sgn", dict(sgn, engine="functional")),
        (
            "SGN(10) fast, G on 1/4 batch",
            "sgn",
            dict(sgn, engine="layerwise", curvature_fraction=0.25),
        ),
        ("SGD lr 0.1", "sgd", dict(lr=0.1)),
        ("SGD lr 1", "sgd", dict(lr=1.0)),
        ("Adam lr 1e-3", "adam", dict(lr=1e-3)),
        ("Adam lr 1e-2", "adam", dict(lr=1e-2)),
    ]


def train(name: str, kind: str, options: dict, cfg: Config) -> dict:
    ds = datasets.load(name)
    model = PRESETS[name].build()
    batch = PRESETS[name].batch_size
    g = torch.Generator().manual_seed(1)
    if kind == "sgn":
        opt = SGN(model, "mse", **options)

        def step(x, y):
            opt.step(x, y)

    else:
        cls = torch.optim.SGD if kind == "sgd" else torch.optim.Adam
        opt = cls(model.parameters(), **options)

        def step(x, y):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    def train_loss() -> float:
        with torch.no_grad():
            return F.mse_loss(model(ds.x_train), ds.y_train).item()

    target = cfg.targets[name]
    elapsed, epochs, reached = 0.0, 0, None
    best = first = train_loss()
    while elapsed < cfg.budget:
        start = time.perf_counter()
        for x, y in ds.batches(batch, g):
            step(x, y)
        elapsed += time.perf_counter() - start
        epochs += 1
        loss = train_loss()
        if not loss == loss:  # NaN: diverged
            break
        best = min(best, loss)
        if reached is None and loss <= target:
            reached = elapsed
            break
    return {"start": first, "best": best, "seconds_to_target": reached, "epochs": epochs}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=Config().datasets)
    parser.add_argument("--budget", type=float, default=Config().budget)
    parser.add_argument("--threads", type=int, default=Config().threads)
    parser.add_argument("--only", nargs="*", default=[], help="run only these optimizer labels")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    cfg = Config(datasets=args.datasets, budget=args.budget, threads=args.threads, out=args.out)
    torch.set_num_threads(cfg.threads)
    print(
        "command: PYTHONPATH=src python "
        + " ".join(["benchmarks/convergence/time_to_loss.py", *sys.argv[1:]])
    )
    env = environment()
    print(environment_line(env))
    print(f"config: {asdict(cfg)}")
    print("| data (target train loss) | optimizer | s to target | best loss | epochs |")
    print("|---|---|---|---|---|")
    results = []
    for name in cfg.datasets:
        for label, kind, options in _runs():
            if args.only and label not in args.only:
                continue
            train(name, kind, options, Config(budget=1e-9))  # warm-up: one untimed epoch
            r = train(name, kind, options, cfg)
            r.update(data=name, optimizer=label)
            results.append(r)
            s = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.2f}"
            print(
                f"| {name} ({cfg.targets[name]}) | {label} | {s} | {r['best']:.4f} | "
                f"{r['epochs']} |",
                flush=True,
            )
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump({"config": asdict(cfg), "environment": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
