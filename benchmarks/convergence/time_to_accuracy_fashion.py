"""CPU seconds to Fashion-MNIST test accuracies: SGN settings against Adam, AdamW, Muon, SGD.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/convergence/time_to_accuracy_fashion.py \\
        --targets 0.85 0.88 --seeds 0 1 2 --budget 100 --out-dir runs/tta_fashion
    PYTHONPATH=src python benchmarks/convergence/time_to_accuracy_fashion.py \\
        --only "Adam lr 3e-3" --sgn "cg_iters=2,curvature_fraction=0.25" --seeds 0 --budget 60 \\
        --out-dir runs/probe

Result (2-core x86-64 CPU, AMD EPYC, KVM guest, torch 2.13.0+cpu; record
``benchmarks/results/2026-11-27_cpu_time_to_accuracy_fashion_seeds``): Adam lr 1e-2 reaches
88% in 42 CPU s (median of 3 seeds); no SGN setting tried reaches it within 100 s.

The paper's LeNet, data (each image standardised), batch size 1000 (``--batch``). Seed ``s``
draws the initialisation (the paper's Xavier-uniform, seed ``s + 1``) and the batch order
(seed ``s + 1``): seed 0 is the paper's run.

**Time is this process's CPU time** (:func:`time.process_time`, one thread by default) spent
in the optimizer steps only: evaluations, data shuffling and the two untimed steps on a fresh
model that precede each run (one-time costs) are excluded. CPU time, not wall time, so that
other jobs on the machine do not inflate the figures. The test accuracy (all 10,000 images) is
evaluated after the first step that brings the optimizer's clock past each multiple of
``--eval-seconds``; the time to a target is the clock at the first evaluation at or above it.
A run stops when it reaches the highest target or after ``--budget`` CPU seconds.

Each finished run is kept as JSON under ``--out-dir/runs/`` (its settings, the accuracy
history); running the command again skips the runs already there with the same settings, so an
interrupted comparison resumes (``--table-only`` prints the table of the runs kept). The table
gives, per optimizer, the median over seeds of the seconds to each target (a run that misses a
target counts as slower than any that reaches it; "-" where the median misses it), how many
seeds reached it, and the median best accuracy, steps and CPU seconds per step.
``--device cuda`` times with a synchronised device and wall time instead.

Peers: Adam and AdamW over learning rates, SGD, and :class:`torch.optim.Muon` (where the
installed torch has it) on the fully connected layers' 2-D weights, with AdamW on the rest (the
convolutions' 4-D weights and the biases), as Muon's documentation suggests for the
parameters it does not take; Muon scales its step to match AdamW's RMS (``adjust_lr_fn=
"match_rms_adamw"``), so both share one learning rate.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torch_sgn import SGN
from torch_sgn.experiments import data as datasets
from torch_sgn.experiments.models import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402

PAPER_SGN = dict(cg_iters=5, warmup_cg_iters=10, warmup_steps=10, solver="cg")

#: label -> (kind, options).
RUNS = {
    "SGN(5) paper": ("sgn", PAPER_SGN),
    "SGN(5) quadratic": ("sgn", dict(PAPER_SGN, step_rule="quadratic")),
    "SGN(5) functional": ("sgn", dict(PAPER_SGN, engine="functional")),
    "SGN(5) graphs": ("sgn", dict(PAPER_SGN, cuda_graphs=True)),
    "SGD lr 0.1": ("sgd", dict(lr=0.1)),
    "Adam lr 1e-3": ("adam", dict(lr=1e-3)),
    "Adam lr 3e-3": ("adam", dict(lr=3e-3)),
    "Adam lr 1e-2": ("adam", dict(lr=1e-2)),
    "AdamW lr 1e-3": ("adamw", dict(lr=1e-3)),
    "AdamW lr 3e-3": ("adamw", dict(lr=3e-3)),
    "Muon+AdamW lr 3e-3": ("muon", dict(lr=3e-3)),
}
DEFAULT_RUNS = [
    "SGN(5) paper",
    "Adam lr 1e-3",
    "Adam lr 3e-3",
    "Adam lr 1e-2",
    "AdamW lr 3e-3",
    "Muon+AdamW lr 3e-3",
]


def _torch_step(model, opts):
    def step(x, y):
        for opt in opts:
            opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for opt in opts:
            opt.step()

    return step


def _stepper(model, kind, options):
    if kind == "sgn":
        opt = SGN(model, "cross_entropy", **options)
        return lambda x, y: opt.step(x, y)
    if kind == "muon":
        # Muon takes 2-D parameters only: the linear layers' weights. The rest (the
        # convolutions' weights, every bias) go to AdamW.
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        lr = options["lr"]
        muon = torch.optim.Muon(matrices, lr=lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
        return _torch_step(model, [muon, torch.optim.AdamW(rest, lr=lr)])
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return _torch_step(model, [cls(model.parameters(), **options)])


class _Clock:
    """CPU seconds of this process (``cpu``), or wall seconds with the device synchronised."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()


def run(ds, kind, options, seed, args) -> dict:
    """One optimizer, one seed: the accuracy history by optimizer seconds. ``options`` may name
    the run's own ``batch`` size."""
    options = dict(options)
    batch = options.pop("batch", args.batch)
    device = torch.device(args.device)
    preset = PRESETS["fashion_mnist"]
    warm = preset.build("paper", seed + 1).to(device)
    step = _stepper(warm, kind, options)
    for _, (x, y) in zip(range(2), ds.batches(batch, torch.Generator(device).manual_seed(0))):
        step(x, y)

    model = preset.build("paper", seed + 1).to(device)
    step = _stepper(model, kind, options)
    g = torch.Generator(device).manual_seed(seed + 1)
    clock = _Clock(device)

    def accuracy() -> float:
        with torch.no_grad():
            return (model(ds.x_test).argmax(1) == ds.y_test).float().mean().item()

    top = max(args.targets)
    elapsed, steps, next_eval, history, failed = 0.0, 0, args.eval_seconds, [], None
    while elapsed < args.budget:
        for x, y in ds.batches(batch, g):
            start = clock()
            try:
                step(x, y)
            except (RuntimeError, ValueError) as e:  # a diverged run ends, recorded
                failed = f"{type(e).__name__}: {e}"
            elapsed += clock() - start
            steps += 1
            if failed or elapsed >= next_eval or elapsed >= args.budget:
                while next_eval <= elapsed:
                    next_eval += args.eval_seconds
                history.append((round(elapsed, 3), steps, accuracy()))
                if history[-1][2] >= top or failed:
                    break
            if elapsed >= args.budget:
                break
        if failed or (history and history[-1][2] >= top):
            break
    return {"history": history, "steps": steps, "seconds": elapsed, "failed": failed}


def seconds_to(history, target):
    """The optimizer seconds at the first evaluation at or above ``target`` (None: missed)."""
    return next((t for t, _, acc in history if acc >= target), None)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", label).strip("_")


def _parse_sgn(spec: str) -> dict:
    """``"cg_iters=2,curvature_fraction=0.25"`` -> options (values as Python literals)."""
    options = dict()
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return options


def _median(values):
    """Median with misses (None) counted as slower than any hit; None if the median misses."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    n = len(ordered)
    if n % 2:
        return ordered[n // 2]
    lo, hi = ordered[n // 2 - 1], ordered[n // 2]
    return None if lo is None or hi is None else (lo + hi) / 2


def table(records, targets) -> str:
    head = " | ".join(f"s to {t:.0%}" for t in targets)
    lines = [
        f"| optimizer | seeds | {head} | best test acc | steps | CPU s / step |",
        "|---|---|" + "---|" * len(targets) + "---|---|---|",
    ]
    for label, runs in records.items():
        cells = []
        for t in targets:
            times = [seconds_to(r["history"], t) for r in runs]
            m, hits = _median(times), sum(v is not None for v in times)
            cells.append(("-" if m is None else f"{m:.1f}") + f" ({hits}/{len(runs)})")
        best = statistics.median(max((a for _, _, a in r["history"]), default=0) for r in runs)
        steps = statistics.median(r["steps"] for r in runs)
        per_step = statistics.median(r["seconds"] / max(r["steps"], 1) for r in runs)
        lines.append(
            f"| {label} | {len(runs)} | {' | '.join(cells)} | {best:.4f} | {steps:g} | "
            f"{per_step:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", type=float, nargs="+", default=[0.85, 0.88])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--budget", type=float, default=150.0, help="optimizer seconds per run")
    parser.add_argument("--eval-seconds", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=PRESETS["fashion_mnist"].batch_size)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--only", nargs="*", default=None, help=f"these labels of {list(RUNS)} (default: "
        f"{DEFAULT_RUNS}); none with --sgn: the --sgn runs alone",
    )  # fmt: skip
    parser.add_argument(
        "--sgn", nargs="*", default=[], metavar="SPEC",
        help='extra SGN runs, each "option=value,option=value" ("label=..." names it, '
        '"batch=..." sets its batch size)',
    )  # fmt: skip
    parser.add_argument("--out-dir", default="", help="keeps each run's JSON; reruns skip them")
    parser.add_argument(
        "--table-only", action="store_true", help="the table of the runs kept in --out-dir; "
        "runs nothing",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("command: PYTHONPATH=src python " + " ".join(sys.argv))
    env = environment()
    print(environment_line(env))
    print(f"config: {vars(args)}")

    runs = {}
    labels = args.only if args.only is not None else ([] if args.sgn else DEFAULT_RUNS)
    for label in labels:
        if label not in RUNS:
            parser.error(f"--only: unknown label {label!r}; expected some of {list(RUNS)}")
        runs[label] = RUNS[label]
    for spec in args.sgn:
        options = _parse_sgn(spec)
        label = str(options.pop("label", "SGN " + spec))
        runs[label] = ("sgn", options)
    for label, (kind, options) in list(runs.items()):
        if options.get("cuda_graphs") and not args.device.startswith("cuda"):
            del runs[label]  # CUDA graphs need a CUDA device
        if kind == "muon" and not hasattr(torch.optim, "Muon"):
            print(f"skipped {label}: torch {torch.__version__} has no torch.optim.Muon")
            del runs[label]

    if args.table_only and not args.out_dir:
        parser.error("--table-only needs --out-dir")
    ds = (
        None
        if args.table_only
        else datasets.load("fashion_mnist", device=torch.device(args.device))
    )
    out = Path(args.out_dir) / "runs" if args.out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    records = {label: [] for label in runs}
    for seed in args.seeds:
        for label, (kind, options) in runs.items():
            settings = dict(
                label=label, kind=kind, options=options, seed=seed, budget=args.budget,
                stop_at=max(args.targets), eval_seconds=args.eval_seconds, batch=args.batch,
                device=args.device, threads=args.threads,
            )  # fmt: skip
            path = out / f"{_slug(label)}__seed{seed}.json" if out else None
            if path and path.exists():
                kept = json.loads(path.read_text())
                if kept["settings"] == settings:
                    records[label].append(kept["result"])
                    continue
            if args.table_only:
                continue
            result = run(ds, kind, options, seed, args)
            records[label].append(result)
            last = result["history"][-1] if result["history"] else (0, 0, 0.0)
            print(
                f"{label} seed {seed}: acc {last[2]:.4f} after {result['seconds']:.1f} s, "
                f"{result['steps']} steps" + (f" ({result['failed']})" if result["failed"] else ""),
                flush=True,
            )
            if path:
                record = dict(settings=settings, environment=env, result=result)
                path.write_text(json.dumps(record))
    text = table({label: runs for label, runs in records.items() if runs}, sorted(args.targets))
    print(text)
    if args.out_dir:
        (Path(args.out_dir) / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
