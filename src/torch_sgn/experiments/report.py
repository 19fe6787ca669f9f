"""Plots and tables from a directory of runs, like the paper's figures and tables.

:func:`main` reads every ``results.json`` written by :mod:`torch_sgn.experiments.runner` under
a directory, groups the runs by setting (``SGN(5)``, ``SGD(0.1)``, ...) and writes

* four figures, each as PNG and SVG: train loss against seconds and against epochs, and the
  test metric (loss for regression, accuracy for classification) against seconds and against
  epochs. SGN is dashed, the baselines solid; each curve is the mean over seeds with a band
  from the minimum to the maximum;
* ``table.md``: the test metric after ``T`` seconds of training and after ``E`` epochs, mean
  +- sample standard deviation over seeds, with the epochs reached (paper, Tables 1-3).

With ``reference``, results in the original implementation's format
(``res_<SOLVER>_<setting>_<seed>/results.json``, as in the authors' published results) are
overlaid as thin grey curves and added to the tables as ``... [original]`` rows.

.. note::
    The original stored only the total training time of a run, not per-epoch times. Its
    curves are placed in time assuming equally long epochs: epoch ``e`` of ``n`` at
    ``e / n * tot_time``. Its train loss is the mean mini-batch loss over the epoch
    (``avg_loss``), ours by default the loss on the whole training set after the epoch
    (``train_metric="batch"`` plots ours the original's way).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from .grids import GRIDS
from .records import FORMAT, read_json

__all__ = ["Curve", "load_reference", "load_results", "main", "tables"]

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class Curve:
    """Per-epoch values of one run; ``nan`` where a value does not exist.

    Attributes:
        label: The setting, e.g. ``"SGN(5)"``.
        seed: The run's seed.
        task: ``"regression"`` or ``"classification"``.
        epoch: Epoch numbers (0 is the untrained network, when recorded).
        time: Cumulative training time at each epoch's end, seconds.
        train_loss: Train loss after each epoch.
        test_loss: Test loss after each epoch.
        test_acc: Test accuracy after each epoch (fraction).
        diverged: Whether the run stopped on a non-finite loss.
        reference: Whether the run comes from the original implementation's results.
    """

    label: str
    seed: int
    task: str
    epoch: np.ndarray
    time: np.ndarray
    train_loss: np.ndarray
    test_loss: np.ndarray
    test_acc: np.ndarray
    diverged: bool = False
    reference: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def metric(self) -> np.ndarray:
        """The test metric: accuracy for classification, loss for regression."""
        return self.test_acc if self.task == "classification" else self.test_loss


def _array(values: Iterable) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def load_results(directory: PathLike, train_metric: str = "full") -> list[Curve]:
    """Every run of :mod:`torch_sgn.experiments.runner` under ``directory`` (searched recursively).

    Unfinished runs (``"status": "running"``) are skipped with a warning.

    Args:
        directory: Where to look.
        train_metric: ``"full"`` (loss on the whole training set) or ``"batch"`` (mean
            mini-batch loss of the epoch, the original's ``avg_loss``; at epoch 0, the
            full loss).
    """
    curves = []
    for path in sorted(Path(directory).rglob("results.json")):
        res = read_json(path)
        if not res or res.get("format") != FORMAT:
            continue
        if res.get("status") == "running":
            logger.warning("%s: run not finished, left out", path.parent)
            continue
        cfg = (read_json(path.parent / "config.json") or {}).get("config", {})
        e = res["epochs"]
        train = _array(e["train_loss"])
        if train_metric == "batch":
            batch = _array(e["batch_loss"])
            train = np.where(np.isnan(batch), train, batch)
        curves.append(
            Curve(
                label=res["label"],
                seed=int(cfg.get("seed", 0)),
                task=res["task"],
                epoch=_array(e["epoch"]),
                time=_array(e["time"]),
                train_loss=train,
                test_loss=_array(e["test_loss"]),
                test_acc=_array(e["test_acc"]),
                diverged=res.get("status") == "diverged",
            )
        )
    return curves


_REF_DIR = re.compile(r"^res_(SGN|SGD)_([0-9.eE+-]+)_(\d+)$")


def load_reference(directory: PathLike) -> list[Curve]:
    """Runs in the original implementation's format under ``directory``.

    ``directory`` holds ``res_<SGN|SGD>_<CG iterations|learning rate>_<seed>/results.json``
    with per-epoch lists ``avg_loss``, ``test_loss`` or ``test_acc``, and ``tot_time``.
    Folders with other names (the original's ``..._longer`` continuations) are skipped.
    """
    curves = []
    for sub in sorted(Path(directory).iterdir()):
        m = _REF_DIR.match(sub.name)
        if not m or not (sub / "results.json").is_file():
            continue
        solver, setting, seed = m.groups()
        try:
            res = json.loads((sub / "results.json").read_text())  # the original wrote NaN
        except ValueError as e:
            logger.warning("%s: unreadable (%s), left out", sub, e)
            continue
        label = f"SGN({int(float(setting))})" if solver == "SGN" else f"SGD({float(setting):g})"
        train = _array(res["avg_loss"])
        n = len(train)
        task = "classification" if "test_acc" in res else "regression"
        test_loss = _array(res.get("test_loss", [None] * n))
        test_acc = _array(res.get("test_acc", [None] * n))
        curves.append(
            Curve(
                label=label,
                seed=int(seed),
                task=task,
                epoch=np.arange(1, n + 1, dtype=float),
                time=np.arange(1, n + 1, dtype=float) * float(res["tot_time"]) / max(n, 1),
                train_loss=train,
                test_loss=test_loss,
                test_acc=test_acc,
                diverged=bool(n and not np.isfinite(train[-1])),
                reference=True,
            )
        )
    return curves


# --------------------------------------------------------------------------- aggregation


def _order(label: str) -> tuple:
    m = re.match(r"(\w+)\(([^,)]+)", label)
    kind = m.group(1) if m else label
    try:
        value = float(m.group(2)) if m else 0.0
    except ValueError:
        value = 0.0
    return ({"SGN": 0, "SGD": 1, "Adam": 2}.get(kind, 3), value, label)


def _group(curves: Sequence[Curve]) -> dict[str, list[Curve]]:
    groups: dict[str, list[Curve]] = defaultdict(list)
    for c in curves:
        groups[c.label + (" [original]" if c.reference else "")].append(c)
    return {k: sorted(groups[k], key=lambda c: c.seed) for k in sorted(groups, key=_order)}


def _stack(runs: Sequence[Curve], attr: str) -> np.ndarray:
    """Seeds x epochs, aligned by epoch index: cut to the shortest run that did not diverge
    (time budgets end seeds at different epochs); diverged runs are padded with ``nan``, so
    the mean stops where the first seed diverged."""
    alive = [len(c.epoch) for c in runs if not c.diverged]
    n = min(alive) if alive else max(len(c.epoch) for c in runs)
    out = np.full((len(runs), n), np.nan)
    for i, c in enumerate(runs):
        values = getattr(c, attr)[:n]
        out[i, : len(values)] = values
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if len(v) == 0:
        return math.nan, math.nan, 0
    with np.errstate(over="ignore"):  # runs on their way to diverging
        return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else math.nan, len(v)


def _after_time(c: Curve, t: float) -> Optional[int]:
    idx = np.nonzero(c.time <= t * (1 + 1e-9))[0]
    return int(idx[-1]) if len(idx) else None


def _after_epochs(c: Curve, e: int) -> Optional[int]:
    idx = np.nonzero(c.epoch == e)[0]
    return int(idx[0]) if len(idx) else None


def _fmt(mean: float, std: float, n: int, classification: bool) -> str:
    if n == 0:
        return "n/a"
    if classification:
        s = f"{100 * mean:.2f}"
        return s + (f" ± {100 * std:.2f}" if n > 1 else "")
    s = f"{mean:.4g}"
    return s + (f" ± {std:.2g}" if n > 1 else "")


def _span(values: Sequence[float]) -> str:
    v = [int(x) for x in values]
    if not v:
        return "-"
    return str(v[0]) if min(v) == max(v) else f"{min(v)}-{max(v)}"


def tables(curves: Sequence[Curve], times: Sequence[float], epochs: Sequence[int]) -> str:
    """The markdown tables: test metric after each ``T`` seconds and each ``E`` epochs.

    Each row is a setting; values are mean ± sample standard deviation (ddof 1) over the
    seeds (no ± with one seed). Accuracies are in percent. A run counts "after T seconds" at
    its last epoch that ended within ``T`` seconds of training, and "after E epochs" only
    if it reached epoch ``E``. Seeds whose value is not finite (diverged) are left out of
    the mean and counted in the last column.
    """
    if not curves:
        return "(no results)\n"
    classification = curves[0].task == "classification"
    metric = "test accuracy (%)" if classification else "test loss"
    groups = _group(curves)

    def time_column(found, runs):  # after T s: the epochs the runs had reached
        return _span([c.epoch[i] for c, i in found]), str(len(found))

    def epoch_column(found, runs):  # after E epochs: the mean time it took
        tm = _mean_std([c.time[i] for c, i in found])
        return ("-" if tm[2] == 0 else f"{tm[0]:.1f}"), f"{len(found)}/{len(runs)}"

    lines = []
    for title, column, locate, extra in [
        *((f"after {t:g} s of training", "epochs", partial(_after_time, t=t), time_column)
          for t in times),
        *((f"after {e} epochs", "time (s)", partial(_after_epochs, e=e), epoch_column)
          for e in epochs),
    ]:  # fmt: skip
        lines += [
            f"**{metric} {title}**",
            "",
            f"| setting | {metric} | train loss | {column} | seeds | diverged |",
            "|---|---|---|---|---|---|",
        ]
        for label, runs in groups.items():
            found = [(c, i) for c in runs if (i := locate(c)) is not None]
            m = _mean_std([c.metric[i] for c, i in found])
            tr = _mean_std([c.train_loss[i] for c, i in found])
            bad = sum(1 for c, i in found if not np.isfinite(c.metric[i]))
            value, seeds = extra(found, runs)
            lines.append(
                f"| {label} | {_fmt(*m, classification)} | {_fmt(*tr, False)} "
                f"| {value} | {seeds} | {bad} |"
            )
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots


def _plot(ax, runs: Sequence[Curve], attr: str, x_attr: str, **style) -> np.ndarray:
    y = _stack(runs, attr)
    x = _stack(runs, x_attr)
    with np.errstate(all="ignore"):
        xm = np.nanmean(x, axis=0)
        mean = y.mean(axis=0)
        lo, hi = y.min(axis=0), y.max(axis=0)
    (line,) = ax.plot(xm, mean, **style)
    if len(runs) > 1 and not style.get("color") == "0.55":
        ax.fill_between(xm, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    return mean


class _quiet_nan_warnings:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def plots(
    curves: Sequence[Curve],
    out: PathLike,
    reference: Sequence[Curve] = (),
    title: Optional[str] = None,
    max_epochs: Optional[float] = None,
    max_time: Optional[float] = None,
) -> list[Path]:
    """Write the four figures as PNG and SVG into ``out``; returns the written paths.

    ``max_epochs`` and ``max_time`` cut the x axes (the data beyond is still plotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_nan_warnings():  # diverged runs: nan and overflow on log axes
        return _plots(plt, curves, out, reference, title, {"epoch": max_epochs, "time": max_time})


def _plots(plt, curves, out: Path, reference, title, xmax: dict) -> list[Path]:
    classification = curves[0].task == "classification"
    test_attr, test_name = (
        ("test_acc", "test accuracy") if classification else ("test_loss", "test loss")
    )
    groups = _group(curves)
    ref_groups = _group(reference)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {label: colors[i % len(colors)] for i, label in enumerate(groups)}
    written = []
    for attr, y_name in (("train_loss", "train loss"), (test_attr, test_name)):
        for x_attr, x_name in (("time", "seconds"), ("epoch", "epochs")):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            means, ref_means = [], []
            for label, runs in ref_groups.items():
                style = "--" if label.startswith("SGN") else "-"
                ref_means.append(_plot(ax, runs, attr, x_attr, color="0.55", linewidth=0.8,
                                       linestyle=style))  # fmt: skip
                y = _stack(runs, attr).mean(axis=0)
                x = np.nanmean(_stack(runs, x_attr), axis=0)
                ok = np.nonzero(np.isfinite(y) & np.isfinite(x))[0]
                if len(ok):
                    ax.annotate(runs[0].label, (x[ok[-1]], y[ok[-1]]), fontsize=6, color="0.45")
            for label, runs in groups.items():
                style = "--" if label.startswith("SGN") else "-"
                means.append(
                    _plot(ax, runs, attr, x_attr, color=color[label], linestyle=style,
                          linewidth=1.5, label=f"{label} ({len(runs)} seeds)")
                )  # fmt: skip
            if ref_groups:
                ax.plot([], [], color="0.55", linewidth=0.8, label="original (published)")
            if xmax[x_attr] is not None:
                ax.set_xlim(0, xmax[x_attr])
            if attr != "test_acc":
                ax.set_yscale("log")
                # From the best mean to the worst starting point: diverging runs leave the plot.
                ours = [m[np.isfinite(m) & (m > 0)] for m in means]
                ours = [m for m in ours if len(m)]
                theirs = [m[np.isfinite(m) & (m > 0)] for m in ref_means]
                theirs = [m for m in theirs if len(m)]
                if ours or theirs:
                    low = min(m.min() for m in ours + theirs)
                    high = max(m[0] for m in (ours or theirs))
                    ax.set_ylim(0.8 * low, 1.5 * max(high, low))
            ax.set_xlabel(f"training {x_name}" if x_name == "seconds" else x_name)
            ax.set_ylabel(y_name)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            if title:
                ax.set_title(title, fontsize=10)
            fig.tight_layout()
            stem = f"{attr}_vs_{'time' if x_attr == 'time' else 'epochs'}"
            for ext in ("png", "svg"):
                path = out / f"{stem}.{ext}"
                fig.savefig(path, dpi=90)
                written.append(path)
            plt.close(fig)
    return written


# --------------------------------------------------------------------------- entry point


def _default_points(directory: Path, curves: Sequence[Curve]):
    for p in [directory, *directory.parents][:3]:
        info = read_json(p / "grid.json")
        if info and info.get("grid") in GRIDS:
            g = GRIDS[info["grid"]]
            return list(g.report_times), list(g.report_epochs)
    ends = [c.time[-1] for c in curves]
    last = [int(c.epoch[-1]) for c in curves]
    return [float(np.floor(min(ends)))], [min(last)]


def main(
    results: PathLike,
    out: Optional[PathLike] = None,
    reference: Optional[PathLike] = None,
    times: Optional[Sequence[float]] = None,
    epochs: Optional[Sequence[int]] = None,
    title: Optional[str] = None,
    train_metric: str = "full",
    max_epochs: Optional[float] = None,
    max_time: Optional[float] = None,
    quiet: bool = False,
) -> str:
    """Write the plots and ``table.md`` for the runs under ``results``; returns the tables.

    Args:
        results: Directory of runs (searched recursively).
        out: Output directory; default ``results/report``.
        reference: Directory in the original's format to overlay and tabulate.
        times: ``T`` values (seconds) of the tables; default the grid's, else the shortest
            run's training time.
        epochs: ``E`` values of the tables; default the grid's, else the fewest epochs run.
        title: Title of the figures.
        train_metric: ``"full"`` or ``"batch"``, see :func:`load_results`.
        max_epochs: Cut the epoch axes here.
        max_time: Cut the time axes here (seconds).
        quiet: Do not print the tables.
    """
    results = Path(results)
    out = Path(out) if out is not None else results / "report"
    curves = load_results(results, train_metric)
    if not curves:
        raise FileNotFoundError(f"no finished runs (results.json) under {results}")
    ref = load_reference(reference) if reference is not None else []
    if ref:
        labels = {c.label for c in curves}
        matching = [c for c in ref if c.label in labels]
        ref = matching or ref
    default_times, default_epochs = _default_points(results, curves)
    times = list(times) if times else default_times
    epochs = list(epochs) if epochs else default_epochs
    written = plots(curves, out, ref, title, max_epochs, max_time)
    text = tables(list(curves) + list(ref), times, epochs)
    header = f"# Results under `{results}`\n\n"
    (out / "table.md").write_text(header + text)
    if not quiet:
        print(text)
        print(f"wrote {out / 'table.md'} and {len(written)} figures in {out}")
    return text
