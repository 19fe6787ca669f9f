"""The traced engine with and without its tangent rules and graph rewrites, side by side.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/ab/traced_ab.py --threads 1 --models resnet_bn transformer lstm

``before`` records the products with PyTorch's own forward-mode rules and runs the recorded
graphs as traced (``torch_sgn.engines.traced.trace.TANGENT_RULES`` and
``torch_sgn.engines.traced.passes.GRAPH_PASSES`` False); ``after`` with the rules of
``torch_sgn.engines.traced.jvp_rules`` and the rewrites (the defaults). ``--flags`` names the
switches of ``torch_sgn.engines.traced.trace`` and ``torch_sgn.engines.traced.passes`` to compare
instead, e.g. ``--flags GRAPH_PASSES`` (the rewrites alone): off in ``before``, on in ``after``,
the others at their defaults. Both compute the same
matrix (the largest relative difference of their products is printed). In every round each
quantity is measured once, in turn: a gradient, each variant's set-up (``lin``), one product
(``Gv``) and a whole SGN step with k CG iterations (``cg_tol=0``, no line search, from the same
point and state each time). Printed: medians in ms and in gradients, and the median and
quartiles over rounds of after / before.

``--before-tree DIR`` compares two versions of the code instead: ``before`` is the package
under ``DIR/src/torch_sgn`` (for example a ``git worktree`` of an earlier commit), loaded
under another name into the same process, ``after`` this tree's; both with their switches
at their defaults::

    git worktree add /tmp/before HEAD~1
    PYTHONPATH=src python benchmarks/ab/traced_ab.py --threads 1 --before-tree /tmp/before
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

import torch_sgn.engines.traced.passes as passes
import torch_sgn.engines.traced.trace as trace
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from measuring import environment, environment_line  # noqa: E402
from old_version import import_old  # noqa: E402
from workloads import batch  # noqa: E402

VARIANTS = {"before": False, "after": True}


FLAGS = ["TANGENT_RULES", "GRAPH_PASSES"]
#: The package name of each --before-tree loaded so far.
_OLD: Dict[str, str] = {}


def _set(flags: List[str], on: bool) -> None:
    """Sets ``flags`` of ``torch_sgn.engines.traced.trace`` and ``.passes`` (read when a model is
    traced) to ``on``."""
    for flag in flags:
        owner = next((m for m in (trace, passes) if hasattr(m, flag)), None)
        if owner is None:
            raise SystemExit(f"the traced engine has no switch {flag}")
        setattr(owner, flag, on)


def _package(tree: str) -> Dict[str, object]:
    """The modules ``measure`` uses, from this process's ``torch_sgn`` where ``tree`` is empty,
    else from the ``torch_sgn`` package under ``tree/src``, loaded beside it
    (:func:`old_version.import_old`)."""
    name = "torch_sgn"
    if tree:
        if not os.path.isfile(os.path.join(tree, "src", "torch_sgn", "__init__.py")):
            raise SystemExit(f"--before-tree: no package at {tree}/src/torch_sgn")
        name = _OLD.get(tree) or _OLD.setdefault(tree, import_old(os.path.join(tree, "src")))
    modules = {
        "traced": "engines.traced.engine",
        "optimizer": "optimizer",
        "functional": "model.flat_model",
        "linearization": "linearization",
        "losses": "losses",
    }
    return {m: importlib.import_module(f"{name}.{path}") for m, path in modules.items()}


def measure(
    name: str, rounds: int, k: int, flags: List[str] = FLAGS, before_tree: str = ""
) -> Dict[str, object]:
    device = torch.device("cpu")
    model, x, y, loss_name = batch(name, device)
    loss = resolve_loss(loss_name)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = FunctionalModel(model).flat()
    v = torch.randn(flat.shape, generator=torch.Generator().manual_seed(1))
    engines, lins, opts, batches = {}, {}, {}, {}
    for variant, on in VARIANTS.items():
        pkg = _package(before_tree if variant == "before" else "")
        if not before_tree:
            _set(flags, on)
        fmodel = pkg["functional"].FunctionalModel(model)
        if model.training:  # both variants draw the same dropout masks: the products compare
            torch.manual_seed(0)
            fmodel.freeze_rng()
        engines[variant] = pkg["traced"].TracedEngine(
            fmodel, pkg["losses"].resolve_loss(loss_name), strict=True
        )
        batches[variant] = pkg["linearization"].Batch(x, y)
        lins[variant] = engines[variant](flat, batches[variant])
        opt = pkg["optimizer"].SGN(
            copy.deepcopy(model), loss_name, cg_iters=k, cg_tol=0.0, line_search=False,
            engine="traced", solver="cg",
        )  # fmt: skip
        opt.step(x, y)  # traces, with this variant's settings
        opts[variant] = (opt, copy.deepcopy(opt.state_dict()))
    _set(flags, True)
    a, b = (lins[variant].ggn_vp(v) for variant in VARIANTS)
    difference = ((a - b).norm() / a.norm()).item()

    def step(variant):
        opt, state = opts[variant]
        opt._fmodel.write(flat)
        opt.load_state_dict(state)
        start = time.perf_counter()
        opt.step(x, y)
        return time.perf_counter() - start

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    tasks = {"grad": lambda: timed(lambda: torch.autograd.grad(loss.value(model(x), y), params))}
    for variant in VARIANTS:
        tasks[f"{variant}/lin"] = lambda e=engines[variant], b=batches[variant]: timed(
            lambda: e(flat, b)
        )
        tasks[f"{variant}/Gv"] = lambda lin=lins[variant]: timed(lambda: lin.ggn_vp(v))
        tasks[f"{variant}/step{k}"] = lambda variant=variant: step(variant)
    times: Dict[str, List[float]] = {t: [] for t in tasks}
    for r in range(rounds + 1):  # the first round warms up
        for t, fn in tasks.items():
            dt = fn()
            if r:
                times[t].append(dt)
    return {"model": name, "k": k, "times_s": times, "relative_difference": difference}


def _quartiles(xs: List[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.3f} ({q[0]:.3f}-{q[2]:.3f})"


def table(results: List[Dict[str, object]]) -> str:
    lines = [
        "| model | quantity | before ms | after ms | before / grad | after / grad "
        "| after / before per round, median (quartiles) |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        times = res["times_s"]
        grad = statistics.median(times["grad"])
        for quantity in ("lin", "Gv", f"step{res['k']}"):
            before, after = times[f"before/{quantity}"], times[f"after/{quantity}"]
            mb, ma = statistics.median(before), statistics.median(after)
            ratios = [a / b for a, b in zip(after, before)]
            lines.append(
                f"| {res['model']} (grad {grad * 1e3:.1f} ms) | {quantity} | {mb * 1e3:.1f} | "
                f"{ma * 1e3:.1f} | {mb / grad:.2f} | {ma / grad:.2f} | {_quartiles(ratios)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet_bn", "transformer", "lstm"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--flags", nargs="+", default=FLAGS)
    parser.add_argument("--before-tree", default="", help="a checkout to compare with")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    print(
        "command: PYTHONPATH=src python " + " ".join(["benchmarks/ab/traced_ab.py", *sys.argv[1:]])
    )
    print(environment_line(env))
    results = []
    for name in args.models:
        results.append(measure(name, args.rounds, args.k, args.flags, args.before_tree))
        print(f"  {name}: relative difference of the products "
              f"{results[-1]['relative_difference']:.1e}", flush=True)  # fmt: skip
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "environment": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
