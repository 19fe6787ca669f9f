"""No uphill steps (``reject_uphill=True``, the default): a step whose line search ends above
the batch's starting loss is solved again with more damping, or not taken; ``SGN.paper`` takes
it, as the original does."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cases import flat_parameters, sgn_options
from torch_sgn import SGN
from torch_sgn.options import PAPER_OPTIONS
from torch_sgn.solve.core import CGDescent
from torch_sgn.solve.state import DampingState, StepState
from torch_sgn.solve.step import UPHILL_RESOLVES, DampingRule, LineSearch, Problem, damped_step

STEPS = 4


def _l1(outputs, targets):
    return F.l1_loss(outputs, targets)


def _problem(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 5, generator=g, dtype=dtype)
    y = torch.randn(64, 1, generator=g, dtype=dtype)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
    return model, x, y


def _loss(model, loss, x, y):
    with torch.no_grad():
        return float(F.mse_loss(model(x), y) if loss == "mse" else loss(model(x), y))


#: The cases of the report: the L1 loss, whose Gauss-Newton matrix is zero (so the undamped
#: step is ``-g / damping``, 10^4 times the gradient), and a step size of 10^6. Without the
#: rule each went uphill at every step (0.95 -> 9.4 -> 39 -> 106 and 1.5 -> 3.7e7 -> 2.2e14).
UPHILL_CASES = [
    pytest.param(_l1, {}, id="l1_loss"),
    pytest.param("mse", dict(lr=1e6), id="lr_1e6"),
]


@pytest.mark.parametrize("engine", ["auto", "functional"])
@pytest.mark.parametrize("loss, options", UPHILL_CASES)
def test_no_step_raises_the_batch_loss(loss, options, engine):
    model, x, y = _problem()
    opt = SGN(model, loss, engine=engine, **options)
    infos = []
    for _ in range(STEPS):
        before = _loss(model, loss, x, y)
        info = opt.step(x, y)
        after = _loss(model, loss, x, y)  # recomputed from the model, not taken from the info
        assert info.loss == pytest.approx(before, rel=1e-6)
        assert info.loss_after <= info.loss
        assert after <= before
        assert info.taken == (after < before)
        infos.append(info)
    # The first step was uphill: it says so, and was solved again with a larger damping.
    first = infos[0]
    assert first.uphill_resolves >= 1
    assert first.attempts == first.uphill_resolves + 1
    assert first.damping > opt.defaults["damping"]
    assert _loss(model, loss, x, y) < infos[0].loss  # the steps made progress


@pytest.mark.parametrize("loss, options", UPHILL_CASES)
def test_paper_keeps_the_original_uphill_step(loss, options):
    model, x, y = _problem()
    opt = SGN.paper(model, loss, **options)
    start = flat_parameters(model)
    info = opt.step(x, y)
    assert not PAPER_OPTIONS["reject_uphill"]
    assert info.taken and info.uphill_resolves == 0 and not info.line_search_ok
    assert info.loss_after > info.loss
    assert _loss(model, loss, x, y) == pytest.approx(info.loss_after, rel=1e-5)
    assert not torch.equal(flat_parameters(model), start)


def test_rejected_step_leaves_the_parameters_bit_for_bit():
    """A step far too long for any re-solve (no line search, lr 1e30): every trial ends at a
    non-finite or higher loss, so the step is not taken, and the damping still grows."""
    model, x, y = _problem()
    opt = SGN(model, "mse", lr=1e30, line_search=False, solver="cg")
    start, buffers = flat_parameters(model), copy.deepcopy(model.state_dict())
    info = opt.step(x, y)
    assert not info.taken
    assert info.uphill_resolves == UPHILL_RESOLVES
    assert info.attempts == UPHILL_RESOLVES + 1
    assert info.loss_after == info.loss and info.step_size == 0.0
    assert torch.equal(flat_parameters(model), start)
    assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())
    # raised at every re-solve (x 1.5 with the line search off), and again for the next step
    assert info.damping == pytest.approx(1e-4 * 1.5**UPHILL_RESOLVES)
    assert info.next_damping > info.damping
    assert opt.state[next(model.parameters())]["step"] == 1


def test_resolved_step_is_the_damped_gradient_step():
    """The re-solved L1 step against a float64 reference: the L1 loss's Gauss-Newton matrix is
    zero, so the step at damping ``rho`` is ``-a lr g / rho``, with ``g`` by autograd and
    ``rho`` the damping it reports."""
    model, x, y = _problem(torch.float64)
    reference = copy.deepcopy(model)
    reference.zero_grad()
    _l1(reference(x), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    opt = SGN(model, _l1, solver="cg", cg_iters=2)
    start = flat_parameters(model)
    info = opt.step(x, y)
    assert info.taken and info.uphill_resolves >= 1
    expected = start - info.step_size * g / info.damping
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("update", ["threshold", "nielsen"])
def test_a_resolved_step_hands_on_the_first_solves_damping(update):
    """The raised damping serves the re-solved step alone: the next step starts from the
    damping the trust region set after the first (uphill) solve, the failed ratio's raise of the
    starting damping (1.5x by the threshold rule; Nielsen's growth, 2x, by his)."""
    model, x, y = _problem(torch.float64)
    opt = SGN(model, _l1, solver="cg", cg_iters=2, damping=1e-4, damping_update=update)
    info = opt.step(x, y)
    assert info.taken and info.uphill_resolves >= 1
    assert info.damping >= 512 * 1e-4  # the re-solve's
    assert info.next_damping == pytest.approx(1e-4 * (1.5 if update == "threshold" else 2.0))


@pytest.mark.parametrize("update", ["threshold", "nielsen"])
def test_raised_damping_covers_the_line_search(update):
    """A re-solve raises the damping by the rule for a failed attempt, and at least by the
    inverse of the line search's last factor."""
    group = sgn_options(
        trust_region=True, damping_update=update, damping_min=1e-6, attempts=1,
        damping_schedule="constant", damping=1e-4, damping_decay_steps=10, reject_uphill=True,
    )  # fmt: skip
    rule = DampingRule.of(group, exact=False)
    assert rule.uphill_resolves == UPHILL_RESOLVES
    assert DampingRule.of(replace(group, reject_uphill=False), exact=False).uphill_resolves is None
    by_rule = 1.5 if update == "threshold" else 2.0
    damping, growth = rule.raised(1e-3, 2.0, 0.5**9)
    assert damping == pytest.approx(1e-3 * 512)
    damping, growth = rule.raised(1e-3, 2.0, 1.0)  # line search off: the rule alone
    assert damping == pytest.approx(1e-3 * by_rule)
    assert growth == (4.0 if update == "nielsen" else 2.0)


def test_downhill_steps_do_not_resolve():
    model, x, y = _problem()
    opt = SGN(model, "mse")
    for _ in range(STEPS):
        info = opt.step(x, y)
        assert info.taken and info.uphill_resolves == 0 and info.attempts == 1


def _linear_step(rhs_sign, loss_at, reject_uphill=True):
    """One damped step of a quadratic ``G = I`` with the right-hand side ``rhs_sign * g``, its
    trial losses given by ``loss_at``; returns the outcome and the damping of each solve."""
    grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    rhs = grad if rhs_sign > 0 else -grad

    def operator(v):
        return v.clone()

    descent = CGDescent(operator, rhs, 4, 0.0)
    dampings = []

    def counted(damping):
        dampings.append(damping)
        return descent(damping)

    group = sgn_options(
        trust_region=True, damping_update="threshold", damping_min=1e-6, attempts=1,
        damping_schedule="constant", damping=1e-4, damping_decay_steps=10,
        reject_uphill=reject_uphill, lr=1.0, line_search=True, ls_c=1e-4, ls_shrink=0.5,
        ls_max_evals=10,
    )  # fmt: skip
    problem = Problem(grad, rhs, 1.0, loss_at)
    outcome = damped_step(
        counted, problem, StepState(0, DampingState(1e-4)), DampingRule.of(group, exact=False),
        LineSearch.of(group),
    )  # fmt: skip
    return outcome, dampings


def test_always_uphill_step_is_resolved_then_rejected():
    """Every trial point above the start: the step is solved again UPHILL_RESOLVES times, each
    damping at least 512 times the last (the line search's range), then rejected."""
    outcome, dampings = _linear_step(+1, lambda displacement, a=1.0: 2.0)
    assert outcome.rejected and not outcome.moved
    assert outcome.resolves == UPHILL_RESOLVES and outcome.attempts == UPHILL_RESOLVES + 1
    assert len(dampings) == UPHILL_RESOLVES + 1
    assert all(b >= 512 * a * (1 - 1e-12) for a, b in zip(dampings, dampings[1:]))
    assert outcome.next_damping > dampings[-1]
    # The paper's behaviour: the last trial is taken.
    paper, dampings = _linear_step(+1, lambda displacement, a=1.0: 2.0, reject_uphill=False)
    assert paper.moved and not paper.rejected and len(dampings) == 1


def test_climbing_gradient_average_is_rejected_without_resolves():
    """A right-hand side (a gradient average) that climbs on the batch: more damping only turns
    the step towards it, so the uphill step is rejected without a re-solve."""
    grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    outcome, dampings = _linear_step(
        -1, lambda displacement, a=1.0: 1.0 + float(grad @ displacement)
    )
    assert outcome.rejected and outcome.resolves == 0 and len(dampings) == 1


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_reject_uphill_must_be_a_bool(value):
    model, _, _ = _problem()
    with pytest.raises(ValueError, match="invalid reject_uphill="):
        SGN(model, "mse", reject_uphill=value)


def test_a_state_dict_without_the_option_is_refused_and_changes_nothing():
    model, x, y = _problem()
    opt = SGN(model, "mse")
    opt.step(x, y)
    saved = opt.state_dict()
    del saved["param_groups"][0]["reject_uphill"]
    again = SGN(model, "mse", reject_uphill=False)
    before = again.state_dict()
    with pytest.raises(ValueError, match="reject_uphill"):
        again.load_state_dict(saved)
    assert again.param_groups[0]["reject_uphill"] is False
    assert again.state_dict()["state"] == before["state"]
