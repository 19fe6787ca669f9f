"""One SGN step of two versions of torch-sgn, alternated in one process: an A/B of a change.

Command (from the repository root; OLD is the ``src`` directory of a checkout of the other
version, e.g. made with ``git worktree add /tmp/old <commit>``)::

    PYTHONPATH=src python benchmarks/ab/ab_step.py --old-src /tmp/old/src --model fashion_mnist \
        --k 10 --rounds 20 --threads 2

Timings of a small model on a shared machine drift by tens of percent between runs (for the
conv nets on a CPU mostly through page faults: a step's large buffers go back to the system
and are faulted in again), so comparing two runs made one after the other says little. Here
the old version's package is imported under another name (``torch_sgn_old``) beside the
current one, both build an optimizer on the same paper model and batch, and each round times
one step of each (the order alternating), every step starting from the same parameters and
state. Printed: the median step of each in gradients, and the median and quartiles of the
per-round ratio new / old, which the drift hits alike; also the minor page faults per step.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import resource
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import timed  # noqa: E402
from old_version import import_old  # noqa: E402
from workloads import batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old-src", required=True, help="src directory of the other version")
    parser.add_argument("--model", default="fashion_mnist")
    parser.add_argument("--k", type=int, default=10, help="CG iterations")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command: PYTHONPATH=src python " + " ".join(sys.argv))
    packages = {"old": import_old(args.old_src), "new": "torch_sgn"}
    model, x, y, loss_name = batch(args.model, torch.device("cpu"))
    params = list(model.parameters())
    opts = {}
    for tag, package in packages.items():
        sgn = importlib.import_module(package).SGN(
            copy.deepcopy(model), loss_name, cg_iters=args.k, cg_tol=0.0, line_search=False,
            engine="layerwise", solver="cg",
        )  # fmt: skip
        opts[tag] = (sgn, copy.deepcopy(sgn.state_dict()), sgn._fmodel.flat().clone())
    loss = importlib.import_module("torch_sgn.losses").resolve_loss(loss_name)

    cpu = torch.device("cpu")

    def step(tag: str) -> float:
        sgn, state, flat = opts[tag]
        sgn._fmodel.write(flat)
        sgn.load_state_dict(state)
        return timed(lambda: sgn.step(x, y), cpu)

    times = {"grad": [], "old": [], "new": []}
    faults = {"old": [], "new": []}
    for r in range(args.rounds + 2):  # two rounds of warm-up
        row = {"grad": timed(lambda: torch.autograd.grad(loss.value(model(x), y), params), cpu)}
        for tag in ("old", "new") if r % 2 else ("new", "old"):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            row[tag] = step(tag)
            if r >= 2:
                faults[tag].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        if r >= 2:
            for key, value in row.items():
                times[key].append(value)
    grad = statistics.median(times["grad"])
    print(f"{args.model}, k = {args.k}, {args.threads} thread(s), {args.rounds} rounds:")
    for tag in ("old", "new"):
        med = statistics.median(times[tag])
        print(
            f"  {tag}: step {med * 1e3:.1f} ms = {med / grad:.2f} gradients "
            f"({grad * 1e3:.1f} ms), {statistics.median(faults[tag]):.0f} minor faults per step"
        )
    ratios = [n / o for n, o in zip(times["new"], times["old"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    median = statistics.median(ratios)
    print(f"  new / old per round: median {median:.3f}, quartiles {q1:.3f}-{q3:.3f}")


if __name__ == "__main__":
    main()
