"""The ``torch-sgn`` command line: ``run``, ``grid`` and ``report``.

Examples::

    torch-sgn run --preset boston --optimizer sgn --sgn-cg-iters 10 --epochs 30 --out runs/b
    torch-sgn run --preset fashion_mnist --optimizer sgd --sgd-lr 0.1 --epochs 5 --out runs/f
    torch-sgn grid boston-quick --out runs            # the paper's grid, resumable
    torch-sgn grid fashion_mnist --seeds 1 2 --only sgn_5 sgd_0.1 --epochs 5 --out runs
    torch-sgn report runs/boston --reference ../shared/seed/original/results/boston
    torchrun --nproc-per-node 2 -m torch_sgn run --preset boston --epochs 30 --out runs/b2

The options of :class:`~torch_sgn.experiments.config.RunConfig` and of each optimizer's dataclass
(``--sgn-*``, ``--sgd-*``, ``--adam-*``) are generated from the dataclasses' fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.distributed

from . import runner
from .config import AdamOptions, RunConfig, SGDOptions, SGNOptions
from .grids import GRIDS
from .models import PRESETS

_SHARED = (
    "device", "dtype", "threads", "cuda_graphs", "data_root", "init", "checkpoint_every",
    "batch_size",
)  # fmt: skip


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


#: Choices of string fields whose values a dict, not the type, names.
_CHOICES = {"preset": sorted(PRESETS)}


def _add_fields(parser, cls, prefix: str, names: Optional[Sequence[str]] = None) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        if f.name in ("sgn", "sgd", "adam"):
            continue
        hint = hints[f.name]
        base = hint
        if typing.get_origin(hint) is typing.Union:  # Optional[X]: the flag takes an X
            base = next(a for a in typing.get_args(hint) if a is not type(None))
        kwargs: dict[str, Any] = {}
        if f.name in _CHOICES:
            kwargs["choices"] = _CHOICES[f.name]
        elif typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = typing.get_args(base)
        elif base is bool:
            kwargs["type"] = _bool
            kwargs["metavar"] = "BOOL"
        elif base in (int, float, str):
            kwargs["type"] = base
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + (prefix + f.name).replace("_", "-")
        parser.add_argument(
            flag,
            dest=prefix + f.name,
            default=None,
            help=f"(default: {default})",
            **kwargs,
        )


def _collect(ns: argparse.Namespace, cls, prefix: str) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(ns, prefix + f.name, None)
        if value is not None:
            out[f.name] = value
    return out


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars, no tables")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log INFO (-vv DEBUG)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch-sgn", description="Benchmarks of the SGN optimizer (paper, Section 4)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "run",
        help="one training run",
        description="One training run. Under torchrun (torchrun --nproc-per-node N -m "
        "torch_sgn run ...) it trains data-parallel: each rank trains on its slice of every "
        "mini-batch, only rank 0 writes files and prints; across nodes --out must be on a "
        "shared file system (every rank resumes from rank 0's checkpoint).",
    )
    p.add_argument("--out", required=True, help="the run's directory")
    _add_fields(p, RunConfig, "")
    _add_fields(p, SGNOptions, "sgn_")
    _add_fields(p, SGDOptions, "sgd_")
    _add_fields(p, AdamOptions, "adam_")
    _add_common(p)

    g = sub.add_parser(
        "grid",
        help="a paper benchmark's grid of runs (resumable)",
        description="A paper benchmark's grid of runs (resumable). Single-process only: "
        "not under torchrun (launch distributed runs one by one with 'run').",
    )
    g.add_argument("name", choices=sorted(GRIDS), help="the benchmark")
    g.add_argument("--out", default="runs", help="results root (default: runs)")
    g.add_argument("--seeds", type=int, nargs="+", help="replace the grid's seeds")
    g.add_argument(
        "--only", nargs="+", help="keep these settings: sgn_5, sgd_0.1, adam_0.001 or SGN(5)"
    )
    g.add_argument("--epochs", type=int, help="replace every epoch budget")
    g.add_argument("--time-budget", type=float, help="replace every time budget (seconds)")
    g.add_argument("--no-report", action="store_true", help="do not write the report after")
    g.add_argument("--list", action="store_true", help="list the runs and exit")
    _add_fields(g, RunConfig, "", _SHARED)
    _add_common(g)

    r = sub.add_parser("report", help="plots and tables from a results directory")
    r.add_argument("results", help="directory holding runs (searched recursively)")
    r.add_argument("--out", help="where to write (default: RESULTS/report)")
    r.add_argument("--reference", help="results in the original implementation's format")
    r.add_argument("--time", type=float, nargs="+", help="T of the 'after T seconds' table")
    r.add_argument("--epochs", type=int, nargs="+", help="E of the 'after E epochs' table")
    r.add_argument("--title", help="title of the plots")
    r.add_argument("--max-epochs", type=float, help="cut the epoch axes here")
    r.add_argument("--max-time", type=float, help="cut the time axes here (seconds)")
    r.add_argument(
        "--train-metric",
        choices=("full", "batch"),
        default="full",
        help="train loss on the whole training set after each epoch (full), or the mean "
        "mini-batch loss during the epoch, as the original (batch)",
    )
    _add_common(r)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(ns.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")

    if ns.command == "run":
        fields = _collect(ns, RunConfig, "")
        cfg = RunConfig(
            **fields,
            sgn=SGNOptions(**_collect(ns, SGNOptions, "sgn_")),
            sgd=SGDOptions(**_collect(ns, SGDOptions, "sgd_")),
            adam=AdamOptions(**_collect(ns, AdamOptions, "adam_")),
        )
        from .. import distributed

        # Under torchrun (else nothing): NCCL for a CUDA run, gloo for a CPU run.
        distributed.init_from_env(backend="nccl" if cfg.device.startswith("cuda") else "gloo")
        main = distributed.is_main_process()
        try:
            res = runner.run(cfg, ns.out, quiet=ns.quiet)
            if distributed.world_size() > 1:
                # No rank tears its process group down while another still runs (rank 0
                # writes the results last): gloo can abort a process that leaves early.
                torch.distributed.barrier()
        finally:
            if distributed.world_size() > 1:
                torch.distributed.destroy_process_group()
        if not ns.quiet and main:
            e = res["epochs"]
            metric = "test_acc" if res["task"] == "classification" else "test_loss"
            print(
                f"{cfg.label} seed {cfg.seed}: {res['status']} after {res['total_epochs']} "
                f"epochs, {res['total_time']:.2f} s; train loss {e['train_loss'][-1]:.4g}, "
                f"{metric} {e[metric][-1]:.4g} -> {Path(ns.out) / 'results.json'}"
            )
        return 0

    if ns.command == "grid":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            print(
                "torch-sgn grid is single-process; under torchrun launch each run with "
                "'torch-sgn run' instead",
                file=sys.stderr,
            )
            return 2
        grid = GRIDS[ns.name]
        overrides = _collect(ns, RunConfig, "")
        overrides = {k: v for k, v in overrides.items() if k in _SHARED}
        configs = grid.configs(
            seeds=ns.seeds,
            only=ns.only,
            epochs=ns.epochs,
            time_budget=ns.time_budget,
            **overrides,
        )
        if not configs:
            print(f"no run of grid {ns.name} matches --only {ns.only}", file=sys.stderr)
            return 2
        if ns.list:
            for cfg in configs:
                print(Path(ns.out) / cfg.preset / cfg.name)
            return 0
        runner.run_grid(configs, ns.out, grid=grid.name, quiet=ns.quiet)
        if not ns.no_report:
            from . import report

            report.main(Path(ns.out) / grid.preset, quiet=ns.quiet)
        return 0

    from . import report

    report.main(
        ns.results,
        out=ns.out,
        reference=ns.reference,
        times=ns.time,
        epochs=ns.epochs,
        title=ns.title,
        train_metric=ns.train_metric,
        max_epochs=ns.max_epochs,
        max_time=ns.max_time,
        quiet=ns.quiet,
    )
    return 0


def command() -> typing.NoReturn:
    """The ``torch-sgn`` command (and ``python -m torch_sgn``): :func:`main`, then exit.

    A rank of a multi-process run (``WORLD_SIZE`` > 1, as under ``torchrun``) that finished
    leaves without the interpreter's teardown (``os._exit``, after flushing its output): its
    results are written and its process group destroyed by then, yet PyTorch's gloo backend
    has aborted a rank in that teardown ("terminate called without an active exception", a
    C++ thread still joinable at exit; torch 2.11 and 2.13, rarely), which fails the whole
    job. A run that raises exits as usual, with its traceback.
    """
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    command()
