"""The damped step's parts (torch_sgn.solve.descents, .step, .state) against independent
references, and the result and state formats the optimizer keeps."""

import copy

import pytest
import torch
from torch import nn

from cases import sgn_options
from torch_sgn import SGN
from torch_sgn.solve.core import CGDescent, MatrixDescent
from torch_sgn.solve.state import KEYS, DampingState, StepState
from torch_sgn.solve.step import DampingRule, LineSearch, Problem, damped_step


def _spd(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return a @ a.T, torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("damping", [1e-3, 1.0])
def test_the_descents_solve_the_damped_system(damping):
    G, g = _spd()
    expected = torch.linalg.solve(G + damping * torch.eye(6, dtype=G.dtype), -g)
    exact = MatrixDescent(lambda: G, g)(damping)
    cg = CGDescent(lambda v: G @ v, g, max_iters=60, tol=0.0, rtol=1e-14)(damping)
    torch.testing.assert_close(exact.x, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cg.x, expected, rtol=1e-7, atol=1e-9)
    assert exact.iterations == 0 and exact.reason == "cholesky" and cg.iterations > 0


def test_a_huge_damping_steps_along_minus_the_gradient_over_the_damping():
    G, g = _spd()
    theta = torch.zeros(6, dtype=torch.float64)

    def loss_at(displacement, a=1.0):  # the undamped quadratic model is the loss
        s = theta + displacement
        return float(g @ s + 0.5 * s @ G @ s)

    rho = 1e10
    group = sgn_options(
        trust_region=True, damping_update="threshold", damping_min=None, attempts=3,
        damping_schedule="constant", damping=rho, damping_decay_steps=10,
        lr=1.0, line_search=True, ls_c=1e-4, ls_shrink=0.5, ls_max_evals=10, reject_uphill=True,
    )  # fmt: skip
    out = damped_step(
        MatrixDescent(lambda: G, g), Problem(g, g, 0.0, loss_at), StepState(0, DampingState(rho)),
        DampingRule.of(group, exact=True), LineSearch.of(group),
    )  # fmt: skip
    torch.testing.assert_close(out.trial.step, -g / rho, rtol=1e-8, atol=0)
    # The prediction counts the damping's term, the loss does not: the ratio is about 2.
    assert out.attempts == 1 and out.ratio == pytest.approx(2.0, rel=1e-6)
    assert out.next_damping == pytest.approx(rho * 2 / 3)  # a ratio above 3/4 lowers it
    assert out.search.success and out.step_factor == 1.0


def test_the_stored_state_is_step_state_as_a_dict_and_round_trips():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    opt = SGN(model, "mse", momentum=0.9, warm_start=0.5, damping_update="nielsen")
    for _ in range(3):
        x = torch.randn(16, 3, dtype=torch.float64)
        opt.step(x, x[:, :1].sin())
    stored = opt.state[next(model.parameters())]
    assert set(stored) <= set(KEYS)
    assert {"step", "damping", "damping_growth", "momentum_buffer", "prev_direction"} <= set(stored)
    state = StepState.of(stored)
    assert state.step == 3 and state.as_dict().keys() == stored.keys()
    saved = copy.deepcopy(opt.state_dict())
    fresh = SGN(model, "mse", momentum=0.9, warm_start=0.5, damping_update="nielsen")
    fresh.load_state_dict(saved)
    again = fresh.state[next(model.parameters())]
    assert again.keys() == stored.keys()
    assert all(
        torch.equal(v, again[k]) if torch.is_tensor(v) else v == again[k] for k, v in stored.items()
    )


def test_state_dicts_with_the_flat_keys_load_into_the_typed_parts():
    """A state dict saved before the state had parts (its keys as they have always been) loads
    into them, and writes back the same keys and values."""
    buffer, direction = torch.arange(3.0), torch.ones(3)
    old = {
        "step": 7, "damping": 0.5, "damping_growth": 4.0, "momentum_buffer": buffer,
        "prev_direction": direction, "exact": True, "recent": [1.0, 0.5], "stalls": 2,
        "sampled_losses": [0.25],
    }  # fmt: skip
    state = StepState.of(old)
    assert state.damping == DampingState(0.5, 4.0)
    assert state.history.momentum_buffer is buffer and state.history.prev_direction is direction
    assert state.history.prev_step is None
    assert state.auto.exact and state.auto.recent == [1.0, 0.5] and state.auto.candidate is None
    assert state.rows.stalls == 2 and state.rows.sampled_losses == [0.25]
    assert state.as_dict() == old
    assert list(state.as_dict()) == [k for k in KEYS if k in old]  # the stored order
