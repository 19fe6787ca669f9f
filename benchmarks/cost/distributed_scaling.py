"""Step time of data-parallel SGN with 1 and 2 processes (gloo, CPU), same global batch.

Command (repository root):

    PYTHONPATH=src python benchmarks/cost/distributed_scaling.py [--steps 20] [--repeats 3]

For each workload it launches, alternately and ``--repeats`` times, one process with one thread
and two processes with one thread each (``torchrun --nproc-per-node 2``, each on half of every
batch). Each run times ``--steps`` SGN steps after 3 warm-up
steps (rank 0's wall clock per step; the steps' collectives synchronise the ranks) and, with 2
processes, 200 all-reduces of the parameter vector and of one scalar. Reports the medians over
steps and repeats, and the ratio of the 1-process to the 2-process median (> 1: faster on 2).
Results, config, versions and the git commit go to ``--out`` (default
``distributed_scaling.json`` in the current directory).

Hardware: whatever runs it. The numbers in docs/DISTRIBUTED.md are the record
benchmarks/results/2026-11-26_cpu_distributed_scaling/ (a 2-core x86 CPU, torch 2.13.0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Workload:
    name: str
    preset: str  # torch_sgn.experiments.models preset (its architecture and loss)
    batch: int  # global batch; each of W ranks gets batch / W
    cg_iters: int = 10


WORKLOADS = [Workload("sine-mlp-b1000", "sine", 1000), Workload("mnist-mlp-b1000", "mnist", 1000)]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torch_sgn import SGN
    from torch_sgn.distributed import init_from_env, is_main_process, shard, world_size
    from torch_sgn.experiments.models import PRESETS

    init_from_env(timeout=120)
    torch.set_num_threads(args.threads)
    work = next(w for w in WORKLOADS if w.name == args.workload)
    preset = PRESETS[work.preset]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(work.batch, *preset.input_shape, generator=g)
    if preset.loss == "mse":
        y = torch.sin(3 * x.reshape(work.batch, -1)[:, :1])
    else:
        y = torch.randint(0, 10, (work.batch,), generator=g)
    model = preset.build()
    opt = SGN(model, preset.loss, cg_iters=work.cg_iters, cg_tol=0.0, solver="cg")
    xs, ys = shard(x, y)
    times, evals = [], []
    for i in range(3 + args.steps):
        start = time.perf_counter()
        info = opt.step(xs, ys)
        if i >= 3:
            times.append(time.perf_counter() - start)
            evals.append(info.loss_evals)
    result = dict(step_s=times, loss_evals=evals, world=world_size(), threads=args.threads)
    if world_size() > 1:
        n = sum(p.numel() for p in model.parameters())
        for name, size in (("allreduce_params_s", n), ("allreduce_scalar_s", 1)):
            t = torch.zeros(size)
            dist.all_reduce(t)
            start = time.perf_counter()
            for _ in range(200):
                dist.all_reduce(t)
            result[name] = (time.perf_counter() - start) / 200
        result["params"] = n
    if is_main_process():
        Path(args.out).write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workload: str, procs: int, threads: int, steps: int, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    tail = [__file__, "--worker", "--workload", workload, "--threads", str(threads)]
    tail += ["--steps", str(steps), "--out", str(out)]
    if procs == 1:
        cmd = [sys.executable, *tail]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *tail]
    subprocess.run(cmd, env=env, check=True, timeout=600, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default=WORKLOADS[0].name)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--procs", default="1,2", help="process counts, the first the baseline")
    parser.add_argument("--out", default="distributed_scaling.json")
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
    from measuring import environment

    counts = [int(c) for c in args.procs.split(",")]
    configs = [(f"{c} proc{'s' if c > 1 else ''} x 1 thread", c, 1) for c in counts]
    scratch = Path(args.out).with_suffix(".run.json")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    report = dict(
        command="PYTHONPATH=src python benchmarks/cost/distributed_scaling.py "
        f"--steps {args.steps} --repeats {args.repeats} --procs {args.procs}",
        workloads=[asdict(w) for w in WORKLOADS],
        torch=torch.__version__,
        python=platform.python_version(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        commit=environment().get("commit", ""),
        results={},
    )
    for work in WORKLOADS:
        runs: dict = {label: [] for label, _, _ in configs}
        for _ in range(args.repeats):  # interleaved, so that drift in the load hits all alike
            for label, procs, threads in configs:
                runs[label].append(launch(work.name, procs, threads, args.steps, scratch))
        summary = {}
        for label, results in runs.items():
            steps = [t for r in results for t in r["step_s"]]
            medians = [statistics.median(r["step_s"]) for r in results]
            summary[label] = dict(
                median_step_ms=1e3 * statistics.median(steps),
                run_medians_ms=[1e3 * m for m in medians],
                loss_evals_per_step=statistics.mean(e for r in results for e in r["loss_evals"]),
            )
            if "allreduce_params_s" in results[0]:
                for key in ("allreduce_params_s", "allreduce_scalar_s"):
                    summary[label][key[:-2] + "_us"] = 1e6 * statistics.median(
                        r[key] for r in results
                    )
                summary[label]["params"] = results[0]["params"]
        base = summary[configs[0][0]]["median_step_ms"]
        for label, procs, _ in configs[1:]:
            ratio = base / summary[label]["median_step_ms"]
            summary[f"speedup_{procs}_procs_over_{counts[0]}"] = ratio
        report["results"][work.name] = summary
        print(work.name, json.dumps(summary, indent=1))
    scratch.unlink(missing_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("written to", args.out)


if __name__ == "__main__":
    main()
