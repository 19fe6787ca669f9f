"""Smoke test of benchmarks/convergence/regression.py: one short run writes a record whose curve
falls."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence" / "regression.py"


@pytest.fixture(scope="module")
def regression():
    spec = importlib.util.spec_from_file_location("regression_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow  # trains four optimizers
def test_quick_run_writes_a_falling_curve(regression, tmp_path):
    folder = regression.main(
        [
            "--problems",
            "sinc32",
            "--methods",
            "sgn",
            "--quick",
            "--seconds",
            "1",
            "--out",
            str(tmp_path),
            "--name",
            "smoke",
        ]
    )
    record = json.loads((folder / "record.json").read_text())
    assert record["environment"]["threads"] == 1
    assert record["environment"]["torch"]
    result = record["problems"]["sinc32"]
    assert result["parameters"] == 61
    (run,) = result["methods"]
    assert run["label"] == "SGN default" and run["status"] == "ok"
    mse = run["curve"]["mse"]
    assert len(mse) >= 3 and all(m is not None and math.isfinite(m) for m in mse)
    assert mse[0] == pytest.approx(result["initial_mse"])
    assert run["final_mse"] == mse[-1] < mse[0] / 2
    times = run["curve"]["t"]
    assert times == sorted(times) and 1.0 <= times[-1] < 1.5
    # Levels are read off the curve: the first evaluation at or below each one.
    for level, t in run["seconds_to"].items():
        hits = [s for s, m in zip(times, mse) if m <= float(level)]
        assert t == (hits[0] if hits else None)
    # README.md holds the table; --summarize rebuilds it from record.json alone.
    readme = (folder / "README.md").read_text()
    assert record["command"] in readme and "| SGN default |" in readme
    (folder / "README.md").unlink()
    regression.main(["--summarize", str(folder / "record.json")])
    assert (folder / "README.md").read_text() == readme


def test_unknown_sgn_option_is_a_clear_error(regression, capsys):
    with pytest.raises(SystemExit):
        regression.main(["--problems", "sinc32", "--quick", "--sgn", "no_such_option=3"])
    err = capsys.readouterr().err
    assert "no_such_option" in err and "cg_iters" in err


def test_sgn_options_parse_as_literals(regression):
    assert regression.parse_sgn("default") == {}
    assert regression.parse_sgn("cg_iters=61,cg_tol=0") == {"cg_iters": 61, "cg_tol": 0}
    assert regression.parse_sgn("engine=functional, lr=0.5") == {
        "engine": "functional",
        "lr": 0.5,
    }


def test_seconds_to_levels_is_the_first_evaluation_at_or_below(regression):
    got = regression.seconds_to_levels([0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 1e-4, 5e-6, 2e-5, 1e-7])
    assert got == {
        "1e-04": 1.0,
        "1e-05": 2.0,
        "1e-06": 4.0,
        "1e-07": 4.0,
        "1e-08": None,
        "1e-09": None,
        "1e-10": None,
    }
