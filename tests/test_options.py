"""SGN's options and settings: their defaults live on Options and Setup, SGN's signature and
docstring repeat them, and replace() checks as SGN's constructor does."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from cases import library_calls
from torch_sgn import SGN, least_squares
from torch_sgn.options import OPTION_ARGUMENTS, SETUP_KEYS, Options, Setup

#: SGN's keyword arguments that are neither options nor settings.
OTHERS = {"process_group"}


def _keywords() -> dict:
    sig = inspect.signature(SGN.__init__)
    return {n: p for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_every_keyword_of_sgn_is_an_option_a_setting_or_named_here():
    assert set(_keywords()) == set(OPTION_ARGUMENTS) | set(SETUP_KEYS) | OTHERS


@pytest.mark.parametrize("name", OPTION_ARGUMENTS)
def test_sgn_signature_default_is_the_options_default(name):
    key = {"momentum": "gradient_averaging"}.get(name, name)
    assert _keywords()[name].default == getattr(Options(), key)


@pytest.mark.parametrize("name", SETUP_KEYS)
def test_sgn_signature_default_is_the_setups_default(name):
    assert _keywords()[name].default == getattr(Setup(), name)


@pytest.mark.parametrize("name", sorted(set(OPTION_ARGUMENTS) | set(SETUP_KEYS) | OTHERS))
def test_sgn_docstring_documents_each_argument(name):
    assert f"\n        {name}: " in SGN.__doc__, f"SGN's docstring lacks {name}"


def test_a_new_sgn_holds_the_default_options():
    model = nn.Linear(2, 1)
    opt = SGN(model, "mse")
    assert Options.of(opt.param_groups[0]) == Options()


def test_replace_takes_argument_names_and_checks():
    assert Options().replace(momentum=0.5).gradient_averaging == 0.5
    assert Options().replace(cg_iters=3) == Options(cg_iters=3)
    with pytest.raises(ValueError, match="invalid lr=-1"):
        Options().replace(lr=-1)
    with pytest.raises(ValueError, match="needs trust_region=False"):
        Options().replace(damping_schedule="linear")
    with pytest.raises(TypeError, match="unknown option"):
        Options().replace(gradient_averaging=0.5)  # the key, not the argument's name
    with pytest.raises(ValueError, match="invalid solver"):
        Setup().replace(solver="lbfgs")
    with pytest.raises(TypeError, match="unknown setting"):
        Setup().replace(lr=1.0)
    with pytest.warns(FutureWarning, match="now called engine=.layerwise."):
        assert Setup().replace(engine="fast").engine == "layerwise"  # the alias resolved


def test_sgn_refuses_what_options_refuse_with_the_same_message():
    model = nn.Linear(2, 1)
    for bad in ({"lr": 0.0}, {"momentum": 1.0}, {"ls_c": 2.0}, {"solver": "x"}):
        with pytest.raises(ValueError) as by_sgn:
            SGN(model, "mse", **bad)
        with pytest.raises(ValueError) as by_options:
            (Setup() if "solver" in bad else Options()).replace(**bad)
        assert str(by_sgn.value) == str(by_options.value)


def test_least_squares_builds_no_sgn_for_a_curve_fit():
    t = torch.linspace(0, 1, 20, dtype=torch.float64)
    y = 2.0 * torch.exp(-1.5 * t)
    x = nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    fits = []
    calls = library_calls(
        lambda: fits.append(least_squares(lambda p: p[0] * torch.exp(-p[1] * t) - y, x))
    )
    assert ("optimizer.py", "SGN.__init__") not in calls
    assert ("curve_steps.py", "CurveSteps.__init__") in calls  # (the fit's calls are seen)
    res = fits[0]
    assert res.success
    torch.testing.assert_close(res.x, torch.tensor([2.0, 1.5], dtype=torch.float64))


def test_least_squares_checks_its_options_before_a_step():
    x = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="invalid damping"):
        least_squares(lambda p: p - 2, x, damping=-1.0)
    with pytest.raises(TypeError, match="unknown option"):
        least_squares(lambda p: p - 2, x, dampnig=1.0)
    with pytest.raises(ValueError, match="invalid direct_max_params"):
        least_squares(lambda p: p - 2, x, direct_max_params=-1)
    assert float(x.detach()) == 1.0  # nothing moved
