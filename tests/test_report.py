"""The report: loading runs and the original's results, tables checked by hand, figures."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from torch_sgn.experiments import cli, report
from torch_sgn.experiments.runner import FORMAT

ORIGINAL_BOSTON = Path("/work/shared/seed/original/results/boston")
ORIGINAL_BOSTON = (
    ORIGINAL_BOSTON
    if ORIGINAL_BOSTON.is_dir()
    else Path(__file__).resolve().parents[2] / "shared/seed/original/results/boston"
)


def write_run(root: Path, label: str, seed: int, times, test, train=None, task="classification",
              status="finished"):  # fmt: skip
    """A results.json of the runner's format with the given per-epoch values (epoch 0 first)."""
    n = len(times)
    train = train if train is not None else [1.0 / (e + 1) for e in range(n)]
    d = root / f"{label.replace('(', '_').replace(')', '')}_seed{seed}"
    d.mkdir(parents=True)
    acc = test if task == "classification" else [None] * n
    loss = [0.5] * n if task == "classification" else test
    res = {
        "format": FORMAT,
        "status": status,
        "label": label,
        "task": task,
        "epochs": {
            "epoch": list(range(n)),
            "time": list(times),
            "iterations": [4 * e for e in range(n)],
            "train_loss": train,
            "train_acc": [None] * n,
            "batch_loss": [None] + [t * 2 for t in train[1:]],
            "test_loss": loss,
            "test_acc": acc,
        },
        "iterations": {"loss": []},
    }
    (d / "results.json").write_text(json.dumps(res))
    (d / "config.json").write_text(json.dumps({"config": {"seed": seed}}))


@pytest.fixture
def synthetic(tmp_path):
    """Two classification settings x 3 seeds; SGN(5) seed 3 is slower than the others."""
    root = tmp_path / "runs"
    sgn = {1: [0.10, 0.80, 0.85, 0.90], 2: [0.10, 0.82, 0.86, 0.88], 3: [0.10, 0.84, 0.87, 0.89]}
    for seed, acc in sgn.items():
        times = [0, 10, 20, 30] if seed != 3 else [0, 15, 30, 45]
        write_run(root, "SGN(5)", seed, times, acc)
    sgd = {
        1: [0.1, 0.5, 0.6, 0.7, 0.75],
        2: [0.1, 0.6, 0.7, 0.8, 0.85],
        3: [0.1, 0.4, 0.5, 0.6, 0.65],
    }
    for seed, acc in sgd.items():
        write_run(root, "SGD(0.1)", seed, [0, 5, 10, 15, 20], acc)
    write_run(root, "Adam(0.001)", 1, [0, 1], [0.1, 0.3], status="running")  # unfinished
    return root


def rows(text: str, header: str) -> dict:
    """The rows of the table under ``header``, by setting."""
    lines = text.split(header, 1)[1].strip().splitlines()[2:]
    out = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = cells[1:]
    return out


def test_tables_match_hand_computed_means_and_stds(synthetic):
    text = report.tables(report.load_results(synthetic), times=[20], epochs=[2])
    after_2 = rows(text, "**test accuracy (%) after 2 epochs**")
    # SGN(5), epoch 2: 0.85, 0.86, 0.87 -> mean 86.00 %, sample std 1.00 %.
    # Times to epoch 2: 20, 20, 30 s -> 23.3 s.
    assert after_2["SGN(5)"] == ["86.00 ± 1.00", "0.3333 ± 0", "23.3", "3/3", "0"]
    # SGD(0.1), epoch 2: 0.6, 0.7, 0.5 -> 60.00 %, std 10.00 %.
    assert after_2["SGD(0.1)"][:4] == ["60.00 ± 10.00", "0.3333 ± 0", "10.0", "3/3"]
    assert "Adam(0.001)" not in after_2  # unfinished run left out

    after_20s = rows(text, "**test accuracy (%) after 20 s of training**")
    # Within 20 s: seeds 1, 2 of SGN(5) reach epoch 2 (0.85, 0.86), seed 3 epoch 1 (0.84).
    mean = np.mean([0.85, 0.86, 0.84]) * 100
    std = np.std([0.85, 0.86, 0.84], ddof=1) * 100
    assert after_20s["SGN(5)"][0] == f"{mean:.2f} ± {std:.2f}" == "85.00 ± 1.00"
    assert after_20s["SGN(5)"][2] == "1-2"
    # SGD: epoch 4 for all: 0.75, 0.85, 0.65.
    assert after_20s["SGD(0.1)"][0] == "75.00 ± 10.00" and after_20s["SGD(0.1)"][2] == "4"


def test_epochs_not_reached_and_diverged_seeds(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "SGD(1)", 1, [0, 1, 2], [0.5, 0.25, 0.125], task="regression")
    write_run(root, "SGD(1)", 2, [0, 1], [0.5, None], task="regression", status="diverged")
    write_run(root, "SGN(2)", 1, [0, 1, 2], [0.5, 0.02, 0.01], task="regression")
    write_run(root, "SGN(2)", 2, [0, 1, 2], [0.5, 0.04, 0.03], task="regression")
    text = report.tables(report.load_results(root), times=[1.5], epochs=[1, 2])
    e1 = rows(text, "**test loss after 1 epochs**")
    assert e1["SGD(1)"][0] == "0.25" and e1["SGD(1)"][3:] == ["2/2", "1"]
    assert e1["SGN(2)"][0] == "0.03 ± 0.014"  # std of 0.02, 0.04: 0.01414...
    e2 = rows(text, "**test loss after 2 epochs**")
    assert e2["SGD(1)"][0] == "0.125" and e2["SGD(1)"][3] == "1/2"
    t = rows(text, "**test loss after 1.5 s of training**")
    assert t["SGN(2)"][0] == "0.03 ± 0.014" and t["SGN(2)"][2] == "1"


def test_figures_and_table_are_written(synthetic, capsys):
    text = report.main(synthetic)
    assert capsys.readouterr().out.startswith(text)
    assert (synthetic / "report" / "table.md").read_text().endswith(text)
    names = sorted(p.name for p in (synthetic / "report").iterdir())
    stems = ["test_acc_vs_epochs", "test_acc_vs_time", "train_loss_vs_epochs", "train_loss_vs_time"]
    assert names == sorted([f"{s}.{x}" for s in stems for x in ("png", "svg")] + ["table.md"])
    for s in stems:
        assert (synthetic / "report" / f"{s}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        svg = (synthetic / "report" / f"{s}.svg").read_text()
        assert "<svg" in svg and "SGN(5) (3 seeds)" in svg and "SGD(0.1) (3 seeds)" in svg
    # Default report points when there is no grid.json: the shortest run's time and epochs.
    table = (synthetic / "report" / "table.md").read_text()
    assert "after 20 s of training" in table and "after 3 epochs" in table


def test_mean_curve_and_band():
    c = [
        report.Curve("SGN(5)", s, "regression", np.arange(n, dtype=float),
                     np.arange(n, dtype=float), np.array(v), np.array(v), np.full(n, np.nan))
        for s, (n, v) in enumerate([(3, [4.0, 2.0, 1.0]), (4, [2.0, 1.0, 0.5, 0.1])])
    ]  # fmt: skip
    y = report._stack(c, "train_loss")
    np.testing.assert_array_equal(y, [[4.0, 2.0, 1.0], [2.0, 1.0, 0.5]])  # cut to shortest
    c[0].diverged = True  # a diverged seed no longer cuts, it ends the mean
    y = report._stack(c, "train_loss")
    assert y.shape == (2, 4) and math.isnan(y[0, 3]) and math.isnan(y.mean(0)[3])


# --------------------------------------------------------------------------- reference


def write_reference(root: Path) -> None:
    def put(name, **res):
        (root / name).mkdir(parents=True)
        (root / name / "results.json").write_text(json.dumps(res))  # allows NaN, as the original
        (root / name / "config.json").write_text("{}")

    put("res_SGN_5_1", avg_loss=[0.5, 0.4, 0.3], test_acc=[0.80, 0.84, 0.86], tot_time=30.0)
    put("res_SGN_5_2", avg_loss=[0.5, 0.4, 0.3], test_acc=[0.82, 0.86, 0.88], tot_time=60.0)
    put("res_SGD_0.1_1", avg_loss=[1.0, float("nan")], test_acc=[0.5, 0.1], tot_time=4.0)
    put("res_SGD_0.1_1_longer", avg_loss=[9.0], test_acc=[0.9], tot_time=1.0)


def test_reference_reader(tmp_path):
    write_reference(tmp_path)
    ref = {(c.label, c.seed): c for c in report.load_reference(tmp_path)}
    assert sorted(ref) == [("SGD(0.1)", 1), ("SGN(5)", 1), ("SGN(5)", 2)]
    c = ref[("SGN(5)", 2)]
    assert c.reference and c.task == "classification"
    np.testing.assert_array_equal(c.epoch, [1, 2, 3])
    np.testing.assert_allclose(c.time, [20.0, 40.0, 60.0])  # equal epochs over tot_time
    assert ref[("SGD(0.1)", 1)].diverged and not c.diverged


def test_reference_rows_and_overlay(tmp_path, synthetic):
    write_reference(tmp_path / "ref")
    args = ["report", str(synthetic), "--reference", str(tmp_path / "ref"), "--time", "20"]
    assert cli.main(args + ["--epochs", "2", "--quiet"]) == 0
    text = (synthetic / "report" / "table.md").read_text()
    e2 = rows(text, "**test accuracy (%) after 2 epochs**")
    assert e2["SGN(5) [original]"][0] == "85.00 ± 1.41"  # 0.84, 0.86
    assert e2["SGN(5) [original]"][2] == "30.0"  # 20 s and 40 s
    t = rows(text, "**test accuracy (%) after 20 s of training**")
    # Within 20 s: seed 1 reaches epoch 2 (0.84), seed 2 epoch 1 (0.82).
    assert t["SGN(5) [original]"][0] == "83.00 ± 1.41" and t["SGN(5) [original]"][2] == "1-2"
    assert e2["SGN(5)"][0] == "86.00 ± 1.00"  # ours unchanged by the overlay
    svg = (synthetic / "report" / "test_acc_vs_epochs.svg").read_text()
    assert "original (published)" in svg


@pytest.mark.skipif(not ORIGINAL_BOSTON.is_dir(), reason="the original's results are not here")
def test_real_original_boston_results_give_the_paper_numbers():
    ref = report.load_reference(ORIGINAL_BOSTON)
    labels = {c.label for c in ref}
    assert labels == {f"SGN({k})" for k in (1, 2, 3, 5, 10, 20)} | {
        f"SGD({lr:g})" for lr in (0.001, 0.01, 0.1, 1)
    }
    assert len(ref) == 50
    sgn10 = sorted((c for c in ref if c.label == "SGN(10)"), key=lambda c: c.seed)
    # 10 s budgets on the i7: SGN(10) ran 30, 28, 26, 30 and 22 epochs (ORIGINAL.md: 84 ms/it).
    assert [len(c.epoch) for c in sgn10] == [30, 28, 26, 30, 22]
    assert all(c.time[-1] == pytest.approx(10, abs=0.7) for c in sgn10)
    # "Boston SGN(10) after 30 epochs: test loss 0.0098" is seed 1's final value; the final
    # values averaged over the 5 seeds are 0.0103 (mean mini-batch train loss) and 0.0097.
    assert round(sgn10[0].test_loss[29], 4) == 0.0098
    assert np.mean([c.train_loss[-1] for c in sgn10]) == pytest.approx(0.0103, abs=5e-5)
    assert np.mean([c.test_loss[-1] for c in sgn10]) == pytest.approx(0.0097, abs=5e-5)
    assert all(c.diverged for c in ref if c.label == "SGD(1)")
    row = rows(report.tables(ref, [10], [30]), "**test loss after 30 epochs**")[
        "SGN(10) [original]"
    ]
    mean30 = np.mean([sgn10[0].test_loss[29], sgn10[3].test_loss[29]])
    assert row[0].startswith(f"{mean30:.4g} ± ") and row[3] == "2/5"
