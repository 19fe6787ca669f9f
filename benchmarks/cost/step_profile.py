"""Where one SGN step's time goes: set-up, products, trial loss, CG's vector work, the rest.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/cost/step_profile.py --threads 1 \\
        --models resnet_bn transformer lstm
    PYTHONPATH=src python benchmarks/cost/step_profile.py --device cuda \\
        --engines traced traced_graphs

On CUDA each timed part synchronises the device before and after (its kernels are counted in
it). The engines are named as in ``ggn_cost.py`` (``traced_graphs``: the traced engine with
``cuda_graphs=True``; ``traced_compiled``: with ``compile=True``).

For each model of ``benchmarks/cost/ggn_cost.py`` and each engine it runs ``--rounds`` SGN steps
with ``k`` CG iterations (``cg_tol=0``, no line search, trust region on: one trial loss), each
from the same point and state, with a plain gradient before each as the unit. Around the
engine's set-up (``lin``), every ``G v`` product, the trial-point loss and the CG solve it
reads ``time.perf_counter`` and the process's minor page faults (``getrusage``: memory the
allocator took fresh from the system, which on Linux is zero-filled page by page). Printed,
in gradients per step (medians over rounds): each part, CG's work besides its products and
what the step spends outside all of these; with the page faults of one gradient, one set-up
and one product.

On glibc, large blocks freed at the top of the heap are returned to the system and faulted
in again at the next allocation; ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
(environment variables read at start-up) keep them, which shows what the faults cost.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

import torch_sgn.solve.core as core
import torch_sgn.stepper as stepper
from torch_sgn import SGN
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402
from workloads import batch, engine_options  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Meter:
    """Times and page faults of the wrapped calls, per part, within the current step."""

    def __init__(self, device: torch.device) -> None:
        self.time: Dict[str, float] = {}
        self.faults: Dict[str, List[int]] = {}
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            self.sync()
            f0, t0 = _faults(), time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.time[part] = self.time.get(part, 0.0) + time.perf_counter() - t0
            self.faults.setdefault(part, []).append(_faults() - f0)
            return out

        return timed


def measure(name: str, engine: str, k: int, rounds: int, device: torch.device) -> Dict[str, object]:
    model, x, y, loss_name = batch(name, device)
    loss = resolve_loss(loss_name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = SGN(
        copy.deepcopy(model),
        loss_name,
        cg_iters=k,
        cg_tol=0.0,
        line_search=False,
        solver="cg",
        **engine_options(engine),
    )
    flat = FunctionalModel(model).flat()
    meter = _Meter(device)
    inner = opt._stepper.engine

    def engine_call(*args, **kwargs):
        lin = meter.wrap("lin", inner)(*args, **kwargs)
        lin.ggn_vp = meter.wrap("Gv", lin.ggn_vp)
        return lin

    opt._stepper.engine = engine_call
    loss_at, solve = stepper.Stepper._loss_at, core.conjugate_gradient
    stepper.Stepper._loss_at = meter.wrap("trial", loss_at)
    core.conjugate_gradient = meter.wrap("cg", solve)
    try:
        opt.step(x, y)  # traces
        state = copy.deepcopy(opt.state_dict())
        rows: Dict[str, List[float]] = {}
        for r in range(rounds + 1):  # the first round warms up
            meter.sync()
            f0, t0 = _faults(), time.perf_counter()
            torch.autograd.grad(loss.value(model(x), y), params)
            meter.sync()
            grad, grad_faults = time.perf_counter() - t0, _faults() - f0
            opt._fmodel.write(flat)
            opt.load_state_dict(state)
            meter.time.clear()
            meter.faults.clear()
            meter.sync()
            t0 = time.perf_counter()
            opt.step(x, y)
            meter.sync()
            step = time.perf_counter() - t0
            if not r:
                continue
            part = {p: meter.time.get(p, 0.0) / grad for p in ("lin", "Gv", "trial", "cg")}
            row = {"grad_ms": grad * 1e3, "step": step / grad, **part}
            row["cg_vectors"] = part["cg"] - part["Gv"]
            row["rest"] = row["step"] - part["lin"] - part["cg"] - part["trial"]
            row["faults_grad"] = grad_faults
            row["faults_lin"] = sum(meter.faults["lin"])
            row["faults_Gv"] = statistics.median(meter.faults["Gv"])
            for key, value in row.items():
                rows.setdefault(key, []).append(value)
    finally:
        stepper.Stepper._loss_at, core.conjugate_gradient = loss_at, solve
    return {"model": name, "engine": engine, "k": k, "rounds": rows}


COLUMNS = ["grad_ms", "step", "lin", "Gv", "trial", "cg_vectors", "rest"]
FAULTS = ["faults_grad", "faults_lin", "faults_Gv"]


def table(results: List[Dict[str, object]]) -> str:
    head = ["model", "engine", "grad ms", "step k", "set-up", "k products", "trial loss"]
    head += ["CG vectors", "rest", "page faults: grad / set-up / product"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        med = {key: statistics.median(v) for key, v in res["rounds"].items()}
        row = [res["model"], f"{res['engine']} (k={res['k']})", f"{med['grad_ms']:.1f}"]
        row += [f"{med[c]:.2f}" for c in COLUMNS[1:]]
        row.append(" / ".join(f"{med[c]:.0f}" for c in FAULTS))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet_bn", "transformer", "lstm"])
    parser.add_argument("--engines", nargs="+", default=["traced"])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    command = " ".join(["benchmarks/cost/step_profile.py", *sys.argv[1:]])
    print(f"command: PYTHONPATH=src python {command}")
    print(environment_line(env))
    results = []
    for name in args.models:
        for engine in args.engines:
            results.append(measure(name, engine, args.k, args.rounds, torch.device(args.device)))
            print(f"  measured {name} / {engine}", file=sys.stderr, flush=True)
    print("medians over rounds, in gradients per step (page faults: per call)")
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "environment": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
