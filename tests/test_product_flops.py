"""benchmarks/cost/product_flops.py counts against hand counts: a chain of linear layers does three
products of each layer's size in a gradient and four in ``G v`` (two of each in the first)."""

import importlib.util
import sys
from pathlib import Path

import pytest
from torch import nn

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "cost" / "product_flops.py"


@pytest.fixture(scope="module")
def product_flops():
    spec = importlib.util.spec_from_file_location("product_flops_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("name", ["boston", "sine"])
def test_linear_chains_count_three_products_per_gradient_and_four_per_product(product_flops, name):
    import workloads  # (put on the path by the module)

    model, x, _, _ = workloads.batch(name, "cpu")
    sizes = [m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)]
    one = [2 * x.shape[0] * s for s in sizes]  # one product of each layer's size
    grad = 2 * one[0] + 3 * sum(one[1:])
    product = 2 * one[0] + 4 * sum(one[1:])
    row = product_flops.measure(name)
    assert row["grad GFLOP"] * 1e9 == pytest.approx(grad, rel=1e-12)
    assert row["product flops/grad"] == pytest.approx(product / grad, rel=1e-12)
    assert row["setup flops/grad"] == pytest.approx(1.0, rel=1e-12)  # the gradient's passes
    assert row["product ops"] > 0 and row["engine"] == "layer-wise"
