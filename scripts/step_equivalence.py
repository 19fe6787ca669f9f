"""Records SGN's steps on a set of models and options, and compares two records bit for bit.

A refactor of the step must not change a single bit of what it computes. Record the steps
before the change, again after it, and compare (from the repository root, CPU)::

    PYTHONPATH=src python scripts/step_equivalence.py record /tmp/before.pt
    # ... change the code ...
    PYTHONPATH=src python scripts/step_equivalence.py record /tmp/after.pt
    PYTHONPATH=src python scripts/step_equivalence.py compare /tmp/before.pt /tmp/after.pt

Each case runs ~20 steps and keeps the parameters after every step, each step's
:class:`~torch_sgn.StepInfo` fields :data:`INFO_FIELDS` and the optimizer's final
``state_dict``. ``compare`` checks tensors with ``torch.equal`` and numbers with ``==`` (NaN
equal to NaN), reports the first difference of each case and exits 1 if there is one. It
compares the fields both records have: a ``StepInfo`` field, an option of the parameter group
or a key of the optimizer's state that only one record has (a record made before the field or
option existed) is named in the report, not counted as a difference.
The cases cover the Boston MLP of :mod:`torch_sgn.experiments`, a CNN, a traced
non-``Sequential`` model, the solvers ``"cg"``, ``"direct"`` (through ``G`` and through the
batch's outputs) and ``"auto"`` (its probes and switch), geodesic acceleration on and off,
momentum, the trust region and the line search on and off, Levenberg-Marquardt attempts with
both damping rules, frozen parameters, a curvature subset and a resumed ``state_dict``; a PINN
written with :mod:`torch_sgn.pinn` (exact steps on every row, and the sampled stages of many
rows); and :func:`torch_sgn.least_squares` on curve fits (its own driver, ``CurveSteps``: the
fit's result is the record: the solution, cost, steps, evaluations, status and message).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from typing import Callable, Dict, List, Mapping

import torch
from torch import nn

from torch_sgn import SGN, least_squares
from torch_sgn.experiments import data as datasets
from torch_sgn.experiments.models import mlp
from torch_sgn.pinn import Residual, Residuals, laplacian

STEPS = 20
INFO_FIELDS = (
    "loss", "loss_after", "grad_norm", "iterations", "residual", "stop_reason", "damping",
    "next_damping", "step_size", "tr_ratio", "predicted_change", "loss_evals", "line_search_ok",
    "attempts", "solver", "accelerated", "taken", "uphill_resolves", "penalty",
)  # fmt: skip
#: The fields that records made before their renaming keep under the former names.
RENAMED = {"cg_iters": "iterations", "cg_residual": "residual", "cg_stop": "stop_reason"}


class _Residual(nn.Module):
    """A non-Sequential model with a custom forward (the traced engine)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.inp = nn.Linear(13, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + torch.sin(self.hidden(h)))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(27, 4)
    )  # fmt: skip


def _boston(dtype, batch=101):
    d = datasets.boston(dtype=dtype)
    x, y = d.x_train, d.y_train
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x) - batch + 1, batch)]


def _images(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, 1, 8, 8, generator=g, dtype=dtype)
    y = torch.randint(0, 4, (4, 32), generator=g)
    return list(zip(x, y))


def _mlp(*widths: int) -> Callable[[], nn.Module]:
    """A builder of the Boston MLP with these hidden widths."""
    return lambda: mlp(13, widths, 1)


def _case(build, dtype, batches="boston", loss="mse", **options) -> dict:
    """A case: the model's builder, its dtype, the batches (:func:`_batches`), the loss and
    the options of :class:`SGN` (``paper=1``: :meth:`SGN.paper`; ``freeze=1``: the first
    parameter frozen after construction)."""
    return dict(build=build, dtype=dtype, batches=batches, loss=loss, options=options)


def _poisson(interior: int = 100, boundary: int = 20, width: int = 16) -> Residuals:
    """A 2-D Poisson problem written with torch_sgn.pinn (float64, fixed points)."""
    g = torch.Generator().manual_seed(3)
    x_in = torch.rand(interior, 2, generator=g, dtype=torch.float64)
    t = torch.rand(boundary, 1, generator=g, dtype=torch.float64)
    x_bd = torch.cat([t, (torch.arange(boundary) % 2).to(torch.float64)[:, None]], 1)
    net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1)).double()

    def f(x):
        return 2 * math.pi**2 * torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])

    return Residuals(
        net,
        {
            "interior": Residual(lambda u, x: -laplacian(u, x) - f(x), points=x_in),
            "boundary": Residual(lambda u, x: u(x), points=x_bd, weight=2.0),
        },
    )


#: NIST StRD's Misra1a (data, first start) and MGH09 (Kowalik and Osborne, second start).
_MISRA1A = (
    [77.6, 114.9, 141.1, 190.8, 239.9, 289.0, 332.8, 378.4, 434.8, 477.3, 536.8, 593.1, 689.1,
     760.0],
    [10.07, 14.73, 17.94, 23.93, 29.61, 35.18, 40.02, 44.82, 50.76, 55.05, 61.01, 66.40, 75.47,
     81.78],
    [500.0, 1e-4],
)  # fmt: skip
_MGH09 = (
    [4.0, 2.0, 1.0, 0.5, 0.25, 0.167, 0.125, 0.1, 0.0833, 0.0714, 0.0625],
    [0.1957, 0.1947, 0.1735, 0.16, 0.0844, 0.0627, 0.0456, 0.0342, 0.0323, 0.0235, 0.0246],
    [0.25, 0.39, 0.415, 0.39],
)


def _misra1a(b, x):
    return b[0] * (1 - torch.exp(-b[1] * x))


def _mgh09(b, x):
    return b[0] * (x**2 + x * b[1]) / (x**2 + x * b[2] + b[3])


def _fit(model, data, **options) -> dict:
    """A curve-fit case: ``least_squares`` of ``model(b, x) - y`` from the data's start."""
    return dict(fit=(model, data), options=options)


def cases() -> Dict[str, dict]:
    f32, f64 = torch.float32, torch.float64
    images = dict(batches="images", loss="cross_entropy")
    return {
        "boston_paper_cg": _case(_mlp(100, 100), f32, paper=1),
        "boston_auto": _case(_mlp(16), f32, cg_iters=2),
        # the probe's exact step wins: auto switches
        "linear_auto_switch": _case(lambda: nn.Linear(13, 1), f64, cg_iters=1),
        "boston_auto_f64": _case(_mlp(12), f64),
        "boston_direct_geodesic_nielsen": _case(
            _mlp(16),
            f64,
            solver="direct",
            damping_update="nielsen",
            damping_min=1e-12,
            attempts=3,
        ),
        "boston_direct_no_geodesic_no_tr_no_ls": _case(
            _mlp(16),
            f64,
            solver="direct",
            geodesic_acceleration=False,
            trust_region=False,
            line_search=False,
            damping_schedule="linear",
            damping=1e-2,
            damping_min=1e-5,
        ),
        "boston_samples_route": _case(
            _mlp(64), f64, batches="boston_small", solver="direct", attempts=2
        ),
        "boston_cg_momentum": _case(
            _mlp(32),
            f32,
            solver="cg",
            momentum=0.9,
            warm_start=0.5,
            preconditioner=True,
            warmup_cg_iters=3,
            warmup_steps=5,
            attempts=2,
            lr=0.5,
        ),
        "boston_cg_no_tr_cosine": _case(
            _mlp(32),
            f32,
            solver="cg",
            trust_region=False,
            damping_schedule="cosine",
            line_search=False,
            cg_rtol=0.1,
        ),
        "boston_direct_momentum": _case(
            _mlp(8), f64, solver="direct", momentum=0.5, warm_start=1.0
        ),
        "boston_curvature_fraction": _case(_mlp(16), f32, solver="cg", curvature_fraction=0.5),
        "boston_one_batch_auto": _case(_mlp(8), f64, batches="boston_one"),
        "cnn_cg": _case(_cnn, f32, **images, solver="cg", cg_iters=5),
        "cnn_auto": _case(_cnn, f64, **images, attempts=2),
        "cnn_direct_nielsen": _case(
            _cnn, f64, **images, solver="direct", damping_update="nielsen", attempts=3
        ),
        "traced_cg": _case(_Residual, f32, solver="cg", engine="traced"),
        "traced_direct_geodesic": _case(_Residual, f64, solver="direct"),
        "traced_auto": _case(_Residual, f64, cg_iters=1),
        "frozen_direct": _case(_mlp(8), f64, solver="direct", freeze=1),
        "frozen_cg_momentum": _case(
            _mlp(8), f32, solver="cg", momentum=0.9, warm_start=0.5, freeze=1
        ),
        "pinn_auto": _case(_poisson, f64, batches="problem", loss=Residuals.loss),
        # more rows and parameters than direct_max_params: sampled exact steps
        "pinn_sampled": _case(
            lambda: _poisson(400, 40),
            f64,
            batches="problem",
            loss=Residuals.loss,
            direct_max_params=40,
        ),  # fmt: skip
        "fit_misra1a": _fit(_misra1a, _MISRA1A, xtol=1e-15, ftol=1e-15, gtol=1e-15),
        "fit_mgh09_strict": _fit(
            _mgh09,
            _MGH09,
            xtol=1e-15,
            ftol=1e-15,
            gtol=1e-15,
            geodesic_acceleration="strict",
            attempts=10,
        ),  # fmt: skip
    }


def _batches(kind: str, dtype) -> List[tuple]:
    if kind == "boston":
        return _boston(dtype)
    if kind == "boston_small":  # fewer outputs than parameters: the sample space
        return _boston(dtype, batch=40)
    if kind == "boston_one":  # the same tensors every step: a full-batch fit
        return _boston(dtype, batch=404)
    return _images(dtype)


def run_fit(case: dict) -> dict:
    """A curve fit's record: the result of ``least_squares``, as one step's parameters and
    info (the driver keeps no optimizer state)."""
    model, (x, y, start) = case["fit"]
    x, y = (torch.tensor(v, dtype=torch.float64) for v in (x, y))
    fit = least_squares(
        lambda b: model(b, x) - y, torch.tensor(start, dtype=torch.float64), **case["options"]
    )
    info = dict(
        loss_after=float(fit.cost), steps=fit.steps, evaluations=fit.evaluations,
        status=fit.status, message=fit.message, solver="least_squares",
    )  # fmt: skip
    return dict(params=[[fit.x.clone()]], infos=[info], state={"param_groups": [], "state": {}})


def run(case: dict) -> dict:
    if "fit" in case:
        return run_fit(case)
    torch.manual_seed(0)
    options = dict(case["options"])
    paper, freeze = options.pop("paper", 0), options.pop("freeze", 0)
    model = case["build"]().to(case["dtype"])
    build: Callable = SGN.paper if paper else SGN
    opt = build(model, case["loss"], **options)
    if freeze:  # frozen after SGN was built: steps in the other parameters
        next(model.parameters()).requires_grad_(False)
    if case["batches"] == "problem":  # a Residuals problem: its own points, every step
        batches = [model.batch()]
    else:
        batches = _batches(case["batches"], case["dtype"])
    params, infos = [], []
    for t in range(STEPS):
        if t == STEPS // 2 and not freeze:  # a resumed run: a new optimizer loads the state
            saved = copy.deepcopy(opt.state_dict())
            opt = build(model, case["loss"], **options)
            opt.load_state_dict(saved)
        x, y = batches[t % len(batches)]
        info = opt.step(x, y)
        infos.append({k: getattr(info, k) for k in INFO_FIELDS})
        params.append([p.detach().clone() for p in model.parameters()])
    return dict(params=params, infos=infos, state=copy.deepcopy(opt.state_dict()))


def record(path: str, only: List[str]) -> None:
    """Runs the cases (those named in ``only``, else all) and saves their records at ``path``."""
    out = {}
    for name, case in cases().items():
        if only and name not in only:
            continue
        out[name] = run(case)
        solvers = sorted({i["solver"] for i in out[name]["infos"]})
        print(f"{name}: loss {out[name]['infos'][-1]['loss_after']:.6g}, solvers {solvers}")
    torch.save(out, path)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


class _Comparison:
    """The differences of one case's two records, in the fields both have, and the fields
    (``"info taken"``, ``"option reject_uphill"``, ``"state exact"``) that only one has."""

    def __init__(self) -> None:
        self.differs: List[str] = []
        self.only: Dict[str, set] = {"before": set(), "after": set()}

    def values(self, where: str, a, b) -> None:
        if not _same(a, b):
            self.differs.append(where)

    def fields(self, kind: str, where: str, a: Mapping, b: Mapping) -> None:
        self.only["before"].update(f"{kind} {k}" for k in a if k not in b)
        self.only["after"].update(f"{kind} {k}" for k in b if k not in a)
        for k in a:
            if k in b:
                self.values(f"{where} {kind} {k}", a[k], b[k])


def _infos(info: Mapping) -> dict:
    return {RENAMED.get(k, k): v for k, v in info.items()}


def compare_case(x: dict, y: dict) -> _Comparison:
    """``x`` (before) and ``y`` (after), one case's records, compared."""
    c = _Comparison()
    c.values("number of steps", len(x["params"]), len(y["params"]))
    for t, (pa, pb, ia, ib) in enumerate(zip(x["params"], y["params"], x["infos"], y["infos"])):
        c.values(f"step {t} params", pa, pb)
        c.fields("info", f"step {t}", _infos(ia), _infos(ib))
    ga, gb = x["state"]["param_groups"], y["state"]["param_groups"]
    c.values("final state_dict: number of parameter groups", len(ga), len(gb))
    for a, b in zip(ga, gb):
        c.fields("option", "final state_dict", a, b)
    sa, sb = x["state"]["state"], y["state"]["state"]
    c.values("final state_dict: parameters with state", sorted(sa), sorted(sb))
    for i in sorted(sa.keys() & sb.keys()):
        c.fields("state", f"final state_dict parameter {i}", sa[i], sb[i])
    return c


def compare(before: str, after: str) -> int:
    """Prints each common case's verdict and the fields only one record has; 1 where a case
    differs or only one record has it, else 0."""
    a, b = torch.load(before, weights_only=False), torch.load(after, weights_only=False)
    for side, names in (("before", a.keys() - b.keys()), ("after", b.keys() - a.keys())):
        if names:
            print(f"cases only in {side}: {sorted(names)}")
    only: Dict[str, set] = {"before": set(), "after": set()}
    common = sorted(a.keys() & b.keys())
    differing = 0
    for name in common:
        c = compare_case(a[name], b[name])
        for side in only:
            only[side] |= c.only[side]
        if c.differs:
            more = f" (and {len(c.differs) - 1} more)" if len(c.differs) > 1 else ""
            print(f"{name}: DIFFERS at {c.differs[0]}{more}")
            differing += 1
        else:
            print(f"{name}: identical")
    for side, fields in only.items():
        if fields:
            print(f"fields only in {side} (not compared): {', '.join(sorted(fields))}")
    print(f"{len(common) - differing} of {len(common)} common cases bit for bit identical")
    return 1 if differing or a.keys() != b.keys() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("path")
    rec.add_argument("--only", nargs="*", default=[])
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "record":
        record(args.path, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
