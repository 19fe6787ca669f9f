"""The library's defaults against the paper's configuration on the paper's benchmarks, by epochs.

``SGN(model, loss)`` (``solver="auto"``, the damping floor of the solver that runs) and
``SGN.paper(model, loss)`` (CG with 10 iterations, floor 1e-6) train the same network from the
same initialisation on the same mini-batches; the training and test losses are recorded after
every epoch. Sine (1-20-20-20-1 MLP, 901 parameters) and Boston (13-100-100-1 MLP, 11,601
parameters, batches of 101) are fitted in full; on Fashion-MNIST (LeNet) the defaults take CG, and
the script checks that their steps are the paper's, bit for bit, over ``--fashion-steps`` steps
(skipped when the data is not on disk). A third configuration forces the geodesic acceleration
on (these float32 models take it only when asked).

Command of the recorded run (from the repository root)::

    PYTHONPATH=src python benchmarks/convergence/defaults_by_epochs.py --name defaults_by_epochs

Output: ``record.json`` and ``README.md`` (:func:`report`: the losses at chosen epochs, their
geometric mean over the seeds, and the mean loss over windows of epochs, each against
``SGN.paper``'s) under ``benchmarks/results/<YYYY-MM-DD>_<name>/``. ``--report RECORD`` writes
the report of an existing ``record.json`` beside it, without training.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from torch_sgn import SGN
from torch_sgn.experiments.models import PRESETS
from torch_sgn.experiments.runner import RunConfig, evaluate, load_data

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "paper": SGN.paper,
    "defaults": SGN,
    "geodesic": functools.partial(SGN, geodesic_acceleration=True),
}


def train(preset: str, config: str, epochs: int, seed: int) -> dict:
    """Trains the preset's network with one configuration; losses after every epoch."""
    p = PRESETS[preset]
    data = load_data(RunConfig(preset=preset, epochs=1)).to("cpu", torch.float32)
    model = p.build()
    opt = CONFIGS[config](model, p.loss)
    gen = torch.Generator().manual_seed(seed)
    curve = [evaluate(model, p.loss, data.x_train, data.y_train)[0]]
    test = [evaluate(model, p.loss, data.x_test, data.y_test)[0]]
    solvers, seconds = set(), 0.0
    for _ in range(epochs):
        for x, y in data.batches(p.batch_size, gen):
            start = time.process_time()
            solvers.add(opt.step(x, y).solver)
            seconds += time.process_time() - start
        curve.append(evaluate(model, p.loss, data.x_train, data.y_train)[0])
        test.append(evaluate(model, p.loss, data.x_test, data.y_test)[0])
    return {"train": curve, "test": test, "solvers": sorted(solvers), "cpu_seconds": seconds}


def fashion_identical(steps: int) -> dict:
    """Whether the defaults' first ``steps`` steps on Fashion-MNIST are the paper's."""
    p = PRESETS["fashion_mnist"]
    try:
        data = load_data(RunConfig(preset="fashion_mnist", epochs=1)).to("cpu", torch.float32)
    except (FileNotFoundError, OSError, RuntimeError) as e:
        return {"skipped": str(e)}
    models = [p.build(), p.build()]
    opts = [SGN.paper(models[0], p.loss), SGN(models[1], p.loss)]
    gen = torch.Generator().manual_seed(1)
    infos: list = [[], []]
    for k, (x, y) in enumerate(data.batches(p.batch_size, gen)):
        if k == steps:
            break
        for opt, out in zip(opts, infos):
            out.append(opt.step(x, y))
    same_params = all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))
    return {
        "steps": len(infos[0]),
        "identical_step_infos": infos[0] == infos[1],
        "identical_parameters": same_params,
        "solvers": sorted({i.solver for i in infos[1]}),
        "losses": [i.loss for i in infos[1]],
    }


EPOCHS = (1, 2, 3, 5, 10, 20, 30, 50)
WINDOWS = ((1, 5), (6, 10), (11, 20), (21, 30), (31, 40), (41, 50))


def report(record: dict) -> str:
    """Markdown tables of a record: per preset and loss (train, test), each configuration's
    loss after the epochs of :data:`EPOCHS` for each seed and their geometric mean over the
    seeds, then the mean loss over the epoch windows of :data:`WINDOWS` per seed with its ratio
    to ``SGN.paper``'s on the same seed (below 1: lower than the paper's)."""
    lines = [f"# {record['command']}", ""]
    lines.append(
        f"commit {record['git_commit'][:7]} (dirty: {record['git_dirty']}), torch "
        f"{record['torch']}, {record['threads']} thread(s), {record['platform']}"
    )
    for preset in dict.fromkeys(r["preset"] for r in record["runs"]):
        runs = [r for r in record["runs"] if r["preset"] == preset]
        n = len(runs[0]["train"]) - 1
        epochs = [e for e in EPOCHS if e <= n]
        windows = [(a, b) for a, b in WINDOWS if b <= n]
        for kind in ("train", "test"):
            lines += ["", f"## {preset}, {kind} loss after each epoch", ""]
            lines.append(
                "| configuration | seed | " + " | ".join(f"epoch {e}" for e in epochs) + " |"
            )
            lines.append("|---|---|" + "---|" * len(epochs))
            for config in dict.fromkeys(r["config"] for r in runs):
                mine = [r for r in runs if r["config"] == config]
                for r in mine:
                    cells = " | ".join(f"{r[kind][e]:.3g}" for e in epochs)
                    lines.append(f"| {config} | {r['seed']} | {cells} |")
                gmean = [
                    math.exp(sum(math.log(r[kind][e]) for r in mine) / len(mine)) for e in epochs
                ]
                lines.append(
                    f"| {config} | geometric mean | " + " | ".join(f"{v:.3g}" for v in gmean) + " |"
                )
            lines += [
                "",
                f"## {preset}, mean {kind} loss over epochs (ratio to SGN.paper's, same seed)",
                "",
            ]
            lines.append(
                "| configuration | seed | " + " | ".join(f"{a}-{b}" for a, b in windows) + " |"
            )
            lines.append("|---|---|" + "---|" * len(windows))
            paper = {r["seed"]: r for r in runs if r["config"] == "paper"}
            for r in runs:
                cells = []
                for a, b in windows:
                    mean = sum(r[kind][a : b + 1]) / (b - a + 1)
                    ref = sum(paper[r["seed"]][kind][a : b + 1]) / (b - a + 1)
                    cells.append(
                        f"{mean:.3g}" + ("" if r["config"] == "paper" else f" ({mean / ref:.2f})")
                    )
                lines.append(f"| {r['config']} | {r['seed']} | " + " | ".join(cells) + " |")
    fashion = record.get("fashion_mnist", {})
    lines += ["", f"Fashion-MNIST, the defaults' first steps against SGN.paper's: {fashion}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sine-epochs", type=int, default=50)
    parser.add_argument("--boston-epochs", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--fashion-steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="defaults_by_epochs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--report", metavar="RECORD", help="only write the report of a record")
    args = parser.parse_args(argv)
    if args.report:
        path = Path(args.report)
        (path.parent / "README.md").write_text(report(json.loads(path.read_text())))
        return
    torch.set_num_threads(args.threads)
    runs = []
    for preset, epochs in (("sine", args.sine_epochs), ("boston", args.boston_epochs)):
        for seed in args.seeds:
            for config in CONFIGS:
                r = train(preset, config, epochs, seed)
                runs.append({"preset": preset, "config": config, "seed": seed, **r})
                print(
                    f"{preset} seed {seed} {config:8s} solver {'/'.join(r['solvers'])}: train "
                    f"{r['train'][-1]:.4g} test {r['test'][-1]:.4g} ({r['cpu_seconds']:.1f} s)",
                    flush=True,
                )
    fashion = fashion_identical(args.fashion_steps)
    print("fashion_mnist:", {k: v for k, v in fashion.items() if k != "losses"})
    commit = environment().get("commit", "")
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    out = Path(args.out) / f"{datetime.date.today():%Y-%m-%d}_{args.name}"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "PYTHONPATH=src python benchmarks/convergence/defaults_by_epochs.py "
        + " ".join(sys.argv[1:]),
        "git_commit": commit,
        "git_dirty": dirty,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": args.threads,
        "runs": runs,
        "fashion_mnist": fashion,
    }
    (out / "record.json").write_text(json.dumps(record, indent=1))
    (out / "README.md").write_text(report(record))
    print("record:", out / "record.json")


if __name__ == "__main__":
    main()
