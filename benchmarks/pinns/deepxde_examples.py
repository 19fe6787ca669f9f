"""DeepXDE's own examples, each run with its own recipe and with SGN (``torch_sgn.deepxde``), in
equal CPU seconds on one thread.

The examples are read from a DeepXDE checkout (``--examples``: its ``examples`` folder, with
``dataset/``) and executed as they are written, in a scratch copy of that folder, with these
changes, the same for every method:

* the PyTorch backend; ``from deepxde.backend import tf`` (the TensorFlow lines the examples'
  comments say to replace for PyTorch) reads ``import torch as tf``, so ``tf.sin`` is
  ``torch.sin``;
* where an example does not run as written on DeepXDE 1.15's PyTorch backend with NumPy 2, the
  least change that makes it run (:data:`PATCHES`, each stated there);
* float64 (``dde.config.set_default_float("float64")`` before the example runs;
  ``--float32`` keeps DeepXDE's default);
* ``dde.saveplot`` and ``plt.show`` do nothing;
* ``model.train`` stops when the run's CPU budget is spent (a ``dde.callbacks.Callback``
  checks it after every iteration); later ``train`` calls return at once.

Methods: ``recipe``: the example's own optimizers and settings (Adam, then L-BFGS where it has
one; DeepXDE's NNCG where the example has it, as Burgers), cut to the budget; ``sgn``: every
``model.compile`` of the example gets ``torch_sgn.deepxde.SGN(model)`` in place of its
optimizer (its ``loss_weights``, metrics and external variables kept), and each ``train`` with
iterations runs until the budget is spent; ``sgn_balance``: the same with ``SGN(model,
balance=True)`` (each loss term's weight divided by its value at the first step: the rule for
inverse problems, docs/PINN.md); ``sgn_rad``: ``sgn`` with
``torch_sgn.deepxde.ResidualPoints()`` among each ``train``'s callbacks (the PDE's points
redrawn by its residual every 25 steps: the rule for shocks, sharp fronts and re-entrant
corners, docs/PINN.md). The error is the relative L2 error of the prediction against the example's
reference (its exact solution, or its data file in ``dataset/``), over all outputs; for the
inverse problems also each variable's relative error. Each record also holds the run's curve
(:data:`CURVE_COLUMNS`, at the CPU seconds of :data:`CURVE_MARKS` and at the end, measured
outside the budget): the training loss, the error, and the PDE's residual at the training
points beside its residual at fresh points of the domain, which tells a loss that is small only
where it is trained from one that is small everywhere.

    git clone https://github.com/lululxvi/deepxde /tmp/deepxde
    python benchmarks/pinns/deepxde_examples.py --examples /tmp/deepxde/examples --budget 60 \\
        --out benchmarks/results/<date>_cpu_deepxde_examples
    python benchmarks/pinns/deepxde_examples.py --table --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

os.environ.setdefault("DDE_BACKEND", "pytorch")
os.environ.setdefault("MPLBACKEND", "Agg")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
import sgn_methods  # noqa: E402
from measuring import add_record_arguments, record_folder, run_missing, write_record  # noqa: E402

#: example: (folder, reference, true values of the inverse problem's variables). The reference:
#: ``"solution"``: the data's exact solution on its test points; ``"testdata"``: the example's
#: ``gen_testdata()``; ``"funcs:a,b"``: its exact-solution functions, one per output, on the
#: data's test points; ``"npz:FILE"``: ``X_test`` and ``y_ref`` of a data file;
#: ``"traindata"``: the example's ``gen_traindata()`` (points, then one array per output).
EXAMPLES: Dict[str, tuple] = {
    "Poisson_Dirichlet_1d": ("pinn_forward", "solution", None),
    "Poisson_Lshape": ("pinn_forward", "npz:Poisson_Lshape.npz", None),
    "Helmholtz_Dirichlet_2d": ("pinn_forward", "solution", None),
    "diffusion_1d": ("pinn_forward", "solution", None),
    "heat": ("pinn_forward", "testdata", None),
    "wave_1d": ("pinn_forward", "solution", None),
    "Klein_Gordon": ("pinn_forward", "solution", None),
    "Burgers": ("pinn_forward", "testdata", None),
    "Allen_Cahn": ("pinn_forward", "testdata", None),
    "diffusion_reaction": ("pinn_forward", "solution", None),
    "Kovasznay_flow": ("pinn_forward", "funcs:u_func,v_func,p_func", None),
    "Beltrami_flow": ("pinn_forward", "funcs:u_func,v_func,w_func", None),  # (as it reports)
    "Euler_beam": ("pinn_forward", "solution", None),
    "ode_system": ("pinn_forward", "solution", None),
    "diffusion_1d_inverse": ("pinn_inverse", "solution", {"C": 1.0}),
    "reaction_inverse": ("pinn_inverse", "traindata", {"kf": 0.1, "D": 2.0}),
}
METHODS = ("recipe", "sgn", "sgn_balance", "sgn_rad")
#: The methods that train with ``torch_sgn.deepxde.SGN``.
SGN_METHODS = sgn_methods.subset("sgn", "sgn_balance", "sgn_rad")
#: The methods a run makes unless ``--methods`` says otherwise (``sgn_balance``: the rule for
#: inverse problems, run on the examples it names).
DEFAULT_METHODS = ("recipe", "sgn")

#: example: [(text, replacement)] applied to its source: each the least change that makes it
#: run on DeepXDE 1.15's PyTorch backend with NumPy 2.
PATCHES: Dict[str, list] = {
    # NumPy 2 refuses a one-element array where a scalar is set
    "heat": [
        (
            "usol[i][j] = heat_eq_exact_solution(x[i], t[j])",
            "usol[i][j] = heat_eq_exact_solution(x[i], t[j]).item()",
        )
    ],
    # its cos is defined for the TensorFlow and Paddle backends only
    "Klein_Gordon": [("import deepxde as dde\n", "import deepxde as dde\nfrom torch import cos\n")],
}


def _source(path: Path) -> str:
    text = path.read_text().replace("from deepxde.backend import tf", "import torch as tf")
    for old, new in PATCHES.get(path.stem, []):
        if old not in text:
            raise ValueError(f"{path.name}: the patch's text {old!r} is not in the example")
        text = text.replace(old, new)
    return text


def run(
    example: str, method: str, args, extra: Optional[Callable[[object], dict]] = None
) -> Dict[str, object]:
    """One example by one method, in this process (a child of :func:`main`). ``extra``: a
    function of the trained model whose entries join the result (a record's own error
    measure, as against another reference)."""
    import deepxde as dde
    import matplotlib.pyplot as plt

    folder, reference, truths = EXAMPLES[example]
    if not args.float32:
        dde.config.set_default_float("float64")
    dde.config.set_random_seed(args.seed)
    clock = {"used": 0.0, "since": time.process_time(), "iterations": 0}
    models = []
    original_compile, original_train = dde.Model.compile, dde.Model.train

    curve: List[List[Optional[float]]] = []
    marks = [m for m in CURVE_MARKS if m < args.budget]

    class Budget(dde.callbacks.Callback):
        def on_epoch_end(self):
            clock["used"] += time.process_time() - clock["since"]
            clock["iterations"] += 1
            if clock["used"] >= args.budget:
                self.model.stop_training = True
            elif marks and clock["used"] >= marks[0]:
                while marks and clock["used"] >= marks[0]:
                    marks.pop(0)
                err = _measure(self.model, namespace, reference, truths)["rel_l2"]
                curve.append(_curve_point(self.model, namespace, clock, err))
            clock["since"] = time.process_time()  # (the curve's point outside the budget)

    def patched_compile(self, optimizer, *a, **kw):
        if self not in models:
            models.append(self)
        if method in SGN_METHODS:
            if not hasattr(self, "_sgn"):
                self._sgn = sgn_methods.optimizer(self, method)
            optimizer = self._sgn
            kw.pop("lr", None)
            kw.pop("decay", None)
            a = ()
        return original_compile(self, optimizer, *a, **kw)

    def patched_train(self, iterations=None, callbacks=None, **kw):
        if iterations == 0 or clock["used"] >= args.budget:
            if iterations == 0:  # (wave_1d reads its initial losses so)
                return original_train(self, iterations=0, callbacks=callbacks, **kw)
            return self.losshistory, self.train_state
        if method in SGN_METHODS and iterations is not None:
            iterations = 10**9  # until the budget is spent
        redraw = sgn_methods.callbacks(method)
        kw.pop("display_every", None)
        clock["since"] = time.process_time()
        return original_train(
            self,
            iterations=iterations,
            callbacks=[*(callbacks or []), *redraw, Budget()],
            display_every=10**9,
            **kw,
        )

    originals = (dde.saveplot, dde.utils.saveplot, plt.show)  # (restored with DeepXDE's Model)
    dde.Model.compile, dde.Model.train = patched_compile, patched_train
    dde.saveplot = lambda *a, **k: None
    dde.utils.saveplot = dde.saveplot
    plt.show = lambda *a, **k: None
    source = Path(args.examples) / folder / f"{example}.py"
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copytree(Path(args.examples) / "dataset", Path(scratch) / "dataset")
        work = Path(scratch) / folder
        work.mkdir()
        cwd = os.getcwd()
        os.chdir(work)
        namespace: Dict[str, object] = {"__name__": "__main__", "__file__": str(source)}
        error: Optional[str] = None
        try:
            exec(compile_source(source), namespace)
        except Exception as e:  # noqa: BLE001 - recorded: a method that cannot run the example
            error = f"{type(e).__name__}: {e}"
        try:
            result = _measure(models[-1], namespace, reference, truths) if models else {}
            if models and not error:
                end = _curve_point(models[-1], namespace, clock, result["rel_l2"])
                curve.append(end)
                if extra is not None:
                    result.update(extra(models[-1]))
        finally:
            os.chdir(cwd)
            dde.Model.compile, dde.Model.train = original_compile, original_train
            dde.saveplot, dde.utils.saveplot, plt.show = originals
    return {
        "example": example,
        "method": method,
        "budget_s": args.budget,
        "cpu_s": clock["used"],
        "iterations": clock["iterations"],
        "float64": not args.float32,
        "error": error,
        **result,
        "curve_columns": list(CURVE_COLUMNS),
        "curve": curve,
    }


#: CPU seconds at which a run records a point of its curve (and at its end).
CURVE_MARKS = (1, 3, 10, 30, 60, 100, 200, 300, 500, 1000, 2000)
CURVE_COLUMNS = ("cpu_s", "iterations", "train_loss", "rel_l2", "residual_train", "residual_new")
#: Fresh domain points at which a curve's point measures the PDE's residual.
NEW_POINTS = 10_000


def _curve_point(model, namespace: dict, clock: dict, err: float) -> list:
    """``[CPU s, iterations, training loss, rel. L2 (``err``, :func:`_measure`'s), residual
    RMS at the training points, at NEW_POINTS fresh ones]``. The training loss is DeepXDE's (its
    loss terms, weighted, summed) at the current training points; the residuals are the PDE's
    (every equation's, root mean square) at the points where DeepXDE evaluates it
    (``train_x_all``) and at points drawn afresh (NumPy's global generator's state restored:
    the run's own draws do not move). ``None`` where the example's PDE cannot be evaluated
    so."""
    state = model.train_state
    _, losses = model.outputs_losses_train(state.X_train, state.y_train, state.train_aux_vars)
    loss = float(sum(float(v.detach()) if hasattr(v, "detach") else float(v) for v in losses))
    return [clock["used"], clock["iterations"], loss, err, *_residuals(model, namespace)]


def _residuals(model, namespace: dict) -> list:
    pde = namespace.get("pde")
    data = model.data
    if pde is None or not hasattr(data, "geom") or not hasattr(data, "train_x_all"):
        return [None, None]
    state = np.random.get_state()
    try:
        np.random.seed(12345)
        fresh = data.geom.random_points(NEW_POINTS)
    finally:
        np.random.set_state(state)
    out = []
    for x in (data.train_x_all, fresh):
        try:
            r = model.predict(x.astype(data.train_x_all.dtype), operator=pde)
        except Exception:  # noqa: BLE001 - a PDE of more arguments (external data): not measured
            return [None, None]
        parts = r if isinstance(r, (list, tuple)) else [r]
        r = np.concatenate([np.asarray(v).reshape(len(x), -1) for v in parts], axis=1)
        out.append(float(np.sqrt(np.mean(r**2))))
    return out


def compile_source(path: Path):
    return compile(_source(path), str(path), "exec")


def _measure(model, namespace: dict, reference: str, truths: Optional[dict]) -> dict:
    data = model.data
    if reference == "solution":
        x = data.test_x
        y = data.soln(x)
    elif reference == "testdata":
        x, y = namespace["gen_testdata"]()
    elif reference == "traindata":
        x, *ys = namespace["gen_traindata"]()
        y = np.hstack(ys)
    elif reference.startswith("funcs:"):
        x = data.test_x
        y = np.hstack([namespace[f](x) for f in reference[6:].split(",")])
    else:
        ref = np.load(Path("..") / "dataset" / reference[4:])
        x, y = ref["X_test"], ref["y_ref"]
    pred = model.predict(x)[:, : y.shape[1]]
    known = np.isfinite(y).all(axis=1)  # (Poisson_Lshape's file: NaN outside the domain)
    diff, y = pred[known] - y[known], y[known]
    out = {"rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(y))}
    if truths:
        out["variables"] = {
            name: {"value": float(namespace[name].detach()), "true": true}
            for name, true in truths.items()
        }
        out["variables_rel_error"] = {
            name: abs(float(namespace[name].detach()) - true) / abs(true)
            for name, true in truths.items()
        }
    return out


def table(folder: Path) -> str:
    runs: Dict[str, Dict[str, dict]] = {}
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        if "example" in r and "method" in r:  # (a record's other JSON files left out)
            runs.setdefault(r["example"], {})[r["method"]] = r
    rows = [
        "| example | recipe rel. L2 | SGN rel. L2 | recipe / SGN | variables' rel. error "
        "(recipe; SGN) | CPU s (recipe; SGN) |",
        "|---|---|---|---|---|---|",
    ]
    #: (method, column) of the rules' methods that ran
    rules = [
        (m, title)
        for m, title in (("sgn_balance", "balance=True"), ("sgn_rad", "ResidualPoints()"))
        if any(m in r for r in runs.values())
    ]
    for _, title in rules:
        rows[0] += f" SGN, {title}: rel. L2 (variables; CPU s) |"
        rows[1] += "---|"
    for example in EXAMPLES:
        r = runs.get(example, {})
        rec, sgn = r.get("recipe"), r.get("sgn")

        def err(x):
            if x is None:
                return "-"
            if x.get("error") and "rel_l2" not in x:
                return "failed"
            return f"{x['rel_l2']:.2e}"

        ratio = "-"
        if rec and sgn and "rel_l2" in rec and "rel_l2" in sgn:
            ratio = f"{rec['rel_l2'] / sgn['rel_l2']:.3g}"

        def var(x):
            if not x or "variables_rel_error" not in x:
                return ""
            return ", ".join(f"{k} {v:.1e}" for k, v in x["variables_rel_error"].items())

        variables = "; ".join(v for v in (var(rec), var(sgn)) if v) or "-"
        cpu = "; ".join(f"{x['cpu_s']:.0f}" for x in (rec, sgn) if x)
        row = f"| {example} | {err(rec)} | {err(sgn)} | {ratio} | {variables} | {cpu} |"
        for method, _ in rules:
            ruled = r.get(method)
            extra = "" if ruled is None else f" ({var(ruled) or '-'}; {ruled['cpu_s']:.0f})"
            row += f" {err(ruled)}{extra} |"
        rows.append(row)
    curves = [
        (example, method, r[method]["curve"][-1])
        for example, r in ((e, runs.get(e, {})) for e in EXAMPLES)
        for method in METHODS
        if r.get(method, {}).get("curve")
    ]
    if curves:
        rows += [
            "",
            "| example | method | steps | training loss | PDE residual (RMS) at the training "
            "points | at fresh points | rel. L2 |",
            "|---|---|---|---|---|---|---|",
        ]
        for example, method, end in curves:
            cells = [f"{v:.2e}" if isinstance(v, float) else "-" for v in end[2:]]
            rows.append(
                f"| {example} | {method} | {end[1]} | {cells[0]} | {cells[2]} | {cells[3]} | "
                f"{cells[1]} |"
            )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", help="a DeepXDE checkout's examples/ folder")
    parser.add_argument("--only", default=",".join(EXAMPLES))
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float32", action="store_true")
    add_record_arguments(parser)
    args = parser.parse_args(argv)
    out = record_folder(args, table)
    if out is None:
        return
    if args.examples is None:
        parser.error("--examples is needed to run")
    if args.one:
        example, method = args.one.split(":")
        write_record(out / f"{example}_{method}.json", run(example, method, args))
        return
    runs = [
        (f"{example}:{method}", out / f"{example}_{method}.json")
        for example in args.only.split(",")
        for method in args.methods.split(",")
    ]
    argv = argv if argv is not None else sys.argv[1:]
    run_missing(__file__, argv, runs, log=lambda path: path.with_suffix(".log"))
    print(table(out))


if __name__ == "__main__":
    main()
