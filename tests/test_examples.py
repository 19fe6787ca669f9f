"""The examples that train models other than Sequential chains run in their quick mode."""

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _quick_output(name: str, capsys) -> str:
    """What the example prints in its quick mode, on one thread."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        module.main(["--quick", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def _run(name: str, capsys) -> list:
    out = _quick_output(name, capsys)
    return re.findall(r"^(SGN|Adam)\s+epoch (\d+)\s+train loss (\S+)", out, re.M)


def _check(rows: list) -> None:
    assert [(o, e) for o, e, _ in rows] == [
        ("SGN", "1"),
        ("SGN", "2"),
        ("Adam", "1"),
        ("Adam", "2"),
    ]
    assert all(math.isfinite(float(loss)) for _, _, loss in rows)
    assert float(rows[1][2]) < float(rows[0][2])  # SGN's second epoch improves on its first


@pytest.mark.slow
def test_char_transformer_quick(capsys):
    _check(_run("char_transformer", capsys))


@pytest.mark.slow
def test_resnet_fashion_mnist_quick(capsys):
    from torch_sgn.experiments import data

    try:
        data.fashion_mnist(download=False)
    except data.DatasetNotFoundError:
        pytest.skip("Fashion-MNIST is not installed (e.g. Debian's dataset-fashion-mnist)")
    _check(_run("resnet_fashion_mnist", capsys))


@pytest.mark.slow
def test_pinn_poisson_quick(capsys):
    out = _quick_output("pinn_poisson", capsys)
    rows = re.findall(r"loss (\S+)\s+rel\. L2 error (\S+)\s+\((\w+)", out)
    assert len(rows) >= 2 and all(solver == "direct" for _, _, solver in rows)
    errors = [float(e) for _, e, _ in rows]
    assert errors[-1] < 0.1 * errors[0] and errors[-1] < 2e-2


@pytest.mark.slow
def test_deepxde_poisson_quick(capsys):
    import random

    import numpy as np

    pytest.importorskip("deepxde")
    np_state, py_state = np.random.get_state(), random.getstate()
    dtype = torch.get_default_dtype()
    try:
        out = _quick_output("deepxde_poisson", capsys)
    finally:  # the example seeds NumPy's and Python's generators (DeepXDE's set_random_seed)
        np.random.set_state(np_state)
        random.setstate(py_state)
    assert torch.get_default_dtype() == dtype
    (error,) = re.findall(r"rel\. L2 error (\S+) after 40 iterations", out)
    assert float(error) < 1e-4
