"""Levenberg-Marquardt acceptance, the damping rules, and the paper's configuration."""

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from cases import LOSSES, MODELS, dense_ggn, flat_parameters, loss_fn, make_batch
from torch_sgn import SGN
from torch_sgn.solve import core, direct
from torch_sgn.solve.step import DAMPING_MAX, nielsen_update, rejected_update

pytestmark = pytest.mark.usefixtures("each_engine")  # every test, once per engine

#: An exact solve per attempt (CG run to convergence), no line search, so each attempt's step
#: is the dense reference's.
# The plain Levenberg-Marquardt steps of the references (the acceleration: test_geodesic.py).
EXACT_LM = dict(
    solver="cg", cg_tol=0.0, cg_rtol=1e-13, line_search=False, lr=1.0, momentum=0.0,
    geodesic_acceleration=False, reject_uphill=False,
)  # fmt: skip


def _loss_at(model, loss, x, y, flat):
    probe = copy.deepcopy(model)
    nn.utils.vector_to_parameters(flat, probe.parameters())
    with torch.no_grad():
        return float(loss_fn(loss)(probe(x), y))


def _hard_batch():
    """An MLP far from its targets: an almost undamped Gauss-Newton step overshoots."""
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    return model, x, 5.0 * y + 3.0


def _reference_attempts(model, x, y, damping, growths, c=1e-4, attempts=10):
    """The attempts by dense solves: the first damping whose full step passes Armijo."""
    G, g, theta = dense_ggn(model, "mse", x, y)
    loss0 = _loss_at(model, "mse", x, y, theta)
    eye = torch.eye(len(theta), dtype=G.dtype)
    tried = []
    for k in range(attempts):
        d = -torch.linalg.solve(G + damping * eye, g)
        value = _loss_at(model, "mse", x, y, theta + d)
        tried.append((damping, value))
        if value <= loss0 + c * float(g @ d) or k == attempts - 1:
            return theta + d, tried, loss0
        damping = growths(damping, k)


def test_a_rejected_step_is_solved_again_with_more_damping():
    model, x, y = _hard_batch()
    rho0 = 1e-8
    expected, tried, loss0 = _reference_attempts(
        model, x, y, rho0, lambda rho, k: rho * 2.0 ** (k + 1)
    )
    assert len(tried) >= 2 and tried[0][1] > loss0  # the problem does what it is meant to
    n = expected.numel()
    opt = SGN(
        model, "mse", damping=rho0, damping_min=1e-12, cg_iters=4 * n, attempts=10,
        damping_update="nielsen", **EXACT_LM,
    )  # fmt: skip
    info = opt.step(x, y)
    assert info.attempts == len(tried)
    assert info.damping == pytest.approx(tried[-1][0], rel=1e-12)
    # the parameters moved once, by the accepted attempt's step: rejected ones left no trace
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-7, atol=1e-9)
    assert info.loss_after < info.loss == pytest.approx(loss0, rel=1e-12)
    assert info.loss_after == pytest.approx(
        _loss_at(model, "mse", x, y, flat_parameters(model)), rel=1e-10
    )
    assert info.loss_evals == len(tried)


def test_the_threshold_rule_retries_with_its_own_factor():
    model, x, y = _hard_batch()
    rho0 = 1e-8
    expected, tried, _ = _reference_attempts(
        model, x, y, rho0, lambda rho, k: rho * 1.5, attempts=40
    )
    n = expected.numel()
    opt = SGN(
        model, "mse", damping=rho0, damping_min=1e-12, cg_iters=4 * n, attempts=40,
        damping_update="threshold", **EXACT_LM,
    )  # fmt: skip
    info = opt.step(x, y)
    assert info.attempts == len(tried) > 1
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-7, atol=1e-9)


def test_attempts_count_the_solves_and_one_attempt_is_the_paper_step(monkeypatch):
    model, x, y = _hard_batch()
    solves, depth = [], []
    for name in ("solve_damped", "solve_in_sample_space"):  # the exact routes' solves
        original = getattr(direct, name)

        def counting(space, rhs, damping, *args, _original=original, **kwargs):
            if not depth:  # (the route through the outputs solves through solve_damped)
                solves.append(damping)
            depth.append(1)
            try:
                return _original(space, rhs, damping, *args, **kwargs)
            finally:
                depth.pop()

        monkeypatch.setattr(direct, name, counting)
    info = SGN(model, "mse", damping=1e-8, damping_min=1e-12, attempts=3, solver="direct").step(
        x, y
    )
    assert info.attempts == len(solves) == 3  # every attempt failed here: all were used
    assert solves == sorted(solves) and solves[0] < solves[1] < solves[2]
    solves.clear()
    one = SGN(copy.deepcopy(model), "mse", damping=1e-8, damping_min=1e-12, solver="direct")
    info = one.step(x, y)
    assert info.attempts == len(solves) == 1


def test_a_step_that_raises_during_a_retry_changes_nothing(monkeypatch):
    model, x, y = _hard_batch()
    model = nn.Sequential(*model, nn.Dropout(0.1))  # training-mode randomness too
    opt = SGN(model, "mse", damping=1e-8, damping_min=1e-12, attempts=5, damping_update="nielsen")
    params = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.state_dict())
    rng = torch.get_rng_state()
    calls = []
    take = core.take

    def failing_trials(lin, state, options, phase, exact, rhs, loss0, point):
        def loss_at(flat):
            calls.append(1)
            if len(calls) == 2:  # the second attempt's trial
                raise RuntimeError("boom")
            return point.loss_at(flat)

        point = dataclasses.replace(point, loss_at=loss_at)
        return take(lin, state, options, phase, exact, rhs, loss0, point)

    monkeypatch.setattr(core, "take", failing_trials)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step(x, y)
    assert len(calls) == 2
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k])
    assert opt.state_dict() == state
    assert torch.equal(torch.get_rng_state(), rng)


def test_nielsen_rule_values():
    # accepted: factor max(1/3, 1 - (2r - 1)^3)
    assert nielsen_update(1.0, 1.0, 1e-9) == pytest.approx(1 / 3)
    assert nielsen_update(1.0, 0.5, 1e-9) == pytest.approx(1.0)
    assert nielsen_update(1.0, 0.25, 1e-9) == pytest.approx(1 + 0.5**3)
    assert nielsen_update(1.0, 1e-9, 1e-9) == pytest.approx(2.0, rel=1e-6)
    assert nielsen_update(1.0, 7.0, 1e-9) == pytest.approx(1 / 3)  # a better-than-predicted step
    assert nielsen_update(1.0, math.nan, 1e-9) == 2.0
    assert nielsen_update(1e-9, 1.0, 1e-9) == 1e-9  # the floor
    # rejected: 2, 4, 8, ... times, capped
    rho, nu, seen = 1.0, 2.0, []
    for _ in range(4):
        rho, nu = rejected_update(rho, nu)
        seen.append(rho)
    assert seen == [2.0, 8.0, 64.0, 1024.0] and nu == 32.0
    assert rejected_update(DAMPING_MAX / 3, 8.0) == (DAMPING_MAX, 16.0)


def test_damping_falls_to_the_floor_and_never_below_on_an_exact_model():
    # a linear model with squared loss: the Gauss-Newton model is exact, every ratio is 1,
    # so the damping divides by 3 each step until the floor holds it
    torch.manual_seed(0)
    model = nn.Linear(5, 2).double()
    x, y = torch.randn(40, 5, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64)
    y = y + 1e-3 * torch.randn(40, 2, dtype=torch.float64)
    floor = 1e-7
    opt = SGN(model, "mse", damping=1e-3, damping_min=floor, damping_update="nielsen", cg_iters=2)
    dampings = []
    for _ in range(14):
        y = y + 0.1 * torch.randn_like(y)  # a fresh batch: keeps the predicted change real
        info = opt.step(x, y)
        dampings.append(info.next_damping)
        assert info.attempts == 1
    assert min(dampings) >= floor and dampings[-1] == floor
    assert dampings[0] == pytest.approx(1e-3 / 3, rel=1e-3)


def test_damping_grows_after_an_exhausted_step_and_the_growth_is_state():
    model, x, y = _hard_batch()
    opt = SGN(
        model, "mse", damping=1e-10, damping_min=1e-12, attempts=2, damping_update="nielsen",
        line_search=False, cg_iters=200, cg_tol=0.0, reject_uphill=False,
    )  # fmt: skip
    info = opt.step(x, y)
    state = opt.state_dict()["state"][0]
    if info.attempts == 2 and info.loss_after > info.loss:  # both attempts failed
        assert info.damping == pytest.approx(2e-10)
        assert info.next_damping == pytest.approx(8e-10) and state["damping_growth"] == 8.0
    else:  # pragma: no cover - the batch above is built so that both fail
        pytest.fail(f"expected two failed attempts, got {info}")


def test_paper_equals_the_explicit_paper_configuration():
    paper_arguments = dict(
        lr=1.0, damping=1e-4, damping_min=1e-6, cg_iters=10, cg_tol=1e-6, cg_rtol=0.0,
        cg_progress_tol=0.0, attempts=1, solver="cg", damping_update="threshold", line_search=True,
        trust_region=True, momentum=0.0, warmup_cg_iters=10, warmup_steps=10,
        damping_schedule="constant", damping_decay_steps=10, preconditioner=False,
        preconditioner_exponent=1.0, warm_start=0.0, ls_c=1e-4, ls_shrink=0.5, ls_max_evals=10,
        geodesic_acceleration=False, reject_uphill=False,
    )  # fmt: skip
    for overrides in (dict(), dict(cg_iters=3), dict(cg_iters=2, line_search=False)):
        model, x, y = make_batch(MODELS[0], LOSSES[2])
        twin = copy.deepcopy(model)
        a = SGN.paper(model, "cross_entropy", **overrides)
        b = SGN(twin, "cross_entropy", **{**paper_arguments, **overrides})
        assert a.param_groups[0].keys() == b.param_groups[0].keys()
        for key in b.defaults:
            assert a.defaults[key] == b.defaults[key], key
        batches = [(x + 0.05 * k, y) for k in range(8)]
        assert [a.step(*xy) for xy in batches] == [b.step(*xy) for xy in batches]
        assert torch.equal(flat_parameters(model), flat_parameters(twin))
    with pytest.raises(TypeError, match="no_such_option"):
        SGN.paper(model, "mse", no_such_option=1)
