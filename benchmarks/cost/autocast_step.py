"""SGN's step under ``torch.autocast`` beside float32: time per step and the loss it reaches.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/cost/autocast_step.py --device cuda --out autocast.json

The paper's CIFAR-10 conv net (conv 32, 64, 64 @3x3; fc 64; 122,570 parameters) and its
Fashion-MNIST LeNet on one fixed batch of random images and labels (``--batch``, default 1000,
the paper's), SGN with its defaults (the layer-wise engine, CG with 10 iterations).
Each precision (float32; bfloat16 autocast; on CUDA also float16 autocast) starts from the same
initialisation and takes ``--steps`` steps on that batch; the rounds interleave the precisions
(one step of each in turn) so that a slow spell falls on all of them. Printed per model and
precision: the median seconds of a step (CUDA synchronised; the first ``--warmup`` steps
excluded), its ratio to float32's, and the batch loss after the steps (the loss computed in
float32 outside autocast). On the CPU, autocast takes bfloat16 alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from torch_sgn import SGN
from torch_sgn.experiments.models import preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402

SHAPES = {"cifar10": (3, 32, 32), "fashion_mnist": (1, 28, 28)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(model_name: str, device: str, batch: int, steps: int, warmup: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *SHAPES[model_name], generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    precisions = {"float32": None, "bfloat16": torch.bfloat16}
    if device == "cuda":
        precisions["float16"] = torch.float16
    runs = {}
    for name in precisions:
        model = preset(model_name).to(device)
        runs[name] = (model, SGN(model, "cross_entropy"), [])
    for _ in range(steps):
        for name, dtype in precisions.items():
            model, opt, times = runs[name]
            _sync(device)
            t = time.perf_counter()
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                opt.step(x, y)
            _sync(device)
            times.append(time.perf_counter() - t)
    out = {}
    for name, (model, _, times) in runs.items():
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(model(x).float(), y))
        out[name] = dict(median_s=statistics.median(times[warmup:]), loss=loss)
    base = out["float32"]["median_s"]
    for row in out.values():
        row["ratio"] = row["median_s"] / base
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    env = environment()
    print(environment_line(env))
    result = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        environment=env, batch=args.batch, steps=args.steps, models={},
    )  # fmt: skip
    for name in args.models:
        rows = run(name, args.device, args.batch, args.steps, args.warmup)
        result["models"][name] = rows
        for precision, row in rows.items():
            print(
                f"{name:14s} {precision:9s} step {1e3 * row['median_s']:8.2f} ms "
                f"({row['ratio']:.2f}x float32)  loss after {args.steps} steps {row['loss']:.4f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
