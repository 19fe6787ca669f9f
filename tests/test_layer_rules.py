"""The registry of layer rules: extending it, and the documents generated from it."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_sgn import GGN, SGN
from torch_sgn.engines import cuda_graphs as graphs
from torch_sgn.engines.layerwise.engine import Unsupported, plan
from torch_sgn.engines.layerwise.rules import RULES, LayerRule, rule, supported_layers
from torch_sgn.model.flat_model import FunctionalModel

ROOT = Path(__file__).resolve().parent.parent
D = torch.float64


def _layers_doc():
    spec = importlib.util.spec_from_file_location("layers_doc", ROOT / "scripts" / "layers_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layers_table_in_docs_is_generated_from_the_registry():
    text = (ROOT / "docs" / "LAYERS.md").read_text()
    assert text == _layers_doc().render(), "run: PYTHONPATH=src python scripts/layers_doc.py"
    for name in supported_layers():
        assert f"`{name}`" in text


def test_supported_layers_are_the_registered_types():
    names = supported_layers()
    assert names == sorted(kind.__name__ for kind in RULES)
    assert {"Linear", "Conv2d", "ReLU", "MaxPool2d", "Flatten", "Dropout"} <= set(names)
    assert "BatchNorm1d" not in names


def test_docstrings_point_to_the_registry_instead_of_listing_layers():
    sgn_doc = SGN.__init__.__doc__ or SGN.__doc__
    assert "supported_layers()" in sgn_doc and "layerwise.rules" in sgn_doc
    assert "layerwise.rules" in graphs.__doc__


def test_a_type_registered_twice_is_refused():
    with pytest.raises(ValueError, match="Linear already has a rule"):
        rule(nn.Linear)(LayerRule)


class _Hardswish(LayerRule):
    """What a contributor writes for a new layer: f'(z) by autograd, no hand-made cotangent."""

    by_hand = False

    def forward(self, z, params):
        with torch.enable_grad():
            zz = z.detach().requires_grad_(True)
            (d,) = torch.autograd.grad(F.hardswish(zz).sum(), zz)
        return F.hardswish(z), d

    def tangent(self, d, t, vs):
        return None if t is None else t * d

    def value(self, d, z, params):
        return F.hardswish(z)


def test_a_new_rule_is_planned_and_matches_the_functional_engine(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Hardswish(), nn.Linear(6, 2)).to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    with pytest.raises(Unsupported, match="Hardswish"):
        plan(FunctionalModel(model))
    monkeypatch.setitem(RULES, nn.Hardswish, _Hardswish)  # what @rule(nn.Hardswish) does
    assert "Hardswish" in supported_layers()
    steps = plan(FunctionalModel(model))
    assert [type(s) for s in steps][1] is _Hardswish
    assert "Hardswish is not evaluated by hand" in steps[1].capture_obstacle
    fast = GGN(model, "mse", x, y, engine="layerwise")
    ref = GGN(model, "mse", x, y, engine="functional")
    torch.testing.assert_close(fast.gradient, ref.gradient, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast.to_dense(), ref.to_dense(), rtol=1e-9, atol=1e-11)


def test_a_subclass_of_a_supported_layer_is_not_planned():
    class Scaled(nn.Linear):
        def forward(self, a):
            return 2 * super().forward(a)

    with pytest.raises(Unsupported, match="Scaled"):
        plan(FunctionalModel(nn.Sequential(Scaled(3, 2))))


def test_a_layer_with_parameters_its_rule_does_not_name_is_not_planned():
    act = nn.Tanh()
    act.register_parameter("scale", nn.Parameter(torch.ones(())))
    with pytest.raises(Unsupported, match="trainable parameters"):
        plan(FunctionalModel(nn.Sequential(nn.Linear(3, 2), act)))
