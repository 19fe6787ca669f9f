"""What geodesic acceleration adds to an exact SGN step: seconds per step with and without it.

The sinc network of ``regression.py`` (1-20-1 tanh, batch 1000, MSE), whose steps take the
direct solver through ``G``, and the 3-256-256-256-1 MLP (batch 1000), whose steps solve
through the batch's outputs; float32 and float64. Both optimizers start from the same weights
and step on the same batches; rounds alternate between them (``--steps`` steps each), and the
medians over ``--rounds`` rounds are reported, with their ratio. Not a test: a command of its
own (from the repository root)::

    PYTHONPATH=src python benchmarks/cost/geodesic_cost.py --name cpu_geodesic_cost

Output: a table and ``record.json`` under ``benchmarks/results/<YYYY-MM-DD>_<name>/``.
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
from torch import nn

from torch_sgn import SGN

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _problem(name: str, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "sinc":
        x = torch.rand(1000, 1, generator=g, dtype=dtype) * 2 - 1
        y = torch.sinc(10 * x)
        model = nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 1))
    else:
        x = torch.rand(1000, 3, generator=g, dtype=dtype) * 2 - 1
        a, b, c = x.unbind(1)
        y = (torch.sin(torch.pi * a) * torch.cos(torch.pi * b) + 0.5 * torch.exp(-c * c))[:, None]
        model = nn.Sequential(
            nn.Linear(3, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
            nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1),
        )  # fmt: skip
    return model.to(dtype), x, y


def measure(name: str, dtype: torch.dtype, rounds: int, steps: int) -> dict:
    model, x, y = _problem(name, dtype)
    opts = {
        flag: SGN(copy.deepcopy(model), "mse", solver="direct", geodesic_acceleration=flag)
        for flag in (False, True)
    }
    seconds: dict = {flag: [] for flag in opts}
    accelerated = 0
    solver = set()
    for _ in range(rounds):
        for flag, opt in opts.items():
            start = time.process_time()
            for _ in range(steps):
                info = opt.step(x, y)
                accelerated += flag and info.accelerated
                solver.add(info.solver)
            seconds[flag].append((time.process_time() - start) / steps)
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    return {
        "problem": name,
        "dtype": str(dtype).replace("torch.", ""),
        "solver": sorted(solver),
        "step_s_without": off,
        "step_s_with": on,
        "ratio": on / off,
        "accelerated_steps": accelerated,
        "steps_with": rounds * steps,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="geodesic_cost")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print("| problem | dtype | solver | s/step without | s/step with | ratio | accelerated |")
    print("|---|---|---|---|---|---|---|")
    for name, rounds in (("sinc", args.rounds), ("mlp133k", max(2, args.rounds // 5))):
        for dtype in (torch.float32, torch.float64):
            r = measure(name, dtype, rounds, args.steps)
            rows.append(r)
            print(
                f"| {r['problem']} | {r['dtype']} | {'/'.join(r['solver'])} | "
                f"{r['step_s_without']:.3g} | {r['step_s_with']:.3g} | {r['ratio']:.2f} | "
                f"{r['accelerated_steps']} of {r['steps_with']} |",
                flush=True,
            )
    commit = environment().get("commit", "")
    out = Path(args.out) / f"{datetime.date.today():%Y-%m-%d}_{args.name}"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "PYTHONPATH=src python benchmarks/cost/geodesic_cost.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": commit,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
        "rows": rows,
    }
    (out / "record.json").write_text(json.dumps(record, indent=1))
    print("record:", out / "record.json")


if __name__ == "__main__":
    main()
