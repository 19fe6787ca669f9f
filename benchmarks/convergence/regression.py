"""High-precision regression: seconds of optimizer time to MSE 1e-4 ... 1e-10, SGN against dense
Levenberg-Marquardt, Adam and SGD.

Command of the recorded baseline (from the repository root)::

    PYTHONPATH=src python benchmarks/convergence/regression.py --sgn default \\
        --sgn "cg_iters=61,cg_tol=0" --name baseline

One problem and one candidate SGN configuration, quickly (LM and the best Adam beside it)::

    PYTHONPATH=src python benchmarks/convergence/regression.py --problems sinc32 \\
        --methods lm adam sgn --adam-lrs 0.01 --sgn default --sgn "solver=direct" --name try_direct

Install (the benchmark extra pulls ``torch-levenberg-marquardt`` 1.2.3; install torch first, the
build you want, so that pip does not fetch another one)::

    pip install torch            # or the CPU / CUDA build of your choice
    pip install -e ".[bench]" torch==<the version installed>   # keeps that torch

``torch-levenberg-marquardt`` imports ``pytorch-lightning`` and ``torchmetrics`` at import time;
without the package the ``lm`` rows are skipped with the reason printed.

What it measures. Every method runs in one process, one torch thread, on the same data, the
same initial weights and the same mini-batch order, for the same budget of seconds of
*optimizer time*: only the optimizer's steps are timed (for SGD and Adam the forward, backward
and update; for LM its ``training_step``; for SGN ``step(x, y)``). A second is one of the
process's CPU time (``--clock cpu``, the default): with one thread that is the wall time on a
quiet machine, and on a shared one it leaves out the time spent waiting for a core, so rows
run minutes apart stay comparable; ``--clock wall`` times wall-clock seconds instead, and the
curves keep both. The full-data MSE is
evaluated between steps, not timed, on a time grid: the next evaluation comes after the first
step that ends at least ``max(budget / 500, 5% of the elapsed time)`` after the previous one,
and at the end of the budget. A level's time is the optimizer time at the first evaluation at
or below it, so it overstates the true first crossing by at most 5% (plus one step) for every
method alike: LM's fast steps are resolved as finely as anyone's. Before each timed run the
method takes a few untimed steps on a copy of the model (one-time costs: ``torch.func``
tracing, caches). ``lm`` is the PyPI package as its README uses it
(``LevenbergMarquardtModule(model, MSELoss(), learning_rate=1.0, attempts_per_step=10)``, the
default ``StandardDampingStrategy`` and ``solve_method="qr"``: the whole batch's Jacobian, the
damped ``J^T J`` (or ``J J^T`` when the batch has fewer residuals than the network has
parameters, as on Boston) solved exactly, up to 10 damping retries per step); it is skipped above
``--lm-max-params`` parameters. ``adam`` runs over a learning-rate grid, ``sgd`` with momentum
0.9 over a short one, ``sgn`` once per ``--sgn`` configuration (``default`` is
``SGN(model, "mse")``; otherwise ``key=value,...`` keyword arguments of :class:`SGN`).

Problems (``--problems``; budgets from ``--seconds``):

=========  =====================================================================  ==========
sinc32     sinc(10x), 20000 points U(-1, 1), batch 1000, 1-20-1 tanh MLP (61       20 s
           parameters, PyTorch's init), float32 (torch-levenberg-marquardt's
           example)
sinc64     the same in float64                                                     15 s
sine       the paper's sine preset (its data, 1-20-20-20-1 sigmoid MLP, paper      10 s
           init, batch 1000), float32
boston     the paper's Boston preset (13-100-100-1 sigmoid, batch 101), float32   10 s
mlp133k    sin(pi x) cos(pi y) + exp(-z^2) / 2 on 50000 points U([-1, 1]^3),       60 s
           batch 1000, 3-256-256-256-1 tanh MLP (132,865 parameters), float32
=========  =====================================================================  ==========

Output: a table per problem and ``record.json`` under
``benchmarks/results/regression/<YYYY-MM-DD>_<name>/`` (command, git commit, versions, CPU,
threads, and every method's curve: optimizer seconds, steps and MSE at each evaluation).

Recorded baseline (``benchmarks/results/regression/2026-11-26_baseline/``): 2-core x86 CPU
(shared with other work), one thread, torch 2.13.0+cpu; the table is in the record's README.md.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import datetime
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_sgn import SGN

# The project's experiment tooling: the paper presets' data, networks and initialisation, read
# exactly as the paper runs read them. One place to change if the tooling moves.
from torch_sgn.experiments.data import batches
from torch_sgn.experiments.models import PRESETS, mlp
from torch_sgn.experiments.runner import RunConfig, load_data

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
import measuring  # noqa: E402  (the git commit of the record's environment)

ROOT = Path(__file__).resolve().parents[2]
LEVELS = [10.0**-k for k in range(4, 11)]
ADAM_LRS = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
SGD_LRS = [1e-2, 1e-1]
METHODS = ("lm", "adam", "sgd", "sgn")
EVAL_REL = 0.05  # an evaluation at least every 5% of the elapsed optimizer time ...
EVAL_MIN_FRACTION = 1 / 500  # ... and at most one per budget / 500
WARMUP_STEPS = 3


# --------------------------------------------------------------------------- problems


@dataclass
class Problem:
    """One regression problem: training data, the initial network, batch, dtype, budget."""

    name: str
    description: str
    make_data: Callable[[torch.dtype], tuple]  # dtype -> (x, y) training set
    make_model: Callable[[], nn.Module]  # the initial network (float32, fixed weights)
    dtype: torch.dtype
    batch_size: int
    seconds: float


def _torch_init(build: Callable[[], nn.Module], seed: int) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build()

    return make


def _uniform(n: int, dims: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, dims, generator=gen, dtype=torch.float64) * 2 - 1


def _sinc_data(dtype: torch.dtype, seed: int = 0) -> tuple:
    x = _uniform(20000, 1, seed)
    return x.to(dtype), torch.sinc(10 * x).to(dtype)


def _smooth3d_data(dtype: torch.dtype, seed: int = 0) -> tuple:
    x = _uniform(50000, 3, seed)
    y = torch.sin(math.pi * x[:, :1]) * torch.cos(math.pi * x[:, 1:2])
    y = y + torch.exp(-(x[:, 2:3] ** 2)) / 2
    return x.to(dtype), y.to(dtype)


def _preset_data(name: str) -> Callable[[torch.dtype], tuple]:
    def make(dtype: torch.dtype) -> tuple:
        data = load_data(RunConfig(preset=name, epochs=1)).to("cpu", dtype)
        return data.x_train, data.y_train

    return make


def problems() -> Dict[str, Problem]:
    """The problems by name (built lazily: data and networks are made when run)."""
    sinc_net = _torch_init(lambda: mlp(1, [20], 1, "tanh"), seed=0)
    return {
        "sinc32": Problem(
            "sinc32",
            "sinc(10x), 20000 points U(-1,1), batch 1000, 1-20-1 tanh, float32",
            _sinc_data,
            sinc_net,
            torch.float32,
            1000,
            20.0,
        ),
        "sinc64": Problem(
            "sinc64",
            "sinc(10x), 20000 points U(-1,1), batch 1000, 1-20-1 tanh, float64",
            _sinc_data,
            sinc_net,
            torch.float64,
            1000,
            15.0,
        ),
        "sine": Problem(
            "sine",
            "paper's sine preset: " + PRESETS["sine"].description + ", float32",
            _preset_data("sine"),
            PRESETS["sine"].build,
            torch.float32,
            PRESETS["sine"].batch_size,
            10.0,
        ),
        "boston": Problem(
            "boston",
            "paper's Boston preset: " + PRESETS["boston"].description + ", float32",
            _preset_data("boston"),
            PRESETS["boston"].build,
            torch.float32,
            PRESETS["boston"].batch_size,
            10.0,
        ),
        "mlp133k": Problem(
            "mlp133k",
            "sin(pi x)cos(pi y)+exp(-z^2)/2, 50000 points U([-1,1]^3), batch 1000, "
            "3-256-256-256-1 tanh, float32",
            _smooth3d_data,
            _torch_init(lambda: mlp(3, [256, 256, 256], 1, "tanh"), seed=0),
            torch.float32,
            1000,
            60.0,
        ),
    }


# --------------------------------------------------------------------------- methods


@dataclass
class Method:
    """One optimizer setting: ``kind`` in :data:`METHODS` and its keyword arguments."""

    label: str
    kind: str
    options: Dict[str, Any] = field(default_factory=dict)


def parse_sgn(spec: str) -> Dict[str, Any]:
    """``"default"`` -> ``{}``; ``"cg_iters=61,cg_tol=0,solver=direct"`` -> keyword arguments.

    Values are Python literals (``ast.literal_eval``); a bare word is a string. Names that
    :class:`SGN` does not take raise ``ValueError`` naming the ones it does.
    """
    spec = spec.strip()
    if spec in ("", "default"):
        return {}
    try:
        call = ast.parse(f"f({spec})", mode="eval").body
    except SyntaxError:
        raise ValueError(
            f"--sgn {spec!r}: expected 'default' or key=value pairs separated by commas, "
            "e.g. 'cg_iters=61,cg_tol=0'"
        ) from None
    if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
        raise ValueError(f"--sgn {spec!r}: expected key=value pairs separated by commas")
    options = {}
    for kw in call.keywords:
        if isinstance(kw.value, ast.Name):  # solver=direct: a bare word is a string
            options[kw.arg] = kw.value.id
        else:
            try:
                options[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                raise ValueError(
                    f"--sgn {spec!r}: the value of {kw.arg} is not a Python literal"
                ) from None
    accepted = [
        name for name in inspect.signature(SGN.__init__).parameters if name not in ("self", "model")
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"--sgn {spec!r}: SGN takes no argument {', '.join(map(repr, unknown))}; "
            f"this version of SGN takes: {', '.join(accepted)}"
        )
    # Bad values (a negative cg_iters, an unknown solver name) fail here, before any run.
    try:
        SGN(nn.Linear(1, 1), **{"loss": "mse", **options})
    except (TypeError, ValueError) as e:
        raise ValueError(f"--sgn {spec!r}: {e}") from None
    return options


def sgn_label(spec: str) -> str:
    spec = spec.strip()
    return "SGN default" if spec in ("", "default") else f"SGN {spec}"


def build_methods(args: argparse.Namespace) -> List[Method]:
    out: List[Method] = []
    if "lm" in args.methods:
        out.append(Method("LM (torch-levenberg-marquardt)", "lm"))
    if "adam" in args.methods:
        out += [Method(f"Adam lr {lr:g}", "adam", {"lr": lr}) for lr in args.adam_lrs]
    if "sgd" in args.methods:
        out += [
            Method(f"SGD lr {lr:g} m 0.9", "sgd", {"lr": lr, "momentum": 0.9})
            for lr in args.sgd_lrs
        ]
    if "sgn" in args.methods:
        out += [Method(sgn_label(s), "sgn", parse_sgn(s)) for s in args.sgn]
    return out


def _lm_module():
    try:
        import torch_levenberg_marquardt as tlm
    except ImportError as e:
        return None, f"torch-levenberg-marquardt is not installed ({e}); pip install -e '.[bench]'"
    except Exception as e:  # noqa: BLE001 - e.g. a torchvision built for another torch
        return None, (
            f"torch-levenberg-marquardt cannot be imported ({type(e).__name__}: {e}); a "
            "torchvision built for another torch breaks its import: pip uninstall torchvision"
        )
    return tlm, None


def lm_skip_reason(n_params: int, dtype: torch.dtype, max_params: int) -> Optional[str]:
    """Why dense LM does not run on a network of ``n_params`` parameters, or ``None``."""
    tlm, missing = _lm_module()
    if tlm is None:
        return missing
    if n_params > max_params:
        size = n_params**2 * torch.finfo(dtype).bits / 8
        return (
            f"{n_params} parameters: dense LM's J^T J alone would need {size / 1e9:.0f} GB "
            f"in {str(dtype).replace('torch.', '')} (limit --lm-max-params {max_params})"
        )
    return None


def make_stepper(method: Method, model: nn.Module) -> Callable[[Tensor, Tensor], dict]:
    """The method's optimizer on ``model``, as ``step(x, y) -> info`` (a small dict)."""
    if method.kind == "sgn":
        opt = SGN(model, "mse", **method.options)

        def step(x, y):
            info = opt.step(x, y)
            return {"damping": info.damping, "cg_iters": info.iterations, "step": info}

        return step
    if method.kind == "lm":
        tlm, _ = _lm_module()
        # As the package's sinc example: learning rate 1, 10 attempts, default damping.
        lm = tlm.training.LevenbergMarquardtModule(
            model=model, loss_fn=tlm.loss.MSELoss(), learning_rate=1.0, attempts_per_step=10
        )

        def step(x, y):
            _, loss, stop, logs = lm.training_step(x, y)
            return {
                "damping": float(logs["damping"]),
                "attempts": int(logs["attempts"]),
                "stop": bool(stop),
            }

        return step
    cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[method.kind]
    opt = cls(model.parameters(), **method.options)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
        return {}

    return step


# --------------------------------------------------------------------------- one run


@torch.no_grad()
def full_mse(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 25000) -> float:
    """Mean squared error on the whole set, squared errors summed in float64."""
    total = 0.0
    for i in range(0, len(x), chunk):
        total += (model(x[i : i + chunk]) - y[i : i + chunk]).double().square().sum().item()
    return total / y.numel()


def _info_summary(info: dict) -> dict:
    out = {k: v for k, v in info.items() if k != "step"}
    if "step" in info:  # SGN's StepInfo, whatever fields this version has
        out.update({k: v for k, v in dataclasses.asdict(info["step"]).items() if k not in out})
    return out


def run_method(
    method: Method,
    init_model: nn.Module,
    x: Tensor,
    y: Tensor,
    batch_size: int,
    budget: float,
    seed: int,
    warmup_steps: int = WARMUP_STEPS,
    clock: str = "cpu",
) -> dict:
    """Train a copy of ``init_model`` with ``method`` for ``budget`` seconds of optimizer time.

    ``clock`` ``"cpu"`` counts the process's CPU seconds (what the steps cost, whatever else
    the machine runs), ``"wall"`` wall-clock seconds; the curve keeps both.
    """
    now = time.process_time if clock == "cpu" else time.perf_counter
    # Untimed warm-up on a throwaway copy: tracing and caches do not count.
    warm = copy.deepcopy(init_model)
    step = make_stepper(method, warm)
    for i, (xb, yb) in enumerate(batches(x, y, batch_size, torch.Generator().manual_seed(seed))):
        if i >= warmup_steps:
            break
        step(xb, yb)

    model = copy.deepcopy(init_model)
    step = make_stepper(method, model)
    gen = torch.Generator().manual_seed(seed)
    curve = {"t": [0.0], "wall": [0.0], "step": [0], "mse": [full_mse(model, x, y)]}
    curve["info"] = [None]
    elapsed, wall, steps, epochs, status, info = 0.0, 0.0, 0, 0, "ok", {}
    next_eval = budget * EVAL_MIN_FRACTION
    done = False
    while not done:
        for xb, yb in batches(x, y, batch_size, gen):
            start, start_wall = now(), time.perf_counter()
            info = step(xb, yb)
            elapsed += now() - start
            wall += time.perf_counter() - start_wall
            steps += 1
            out_of_time = elapsed >= budget
            if elapsed >= next_eval or out_of_time or info.get("stop"):
                mse = full_mse(model, x, y)
                curve["t"].append(elapsed)
                curve["wall"].append(wall)
                curve["step"].append(steps)
                curve["mse"].append(mse)
                curve["info"].append(_info_summary(info))
                next_eval = elapsed + max(budget * EVAL_MIN_FRACTION, EVAL_REL * elapsed)
                if not math.isfinite(mse):
                    status, done = "diverged", True
                elif info.get("stop"):
                    status, done = "stopped: LM's damping reached its maximum", True
                elif out_of_time:
                    done = True
            if done:
                break
        else:
            epochs += 1
    return {
        "status": status,
        "steps": steps,
        "epochs": epochs,
        "optimizer_seconds": elapsed,
        "wall_seconds": wall,
        "final_mse": curve["mse"][-1],
        "seconds_to": seconds_to_levels(curve["t"], curve["mse"]),
        "curve": curve,
    }


def seconds_to_levels(times: Sequence[float], mses: Sequence[float]) -> Dict[str, Optional[float]]:
    """Optimizer seconds at the first evaluation at or below each level (``None``: never)."""
    out: Dict[str, Optional[float]] = {}
    for level in LEVELS:
        hit = next((t for t, m in zip(times, mses) if m <= level), None)
        out[f"{level:.0e}"] = hit
    return out


# --------------------------------------------------------------------------- record


def environment(threads: int) -> dict:
    def git(*cmd: str) -> Optional[str]:
        try:
            return subprocess.run(
                ["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    tlm, _ = _lm_module()
    return {
        "git_commit": measuring.environment().get("commit") or None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__,
        "torch_levenberg_marquardt": getattr(tlm, "__version__", None),
        "python": platform.python_version(),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "platform": platform.platform(),
    }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN: a diverged run's MSE
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def table(result: dict) -> str:
    levels = [f"{level:.0e}" for level in LEVELS]
    lines = [
        f"{result['name']}: {result['description']}; {result['parameters']} parameters, "
        f"{result['seconds']:g} s each, initial MSE {result['initial_mse']:.3g}",
        "| method | " + " | ".join(f"s to {lv}" for lv in levels) + " | final MSE | steps |",
        "|---" * (len(levels) + 3) + "|",
    ]
    for r in result["methods"]:
        if r["status"].startswith("skipped") or r["status"].startswith("error"):
            lines.append(f"| {r['label']} | {r['status']} |")
            continue
        cells = [
            "-" if r["seconds_to"][lv] is None else f"{r['seconds_to'][lv]:.2f}" for lv in levels
        ]
        final = r["final_mse"]
        final_s = "nan" if final is None or not math.isfinite(final) else f"{final:.2e}"
        extra = "" if r["status"] == "ok" else f" ({r['status']})"
        lines.append(
            f"| {r['label']} | " + " | ".join(cells) + f" | {final_s}{extra} | {r['steps']} |"
        )
    return "\n".join(lines)


def summary(record: dict) -> str:
    """The record as markdown: how it was run, then one table per problem."""
    env = record["environment"]
    lines = [
        f"# benchmarks/convergence/regression.py, {record['date_utc']}",
        "",
        "```",
        record["command"],
        "```",
        "",
        f"- commit {env['git_commit']}{' (with local changes)' if env['git_dirty'] else ''}, "
        f"torch {env['torch']}, torch-levenberg-marquardt {env['torch_levenberg_marquardt']}, "
        f"Python {env['python']}",
        f"- CPU: {env['cpu']} ({env['logical_cpus']} logical CPUs), {env['threads']} torch "
        f"thread(s); seconds are {record['clock']} time of the optimizer steps",
        f"- evaluation: {record['evaluation']}",
    ]
    if record.get("note"):
        lines.append(f"- note: {record['note']}")
    for result in record["problems"].values():
        lines += ["", table(result)]
    return "\n".join(lines) + "\n"


def write_record(folder: Path, record: dict) -> None:
    """``record.json`` (everything, curves included) and ``README.md`` (its tables)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "record.json", "w") as f:
        json.dump(_jsonable(record), f, indent=1, default=str)
    (folder / "README.md").write_text(summary(_jsonable(record)))


def record_dir(out: Path, name: str) -> Path:
    stem = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}_{name}"
    path, i = out / stem, 2
    while path.exists():
        path, i = out / f"{stem}_{i}", i + 1
    return path


# --------------------------------------------------------------------------- main


def _seconds(values: Sequence[str], quick: bool) -> Dict[str, float]:
    """``--seconds 20`` for every problem, ``--seconds sinc32=5 mlp133k=30`` per problem."""
    budgets = {name: p.seconds for name, p in problems().items()}
    if quick:
        budgets = dict.fromkeys(budgets, 1.0)
    for v in values:
        name, _, s = v.rpartition("=")
        targets = [name] if name else list(budgets)
        for t in targets:
            if t not in budgets:
                raise ValueError(f"--seconds {v!r}: unknown problem {t!r}")
            budgets[t] = float(s)
    return budgets


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problems", nargs="+", default=list(problems()), choices=list(problems()))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument(
        "--sgn",
        action="append",
        default=None,
        help="an SGN configuration: 'default' or key=value,... (repeatable; default: default)",
    )
    p.add_argument("--adam-lrs", nargs="+", type=float, default=ADAM_LRS)
    p.add_argument("--sgd-lrs", nargs="+", type=float, default=SGD_LRS)
    p.add_argument(
        "--seconds",
        nargs="+",
        default=[],
        help="optimizer seconds per method: one number for every problem, or name=seconds",
    )
    p.add_argument("--quick", action="store_true", help="1 s per method, one warm-up step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="what a second of optimizer time is: process CPU time (default) or wall time",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the mini-batch order")
    p.add_argument("--lm-max-params", type=int, default=20000)
    p.add_argument("--name", default="run", help="short description: the record's folder name")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "regression"))
    p.add_argument("--note", default="", help="free text kept in the record")
    p.add_argument(
        "--summarize",
        metavar="RECORD_JSON",
        help="run nothing: rewrite README.md beside this record.json from it and print it",
    )
    return p


def main(argv: Optional[List[str]] = None) -> Path:
    """Runs the benchmark; returns the record's folder."""
    args = parser().parse_args(argv)
    if args.summarize:
        folder = Path(args.summarize).parent
        record = json.loads(Path(args.summarize).read_text())
        (folder / "README.md").write_text(summary(record))
        print(summary(record))
        return folder
    args.sgn = args.sgn or ["default"]
    try:
        methods = build_methods(args)
        budgets = _seconds(args.seconds, args.quick)
    except ValueError as e:
        parser().error(str(e))
    torch.set_num_threads(args.threads)
    warmup = 1 if args.quick else WARMUP_STEPS
    command = "PYTHONPATH=src python benchmarks/convergence/regression.py " + " ".join(
        a if a and " " not in a and "," not in a else repr(a)
        for a in (sys.argv[1:] if argv is None else argv)
    )
    folder = record_dir(Path(args.out), args.name)
    record = {
        "command": command.strip(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "note": args.note,
        "environment": environment(args.threads),
        "levels": [f"{level:.0e}" for level in LEVELS],
        "evaluation": (
            f"full-data MSE after the first step ending at least max(budget/"
            f"{round(1 / EVAL_MIN_FRACTION)}, {EVAL_REL:g} x elapsed) after the previous "
            "evaluation, and at the end; not timed"
        ),
        "clock": args.clock,
        "warmup_steps": warmup,
        "seed": args.seed,
        "problems": {},
    }
    print(f"command: {record['command']}")
    print(f"environment: {record['environment']}")
    for name in args.problems:
        prob = problems()[name]
        x, y = prob.make_data(prob.dtype)
        init_model = prob.make_model().to(prob.dtype)
        n_params = sum(p.numel() for p in init_model.parameters())
        result = {
            "name": name,
            "description": prob.description,
            "dtype": str(prob.dtype).replace("torch.", ""),
            "n_train": len(x),
            "batch_size": prob.batch_size,
            "parameters": n_params,
            "seconds": budgets[name],
            "initial_mse": full_mse(init_model, x, y),
            "methods": [],
        }
        for m in methods:
            r: Dict[str, Any] = {"label": m.label, "kind": m.kind, "options": m.options}
            reason = lm_skip_reason(n_params, prob.dtype, args.lm_max_params)
            if m.kind == "lm" and reason is not None:
                r["status"] = f"skipped: {reason}"
            else:
                try:
                    r.update(
                        run_method(
                            m,
                            init_model,
                            x,
                            y,
                            prob.batch_size,
                            budgets[name],
                            args.seed,
                            warmup,
                            args.clock,
                        )
                    )
                except Exception as e:  # one failing method must not lose the others' results
                    r["status"] = f"error: {type(e).__name__}: {e}"
            result["methods"].append(r)
            print(f"  {name} {m.label}: {r['status']} final MSE {r.get('final_mse')}", flush=True)
        record["problems"][name] = result
        print(table(result), flush=True)
        write_record(folder, record)  # after each problem: an interrupted run keeps the rest
    print(f"record: {folder / 'record.json'}")
    return folder


if __name__ == "__main__":
    main()
