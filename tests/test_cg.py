import math

import pytest
import torch

from cases import LOSSES, MODELS, make_batch
from torch_sgn import GGN, conjugate_gradient
from torch_sgn.solve.step import backtracking, scheduled_damping, trust_region_update


def _spd(n: int, seed: int = 0, cond: float = 100.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    eigs = torch.logspace(0, math.log10(cond), n, dtype=torch.float64)
    return q @ torch.diag(eigs) @ q.T


def test_cg_solves_spd_system_in_n_iterations():
    A = _spd(12)
    b = torch.randn(12, dtype=torch.float64)
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=12)
    torch.testing.assert_close(res.x, torch.linalg.solve(A, b), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(res.residual, A @ res.x - b, rtol=1e-6, atol=1e-9)
    assert res.iterations <= 12 and not res.breakdown


def test_cg_on_damped_ggn_matches_linalg_solve():
    model, x, y = make_batch(MODELS[1], LOSSES[2])
    G = GGN(model, "cross_entropy", x, y)
    rho = 1e-3
    A = G.to_dense() + rho * torch.eye(G.shape[0], dtype=torch.float64)
    b = -G.gradient
    res = conjugate_gradient(lambda v: G @ v + rho * v, b, max_iters=10 * G.shape[0], tol=1e-13)
    assert res.reason == "converged"
    torch.testing.assert_close(res.x, torch.linalg.solve(A, b), rtol=1e-6, atol=1e-9)


def test_preconditioned_cg_reaches_the_same_solution():
    A = _spd(10, seed=3, cond=1e4)
    b = torch.randn(10, dtype=torch.float64)
    m = 1.0 / torch.diagonal(A)
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=50, tol=1e-12, preconditioner=m)
    assert res.reason == "converged"
    torch.testing.assert_close(res.x, torch.linalg.solve(A, b), rtol=1e-7, atol=1e-9)


def test_cg_stops_at_max_iters_and_at_tolerance():
    A = _spd(20, seed=1)
    b = torch.randn(20, dtype=torch.float64)
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=3)
    assert (res.iterations, res.reason) == (3, "max_iters")
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=100, tol=1e-4)
    assert res.reason == "converged" and res.residual.abs().max() <= 1e-4
    # the residual is monotone in the A^{-1} norm: tighter tol, more iterations
    tight = conjugate_gradient(lambda v: A @ v, b, max_iters=100, tol=1e-10)
    assert tight.iterations > res.iterations


def test_cg_quadratic_model_decreases_monotonically():
    A = _spd(15, seed=2, cond=1e3)
    b = torch.randn(15, dtype=torch.float64)
    values = []
    for k in range(1, 16):
        x = conjugate_gradient(lambda v: A @ v, b, max_iters=k).x
        values.append(float(0.5 * x @ A @ x - b @ x))
    assert all(v2 <= v1 + 1e-12 for v1, v2 in zip(values, values[1:]))


def test_cg_warm_start_from_the_solution_stops_at_once():
    A = _spd(8)
    b = torch.randn(8, dtype=torch.float64)
    x_star = torch.linalg.solve(A, b)
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=8, tol=1e-9, x0=x_star)
    assert res.iterations == 0 and res.reason == "converged"
    torch.testing.assert_close(res.x, x_star)


def test_cg_flags_non_positive_curvature_and_keeps_last_good_iterate():
    A = torch.diag(torch.tensor([1.0, -1.0], dtype=torch.float64))
    b = torch.tensor([1.0, 1.0], dtype=torch.float64)
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=5)
    assert res.reason == "non_positive_curvature" and res.breakdown
    assert torch.isfinite(res.x).all()


def test_cg_flags_non_finite_products():
    calls = []

    def matvec(v):
        calls.append(1)
        scale = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        return v * (float("nan") if len(calls) > 1 else scale)

    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    res = conjugate_gradient(matvec, b, max_iters=5)
    assert res.reason == "non_finite" and res.iterations == 1
    assert torch.isfinite(res.x).all() and res.x.abs().sum() > 0


def test_trust_region_rules():
    assert trust_region_update(1.0, 0.1, 1e-6) == 1.5
    assert trust_region_update(1.0, -5.0, 1e-6) == 1.5
    assert trust_region_update(1.0, float("nan"), 1e-6) == 1.5
    assert trust_region_update(1.0, 0.5, 1e-6) == 1.0
    assert trust_region_update(1.0, 0.9, 1e-6) == pytest.approx(2 / 3)
    assert trust_region_update(1e-6, 0.9, 1e-6) == 1e-6  # floored at damping_min
    assert trust_region_update(1.0, 0.25, 0.0) == 1.0 and trust_region_update(1.0, 0.75, 0) == 1.0


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_damping_schedules_decay_to_the_floor(schedule):
    rho0, rho_min, K = 1e-2, 1e-4, 20
    values = [scheduled_damping(schedule, rho0, rho_min, t, K) for t in range(K + 5)]
    assert values[0] == pytest.approx(rho0)
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert all(v == rho_min for v in values[K:])
    mid = scheduled_damping(schedule, rho0, rho_min, K // 2, K)
    expected = 0.5 if schedule == "linear" else math.cos(math.pi / 4)
    assert mid == pytest.approx(rho_min + (rho0 - rho_min) * expected)
    assert scheduled_damping("constant", rho0, rho_min, 100, K) == rho0


def test_the_schedules_the_options_accept_are_the_ones_the_rule_takes():
    from torch_sgn.options import DAMPING_SCHEDULES

    for schedule in DAMPING_SCHEDULES:
        assert 1e-4 <= scheduled_damping(schedule, 1e-2, 1e-4, 5, 20) <= 1e-2
    with pytest.raises(ValueError, match="unknown damping schedule 'step'"):
        scheduled_damping("step", 1e-2, 1e-4, 5, 20)


def test_backtracking_returns_largest_armijo_step():
    # f(a) = (a - 0.2)^2 along the step: slope -0.4 at a = 0, f(0) = 0.04
    def f(a):
        return (a - 0.2) ** 2

    res = backtracking(f, f(0.0), -0.4, c=1e-4)
    assert res.success
    assert res.loss <= f(0.0) + 1e-4 * res.step * -0.4
    assert f(2 * res.step) > f(0.0) + 1e-4 * 2 * res.step * -0.4  # the previous trial failed
    assert res.step == 0.25 and res.evaluations == 3


def test_backtracking_sufficient_decrease_constant_matters():
    def f(a):
        return (a - 0.2) ** 2

    # with c = 0.9 plain decrease is not enough: 0.25 and 0.125 decrease f but fail Armijo
    res = backtracking(f, f(0.0), -0.4, c=0.9)
    assert res.success and res.step == 1 / 32 and res.evaluations == 6


def test_backtracking_gives_up_after_max_evals():
    res = backtracking(lambda a: 1.0 + a, 0.5, -1.0, max_evals=4)
    assert not res.success and res.evaluations == 4 and res.step == 0.125


def test_backtracking_rejects_non_finite_trials():
    res = backtracking(lambda a: float("nan") if a > 0.3 else -a, 0.0, -1.0)
    assert res.success and res.step == 0.25


def test_backtracking_gives_up_at_the_floor_before_trying_below_it():
    # never an Armijo decrease; slope -1: the predicted decrease of a trial is a itself
    tried = []

    def loss_at(a):
        tried.append(a)
        return 1.0 + a

    res = backtracking(loss_at, 0.5, -1.0, floor=0.1)
    # 1, 1/2, 1/4, 1/8 tried; 1/16 would predict a decrease of 1/16 <= 0.1
    assert tried == [1.0, 0.5, 0.25, 0.125]
    assert not res.success and res.step == 0.125 and res.evaluations == 4
    assert all(a * 1.0 > 0.1 for a in tried)
    # at the floor itself: a = 1/8 predicts exactly 0.125, not tried
    tried.clear()
    res = backtracking(loss_at, 0.5, -1.0, floor=0.125, first=1.5)
    assert tried == [0.5, 0.25] and res.evaluations == 3 and res.step == 0.25
    # off (0), it runs to max_evals
    tried.clear()
    res = backtracking(loss_at, 0.5, -1.0, max_evals=6)
    assert len(tried) == 6 and res.step == 1 / 32


def test_backtracking_above_the_floor_still_finds_the_armijo_step():
    # f(a) = (a - 0.2)^2: Armijo holds at a = 0.25, whose predicted decrease 0.1 > floor
    res = backtracking(lambda a: (a - 0.2) ** 2, 0.04, -0.4, c=1e-4, floor=0.05)
    assert res.success and res.step == 0.25 and res.evaluations == 3
    # a floor at its predicted decrease (0.1) stops the search before it
    res = backtracking(lambda a: (a - 0.2) ** 2, 0.04, -0.4, c=1e-4, floor=0.1)
    assert not res.success and res.step == 0.5 and res.evaluations == 2


def _phi(A: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> float:
    return float(0.5 * x @ A @ x - b @ x)


def _textbook_cg_values(A: torch.Tensor, b: torch.Tensor, iters: int) -> list:
    """phi at x_0 = 0, x_1, ..., x_iters of plain CG (Hestenes-Stiefel), from the iterates."""
    x = torch.zeros_like(b)
    r = b.clone()  # here r = b - A x
    p = r.clone()
    values = [0.0]
    for _ in range(iters):
        ap = A @ p
        a = (r @ r) / (p @ ap)
        x = x + a * p
        r_new = r - a * ap
        p = r_new + (r_new @ r_new) / (r @ r) * p
        r = r_new
        values.append(_phi(A, b, x))
    return values


def test_cg_progress_rule_stops_where_martens_test_first_holds():
    # In floating point two CG codes part ways after some tens of iterations on an
    # ill-conditioned system; at this size and condition they agree to the stopping point.
    A = _spd(80, seed=4, cond=1e3)
    b = torch.randn(80, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    eps = 5e-4
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=1000, progress_tol=eps)
    phis = _textbook_cg_values(A, b, res.iterations)

    def holds(i):
        k = max(10, math.ceil(0.1 * i))
        return i > k and phis[i] < 0 and (phis[i] - phis[i - k]) / phis[i] < k * eps

    assert res.reason == "stalled" and res.iterations < 1000
    assert holds(res.iterations) and not any(holds(i) for i in range(1, res.iterations))
    # it stopped on progress, far from a small residual
    assert torch.linalg.vector_norm(A @ res.x - b) > 1e-2 * torch.linalg.vector_norm(b)
    # and near the quadratic's minimum, which is what the rule is after
    x_star = torch.linalg.solve(A, b)
    assert _phi(A, b, res.x) < 0.95 * _phi(A, b, x_star) < 0


def test_cg_with_the_progress_rule_still_solves_the_system():
    A = _spd(40, seed=5, cond=10.0)
    b = torch.randn(40, dtype=torch.float64)
    x_star = torch.linalg.solve(A, b)
    # the rule does not fire while CG still makes progress: a tight residual test ends it
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=200, rtol=1e-10, progress_tol=1e-14)
    assert res.reason == "converged"
    torch.testing.assert_close(res.x, x_star, rtol=1e-9, atol=1e-12)
    # with Martens's epsilon it stops once the model no longer improves: near the solution
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=200, progress_tol=5e-4)
    assert res.reason == "stalled" and res.iterations < 40
    assert _phi(A, b, res.x) - _phi(A, b, x_star) < 1e-6 * abs(_phi(A, b, x_star))
    torch.testing.assert_close(res.x, x_star, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("preconditioned", [False, True])
def test_cg_relative_residual_tolerance(preconditioned):
    A = _spd(30, seed=6, cond=1e3)
    b = 1e-7 * torch.randn(30, dtype=torch.float64)  # small: an absolute tol would stop at once
    m = 1.0 / torch.diagonal(A) if preconditioned else None
    assert conjugate_gradient(lambda v: A @ v, b, max_iters=100, tol=1e-6).iterations == 0
    res = conjugate_gradient(lambda v: A @ v, b, max_iters=100, rtol=1e-3, preconditioner=m)
    assert res.reason == "converged"

    def rel(x):
        return float(torch.linalg.vector_norm(A @ x - b) / torch.linalg.vector_norm(b))

    assert rel(res.x) <= 1e-3 * (1 + 1e-6)
    before = conjugate_gradient(lambda v: A @ v, b, max_iters=res.iterations - 1, preconditioner=m)
    assert rel(before.x) > 1e-3  # the first iterate that passes


def test_cg_rejects_negative_tolerances():
    A = _spd(3)
    b = torch.ones(3, dtype=torch.float64)
    for name in ("tol", "rtol", "progress_tol"):
        with pytest.raises(ValueError, match=name):
            conjugate_gradient(lambda v: A @ v, b, max_iters=3, **{name: -1.0})
    with pytest.raises(ValueError, match="rtol"):
        conjugate_gradient(lambda v: A @ v, b, max_iters=3, rtol=float("nan"))
