"""NIST StRD nonlinear regression: torch_sgn.fitting beside scipy's lm and trf.

Command (from the repository root; one thread, float64)::

    PYTHONPATH=src python benchmarks/convergence/nist_strd.py --repeats 3 --tol 1e-15 \\
        --methods sgn,sgn-optimizer,lm,trf --out benchmarks/results/2026-11-28_cpu_nist_strd_lean

The 27 problems' ``.dat`` files (certified values, two starts, data) come from ``--data DIR``,
else from the lmfit source distribution unpacked under ``~/.cache/torch_sgn/``, which holds
them in its ``NIST_STRD`` folder::

    pip download --no-binary :all: --no-deps lmfit -d ~/.cache/torch_sgn
    tar xzf ~/.cache/torch_sgn/lmfit-*.tar.gz -C ~/.cache/torch_sgn

Every problem runs from both starts with each method at the tolerances ``xtol = ftol = gtol =
--tol`` (default 1e-8, the defaults of both; 1e-15 asks for all the digits float64 holds):
``sgn`` (:func:`torch_sgn.fitting.least_squares`, parameters an ``nn.Module`` of scalar
``nn.Parameter`` s, options ``--sgn-options``; its steps run through
:mod:`torch_sgn.curve_steps`), ``sgn-optimizer`` (the same fit posed as a
:class:`~torch_sgn.pinn.Residuals` problem, whose steps run through :class:`~torch_sgn.SGN`
itself: what ``curve_steps`` saves per step), ``lm`` and ``trf``
(``scipy.optimize.least_squares``, Jacobians by finite differences as a user calls it).
Reported per fit: digits of agreement with the certified parameters (the log relative error
``-log10 |b - c| / |c|``, the minimum over parameters, capped at 11), the status, steps
(scipy: Jacobian evaluations), residual evaluations as each method counts them (scipy's
``nfev``, which leaves out the calls of its finite-difference Jacobians), calls of the
residual function (every call: scipy's finite differences, SGN's ``J`` by one call on broadcast
copies, its checks at the start) and the CPU seconds of one fit (median of
``--repeats``, the methods taking turns within each round; after one warm-up fit of the first
problem); the summary gives each method's total CPU time against scipy lm's. With
``--old-src DIR`` (the ``src`` directory of another checkout) the method ``sgn-old`` fits by
that version's ``least_squares``, taking turns with the others: an A/B of a change in one run.
Result (shared 2-core CPU, one thread): see
``benchmarks/results/2026-11-28_cpu_nist_strd_lean/README.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch
from torch import nn

from torch_sgn.fitting import least_squares
from torch_sgn.pinn import Residual, Residuals

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402
from old_version import import_old  # noqa: E402

#: ``least_squares`` of the version ``--old-src`` names (method ``sgn-old``).
OLD: Dict[str, Callable] = {}

PI = math.pi

# The model lines of the .dat files, as functions of the parameters b (indexable, b[0] is b1),
# the predictors x (x[0] is x, or x1) and the array module xp (torch or numpy).
MODELS: Dict[str, Callable] = {
    "Misra1a": lambda b, x, xp: b[0] * (1 - xp.exp(-b[1] * x[0])),
    "Chwirut2": lambda b, x, xp: xp.exp(-b[0] * x[0]) / (b[1] + b[2] * x[0]),
    "Chwirut1": lambda b, x, xp: xp.exp(-b[0] * x[0]) / (b[1] + b[2] * x[0]),
    "Lanczos3": lambda b, x, xp: _lanczos(b, x[0], xp),
    "Gauss1": lambda b, x, xp: _gauss(b, x[0], xp),
    "Gauss2": lambda b, x, xp: _gauss(b, x[0], xp),
    "DanWood": lambda b, x, xp: b[0] * x[0] ** b[1],
    "Misra1b": lambda b, x, xp: b[0] * (1 - (1 + b[1] * x[0] / 2) ** (-2)),
    "Kirby2": lambda b, x, xp: (
        (b[0] + b[1] * x[0] + b[2] * x[0] ** 2) / (1 + b[3] * x[0] + b[4] * x[0] ** 2)
    ),
    "Hahn1": lambda b, x, xp: _rational_cubic(b, x[0]),
    # log[y] = b1 - b2*x1 * exp[-b3*x2]: the response is log(y) (see RESPONSES)
    "Nelson": lambda b, x, xp: b[0] - b[1] * x[0] * xp.exp(-b[2] * x[1]),
    "MGH17": lambda b, x, xp: b[0] + b[1] * xp.exp(-x[0] * b[3]) + b[2] * xp.exp(-x[0] * b[4]),
    "Lanczos1": lambda b, x, xp: _lanczos(b, x[0], xp),
    "Lanczos2": lambda b, x, xp: _lanczos(b, x[0], xp),
    "Gauss3": lambda b, x, xp: _gauss(b, x[0], xp),
    "Misra1c": lambda b, x, xp: b[0] * (1 - (1 + 2 * b[1] * x[0]) ** (-0.5)),
    "Misra1d": lambda b, x, xp: b[0] * b[1] * x[0] * ((1 + b[1] * x[0]) ** (-1)),
    "Roszman1": lambda b, x, xp: b[0] - b[1] * x[0] - xp.arctan(b[2] / (x[0] - b[3])) / PI,
    "ENSO": lambda b, x, xp: (
        b[0]
        + b[1] * xp.cos(2 * PI * x[0] / 12)
        + b[2] * xp.sin(2 * PI * x[0] / 12)
        + b[4] * xp.cos(2 * PI * x[0] / b[3])
        + b[5] * xp.sin(2 * PI * x[0] / b[3])
        + b[7] * xp.cos(2 * PI * x[0] / b[6])
        + b[8] * xp.sin(2 * PI * x[0] / b[6])
    ),
    "MGH09": lambda b, x, xp: b[0] * (x[0] ** 2 + x[0] * b[1]) / (x[0] ** 2 + x[0] * b[2] + b[3]),
    "Thurber": lambda b, x, xp: _rational_cubic(b, x[0]),
    "BoxBOD": lambda b, x, xp: b[0] * (1 - xp.exp(-b[1] * x[0])),
    "Rat42": lambda b, x, xp: b[0] / (1 + xp.exp(b[1] - b[2] * x[0])),
    "MGH10": lambda b, x, xp: b[0] * xp.exp(b[1] / (x[0] + b[2])),
    "Eckerle4": lambda b, x, xp: (b[0] / b[1]) * xp.exp(-0.5 * ((x[0] - b[2]) / b[1]) ** 2),
    "Rat43": lambda b, x, xp: b[0] / ((1 + xp.exp(b[1] - b[2] * x[0])) ** (1 / b[3])),
    "Bennett5": lambda b, x, xp: b[0] * (b[1] + x[0]) ** (-1 / b[2]),
}
RESPONSES = {"Nelson": "log"}  # fitted to log(y)


def _lanczos(b, x, xp):
    return b[0] * xp.exp(-b[1] * x) + b[2] * xp.exp(-b[3] * x) + b[4] * xp.exp(-b[5] * x)


def _gauss(b, x, xp):
    return (
        b[0] * xp.exp(-b[1] * x)
        + b[2] * xp.exp(-((x - b[3]) ** 2) / b[4] ** 2)
        + b[5] * xp.exp(-((x - b[6]) ** 2) / b[7] ** 2)
    )


def _rational_cubic(b, x):
    return (b[0] + b[1] * x + b[2] * x**2 + b[3] * x**3) / (
        1 + b[4] * x + b[5] * x**2 + b[6] * x**3
    )


@dataclass(frozen=True)
class Problem:
    name: str
    starts: List[List[float]]  # two
    certified: List[float]
    y: np.ndarray  # the response (log y for Nelson)
    x: np.ndarray  # predictors, (k, n)


def read_problem(path: Path) -> Problem:
    """Starting and certified values from the ``b_i = start1 start2 certified sd`` lines, and
    the data from the rows after the last ``Data:`` line (response first)."""
    lines = path.read_text().splitlines()
    starts, certified = [[], []], []
    for line in lines:
        m = re.match(r"\s*b\d+\s*=\s*(.*)", line)
        if m:
            values = [float(v) for v in m.group(1).split()]
            starts[0].append(values[0])
            starts[1].append(values[1])
            certified.append(values[2])
    last = max(i for i, line in enumerate(lines) if line.strip().startswith("Data:"))
    rows = [[float(v) for v in line.split()] for line in lines[last + 1 :] if line.strip()]
    data = np.array(rows, dtype=np.float64)
    y = data[:, 0]
    if RESPONSES.get(path.stem) == "log":
        y = np.log(y)
    return Problem(path.stem, starts, certified, y, data[:, 1:].T.copy())


def find_data(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    cache = Path.home() / ".cache" / "torch_sgn"
    found = sorted(cache.glob("lmfit-*/NIST_STRD"))
    if not found:
        sys.exit(
            "no NIST StRD files: pass --data DIR, or run\n"
            f"  pip download --no-binary :all: --no-deps lmfit -d {cache}\n"
            f"  tar xzf {cache}/lmfit-*.tar.gz -C {cache}"
        )
    return found[-1]


def digits(b, certified) -> float:
    """Log relative error, the minimum over parameters, capped at 11 (0 for a non-finite
    result)."""
    out = 11.0
    for v, c in zip(b, certified):
        if not math.isfinite(v):
            return 0.0
        err = abs(v - c) / abs(c)
        out = min(out, 11.0 if err == 0 else max(0.0, -math.log10(err)))
    return out


class Curve(nn.Module):
    """The parameters b1, b2, ... as scalar ``nn.Parameter`` s, as a user writes a curve fit."""

    def __init__(self, start):
        super().__init__()
        self.n = len(start)
        for i, v in enumerate(start):
            setattr(self, f"b{i + 1}", nn.Parameter(torch.tensor(v, dtype=torch.float64)))

    def b(self):
        return [getattr(self, f"b{i + 1}") for i in range(self.n)]


def fit_sgn(
    problem: Problem,
    start,
    options: dict,
    tols: dict,
    optimizer: bool = False,
    fit: Callable = least_squares,
) -> dict:
    """SGN's fit by ``fit`` (this version's ``least_squares``, or another's: ``--old-src``);
    ``optimizer``: the same residuals as a :class:`~torch_sgn.pinn.Residuals` problem, whose
    steps run through :class:`~torch_sgn.SGN` itself rather than :mod:`torch_sgn.curve_steps`
    (the per-step overhead that module saves)."""
    model_fn = MODELS[problem.name]
    x = [torch.from_numpy(row) for row in problem.x]
    y = torch.from_numpy(problem.y)
    curve = Curve(start)
    calls = [0]

    def residuals(m):
        calls[0] += 1
        return model_fn(m.b(), x, torch) - y

    if optimizer:
        r = fit(Residuals(curve, {"residuals": Residual(residuals)}), **tols, **options)
    else:
        r = fit(residuals, curve, **tols, **options)
    return dict(
        b=[float(v) for v in r.x],
        status=r.status,
        steps=r.steps,
        evaluations=r.evaluations,
        calls=calls[0],
        cost=r.cost,
    )


def fit_scipy(problem: Problem, start, method: str, tols: dict) -> dict:
    from scipy.optimize import least_squares as scipy_least_squares

    model_fn = MODELS[problem.name]
    calls = [0]

    def residuals(b):
        calls[0] += 1
        return model_fn(b, problem.x, np) - problem.y

    r = scipy_least_squares(residuals, np.array(start), method=method, **tols)
    return dict(
        b=[float(v) for v in r.x],
        status=int(r.status),
        steps=int(r.njev) if r.njev is not None else None,
        evaluations=int(r.nfev),
        calls=calls[0],
        cost=float(r.cost),
    )


def fit_once(problem: Problem, start, method: str, options: dict, tols: dict) -> dict:
    """One fit by ``method``, with its CPU seconds (``time.process_time``)."""
    t = time.process_time()
    try:
        if method in ("sgn", "sgn-optimizer"):
            out = fit_sgn(problem, start, options, tols, optimizer=method == "sgn-optimizer")
        elif method == "sgn-old":
            out = fit_sgn(problem, start, options, tols, fit=OLD["least_squares"])
        else:
            out = fit_scipy(problem, start, method, tols)
    except Exception as e:  # a fit that raises is a miss, recorded with its error
        out = dict(b=[math.nan] * len(start), status=None, steps=None, evaluations=None)
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.process_time() - t
    return out


def run(
    problem: Problem, start, methods: List[str], options: dict, tols: dict, repeats: int
) -> Dict[str, dict]:
    """Each method's fit from ``start``, ``repeats`` times, the methods taking turns within
    each round (so that a slow spell of a shared machine falls on all of them): the last
    fit's result with the median of its CPU seconds."""
    times: Dict[str, List[float]] = {m: [] for m in methods}
    outs: Dict[str, dict] = {}
    for _ in range(repeats):
        for m in methods:
            outs[m] = fit_once(problem, start, m, options, tols)
            times[m].append(outs[m]["seconds"])
    for m, out in outs.items():
        out["digits"] = digits(out["b"], problem.certified)
        out["seconds"] = statistics.median(times[m])
        out["seconds_all"] = times[m]
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="folder of the NIST StRD .dat files")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="sgn,lm,trf")
    parser.add_argument("--problems", default=",".join(MODELS))
    parser.add_argument(
        "--sgn-options", default="{}", help="JSON of least_squares/SGN keyword arguments"
    )
    parser.add_argument(
        "--tol", type=float, default=1e-8, help="xtol = ftol = gtol of every method"
    )
    parser.add_argument("--label", default="sgn", help="the SGN configuration's name")
    parser.add_argument("--out", default=None, help="folder for the raw JSON")
    parser.add_argument(
        "--old-src",
        default=None,
        help="src directory of another version: method sgn-old fits by its least_squares",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = json.loads(args.sgn_options)
    tols = dict(xtol=args.tol, ftol=args.tol, gtol=args.tol)
    data = find_data(args.data)
    names = args.problems.split(",")
    problems = [read_problem(data / f"{n}.dat") for n in names]
    methods = args.methods.split(",")
    if "sgn-old" in methods:
        if args.old_src is None:
            parser.error("method sgn-old needs --old-src (the other version's src directory)")
        OLD["least_squares"] = importlib.import_module(import_old(args.old_src)).least_squares

    run(problems[0], problems[0].starts[0], methods, options, tols, 1)  # warm-up: first calls
    rows = []
    for p in problems:
        for s, start in enumerate(p.starts, 1):
            outs = run(p, start, methods, options, tols, args.repeats)
            for m in methods:
                out = outs[m]
                label = (
                    args.label
                    if m == "sgn"
                    else f"{args.label}-optimizer"
                    if m == "sgn-optimizer"
                    else f"{args.label}-old"
                    if m == "sgn-old"
                    else m
                )
                rows.append(dict(problem=p.name, start=s, method=label, **out))
                print(
                    f"{p.name:9s} {s} {label:14s} digits {out['digits']:5.1f} status "
                    f"{out['status']!s:>4} steps {out['steps']!s:>5} evals "
                    f"{out['evaluations']!s:>5} {out['seconds'] * 1e3:9.2f} ms",
                    flush=True,
                )
    summarize(rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = dict(
            command=" ".join(sys.argv),
            options=options,
            tol=args.tol,
            label=args.label,
            versions=versions(),
            rows=rows,
        )
        (out / f"{args.label}_tol{args.tol:g}.json").write_text(json.dumps(record, indent=1))


def summarize(rows: List[dict]) -> None:
    by_method: Dict[str, List[dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    print(
        f"\n{'method':14s} {'>=6 digits':>10s} {'>=4':>4s} {'median':>7s} {'CPU s':>8s} "
        f"{'calls':>7s}"
    )
    for m, rs in by_method.items():
        hits6 = sum(r["digits"] >= 6 for r in rs)
        hits4 = sum(r["digits"] >= 4 for r in rs)
        total = sum(r["seconds"] for r in rs)
        med = statistics.median(r["digits"] for r in rs)
        calls = sum(r.get("calls") or 0 for r in rs)
        print(f"{m:14s} {hits6:>6d}/{len(rs):<3d} {hits4:>4d} {med:7.1f} {total:8.3f} {calls:7d}")
    if "lm" in by_method:
        lm = sum(r["seconds"] for r in by_method["lm"])
        ratios = [f"{m} {sum(r['seconds'] for r in rs) / lm:.2f}x" for m, rs in by_method.items()]
        print("total CPU time against scipy lm's: " + ", ".join(ratios))
    for m, rs in by_method.items():  # an A/B of two versions in the same run
        if m.endswith("-old") and m[: -len("-old")] in by_method:
            new = sum(r["seconds"] for r in by_method[m[: -len("-old")]])
            print(f"{m[: -len('-old')]} against {m}: {new / sum(r['seconds'] for r in rs):.3f}x")
    for m, rs in by_method.items():
        misses = [f"{r['problem']}/{r['start']} ({r['digits']:.1f})" for r in rs if r["digits"] < 6]
        print(f"{m} below 6 digits: {', '.join(misses) or 'none'}")


def versions() -> dict:
    import scipy

    commit = environment().get("commit") or None
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        numpy=np.__version__,
        scipy=scipy.__version__,
        commit=commit,
        machine=platform.machine(),
        processor=platform.processor(),
    )


if __name__ == "__main__":
    main()
