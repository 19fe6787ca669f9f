"""Seconds to a Fashion-MNIST test accuracy: SGN(5) (fast, graphs, functional), SGD, Adam.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/time_to_accuracy_fashion.py --threads 1 --budget 90
    PYTHONPATH=src python benchmarks/time_to_accuracy_fashion.py --device cuda --budget 30

The paper's LeNet, data (each image standardised), batch size 1000 and init; SGN(5) with the
paper's settings (10 warm-up steps of 10 CG iterations, damping 1e-4, line search and trust
region). Each optimizer trains for ``--budget`` seconds of optimizer time; every
``--eval-every`` steps the test accuracy is evaluated (not timed). Printed: seconds until the
test accuracy first reaches ``--target``, the best accuracy and the steps run. Two untimed
steps on a fresh model precede each run (one-time costs). One seed (batch order seeded 1).
With ``--device cuda`` the whole data set lives on the GPU and the device is synchronised
around every timed step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from torch_sgn import SGN
from torch_sgn.experiments import data as datasets
from torch_sgn.experiments.models import PRESETS

RUNS = [
    (
        "SGN(5) fast",
        "sgn",
        dict(cg_iters=5, warmup_cg_iters=10, warmup_steps=10, engine="layerwise"),
    ),
    (
        "SGN(5) graphs",
        "sgn",
        dict(cg_iters=5, warmup_cg_iters=10, warmup_steps=10, engine="layerwise", cuda_graphs=True),
    ),
    (
        "SGN(5) functional",
        "sgn",
        dict(cg_iters=5, warmup_cg_iters=10, warmup_steps=10, engine="functional"),
    ),
    ("SGD lr 0.1", "sgd", dict(lr=0.1)),
    ("Adam lr 1e-3", "adam", dict(lr=1e-3)),
]


def _stepper(model, kind, options):
    if kind == "sgn":
        opt = SGN(model, "cross_entropy", **options)
        return lambda x, y: opt.step(x, y)
    opt = (torch.optim.SGD if kind == "sgd" else torch.optim.Adam)(model.parameters(), **options)

    def step(x, y):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(ds, kind, options, args) -> dict:
    batch = PRESETS["fashion_mnist"].batch_size
    device = torch.device(args.device)
    warm = PRESETS["fashion_mnist"].build().to(device)
    step = _stepper(warm, kind, options)
    for _, (x, y) in zip(range(2), ds.batches(batch, torch.Generator(device).manual_seed(0))):
        step(x, y)

    model = PRESETS["fashion_mnist"].build().to(device)
    step = _stepper(model, kind, options)
    g = torch.Generator(device).manual_seed(1)

    def accuracy() -> float:
        with torch.no_grad():
            return (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()

    elapsed, steps, best, reached = 0.0, 0, 0.0, None
    while elapsed < args.budget and reached is None:
        for x, y in ds.batches(batch, g):
            _sync(device)
            start = time.perf_counter()
            step(x, y)
            _sync(device)
            elapsed += time.perf_counter() - start
            steps += 1
            if steps % args.eval_every == 0:
                acc = accuracy()
                best = max(best, acc)
                if acc >= args.target:
                    reached = elapsed
                    break
            if elapsed >= args.budget:
                break
    return {"seconds_to_target": reached, "best_acc": best, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=90.0)
    parser.add_argument("--target", type=float, default=0.80)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="*", default=[], help="run only these optimizer labels")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command: PYTHONPATH=src python " + " ".join(sys.argv))
    hardware = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else ""
    print(f"torch={torch.__version__}, threads={args.threads}, {hardware} config: {vars(args)}")
    ds = datasets.load("fashion_mnist", device=torch.device(args.device))
    print(f"| optimizer | s to {args.target:.0%} test acc | best test acc | steps |")
    print("|---|---|---|---|")
    results = []
    for label, kind, options in RUNS:
        if args.only and label not in args.only:
            continue
        if options.get("cuda_graphs") and not args.device.startswith("cuda"):
            continue  # CUDA graphs need a CUDA device
        r = run(ds, kind, options, args)
        r["optimizer"] = label
        results.append(r)
        s = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        print(f"| {label} | {s} | {r['best_acc']:.4f} | {r['steps']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
