"""benchmarks/convergence/time_to_accuracy_fashion.py: its medians over seeds and its table."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks/convergence/time_to_accuracy_fashion.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("time_to_accuracy_fashion", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_a_missed_target_counts_as_slower_than_any_hit(bench):
    assert bench._median([30.0, None, 10.0]) == 30.0
    assert bench._median([None, None, 10.0]) is None
    assert bench._median([4.0, 2.0]) == 3.0
    assert bench._median([4.0, None]) is None


def test_table_reads_the_first_evaluation_at_the_target(bench):
    history = [(2.0, 5, 0.70), (4.0, 10, 0.86), (6.0, 15, 0.85), (8.0, 20, 0.885)]
    assert bench.seconds_to(history, 0.85) == 4.0
    assert bench.seconds_to(history, 0.88) == 8.0
    assert bench.seconds_to(history, 0.9) is None
    runs = [
        dict(history=history, steps=20, seconds=8.0),
        dict(history=[(2.0, 4, 0.86), (4.0, 8, 0.87)], steps=8, seconds=4.0),
        dict(history=[(2.0, 4, 0.851), (4.0, 8, 0.881)], steps=8, seconds=4.0),
    ]
    row = bench.table({"X": runs}, [0.85, 0.88]).splitlines()[-1]
    assert row == "| X | 3 | 2.0 (3/3) | 8.0 (2/3) | 0.8810 | 8 | 0.500 |"


def test_sgn_settings_parse_as_python_literals(bench):
    spec = "label=mine,cg_iters=2,curvature_fraction=0.25,solver='cg',line_search=False"
    assert bench._parse_sgn(spec) == dict(
        label="mine", cg_iters=2, curvature_fraction=0.25, solver="cg", line_search=False
    )
