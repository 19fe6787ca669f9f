"""Uphill steps: SGN with ``reject_uphill`` on (the default) and off (``SGN.paper``'s setting).

Two parts, each running both settings side by side from the same weights on the same batches:

* the failure cases: an MLP (5-16-1 tanh, 64 samples) with the L1 loss, whose Gauss-Newton
  matrix is zero (the undamped step is ``-g / damping``), and with MSE at ``lr=1e6``: the
  batch loss at each step, whether the step was taken, its re-solves, solves and loss
  evaluations;
* the cost where steps go downhill: the paper's Boston network (13-100-100-1 sigmoid, batch
  101, float32), default SGN and with ``momentum=0.9``, ``--steps`` steps: steps that went
  uphill without the rule, re-solves and rejected steps with it, the last batch's loss, the
  full training set's loss at the end, and the median CPU seconds per step (the two settings
  alternate step by step).

Not a test: a command of its own (from the repository root)::

    PYTHONPATH=src python benchmarks/convergence/uphill.py --name cpu_uphill

Output: tables and ``record.json`` under ``benchmarks/results/<YYYY-MM-DD>_<name>/``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torch_sgn import SGN
from torch_sgn.experiments import data as datasets
from torch_sgn.experiments.models import mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _l1(outputs, targets):
    return F.l1_loss(outputs, targets)


def failure_cases(steps: int) -> list:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.randn(64, 1, generator=g)
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    rows = []
    for case, loss, options in (("l1_loss", _l1, {}), ("lr_1e6", "mse", {"lr": 1e6})):
        for reject in (False, True):
            model = copy.deepcopy(start)
            opt = SGN(model, loss, reject_uphill=reject, **options)
            infos = [opt.step(x, y) for _ in range(steps)]
            rows.append(
                dict(
                    case=case,
                    reject_uphill=reject,
                    losses=[infos[0].loss] + [i.loss_after for i in infos],
                    taken=[i.taken for i in infos],
                    uphill_resolves=[i.uphill_resolves for i in infos],
                    solves=[i.attempts for i in infos],
                    loss_evals=[i.loss_evals for i in infos],
                )
            )
    return rows


def training_cost(steps: int) -> list:
    d = datasets.boston(dtype=torch.float32)
    batch = 101
    batches = [
        (d.x_train[i : i + batch], d.y_train[i : i + batch])
        for i in range(0, len(d.x_train) - batch + 1, batch)
    ]
    torch.manual_seed(0)
    start = mlp(13, (100, 100), 1)
    rows = []
    for name, options in (("default", {}), ("momentum=0.9", {"momentum": 0.9})):
        settings = (False, True)
        models = [copy.deepcopy(start) for _ in settings]
        opts = [SGN(m, "mse", reject_uphill=r, **options) for m, r in zip(models, settings)]
        infos, seconds = [[], []], [[], []]
        for t in range(steps):  # the two settings alternate, step by step
            x, y = batches[t % len(batches)]
            for k, opt in enumerate(opts):
                begin = time.process_time()
                infos[k].append(opt.step(x, y))
                seconds[k].append(time.process_time() - begin)
        for k, reject in enumerate(settings):
            with torch.no_grad():
                train = float(F.mse_loss(models[k](d.x_train), d.y_train))
            steps_k = infos[k]
            rows.append(
                dict(
                    options=name,
                    reject_uphill=reject,
                    uphill_steps=sum(not i.loss_after <= i.loss for i in steps_k),
                    resolved_steps=sum(i.uphill_resolves > 0 and i.taken for i in steps_k),
                    rejected_steps=sum(not i.taken for i in steps_k),
                    last_batch_loss=steps_k[-1].loss_after,
                    train_loss=train,
                    median_step_s=statistics.median(seconds[k]),
                )
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failure-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="uphill")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    failures = failure_cases(args.failure_steps)
    print("| case | reject_uphill | batch loss at each step | taken | re-solves |")
    print("|---|---|---|---|---|")
    for r in failures:
        losses = " -> ".join(f"{v:.3g}" for v in r["losses"])
        print(
            f"| {r['case']} | {r['reject_uphill']} | {losses} | {r['taken']} | "
            f"{r['uphill_resolves']} |"
        )
    costs = training_cost(args.steps)
    print()
    print(
        "| options | reject_uphill | uphill steps | re-solved | rejected | last batch loss | "
        "train loss | median s/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in costs:
        print(
            f"| {r['options']} | {r['reject_uphill']} | {r['uphill_steps']} | "
            f"{r['resolved_steps']} | {r['rejected_steps']} | {r['last_batch_loss']:.4g} | "
            f"{r['train_loss']:.4g} | {r['median_step_s']:.3g} |"
        )
    commit = environment().get("commit", "")
    out = Path(args.out) / f"{datetime.date.today():%Y-%m-%d}_{args.name}"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "PYTHONPATH=src python benchmarks/convergence/uphill.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": commit,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": args.threads,
        "failure_cases": failures,
        "training_cost": costs,
    }
    (out / "record.json").write_text(json.dumps(record, indent=1))
    print("record:", out / "record.json")


if __name__ == "__main__":
    main()
