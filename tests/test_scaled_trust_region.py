"""MINPACK's scaled trust-region step (torch_sgn.solve.scaled_trust_region) against dense
float64 solves built independently (torch.linalg.solve, lstsq), and its radius rules."""

import math

import pytest
import torch

from torch_sgn.solve.scaled_trust_region import FACTOR, Radius, Scaled, update

D = torch.float64


def _problem(seed=0, rows=12, cols=4):
    """A Jacobian whose columns differ in scale by six orders of magnitude, and residuals."""
    g = torch.Generator().manual_seed(seed)
    jac = torch.randn(rows, cols, generator=g, dtype=D) * torch.logspace(-3, 3, cols, dtype=D)
    r = torch.randn(rows, generator=g, dtype=D)
    return jac, r


def test_the_start_scales_by_the_columns_and_sets_the_first_radius():
    jac, _ = _problem()
    jac[:, 1] = 0.0  # a column of zeros scales by 1
    theta = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=D)
    state = Radius.start(theta, jac)
    expected = jac.norm(dim=0)
    expected[1] = 1.0
    torch.testing.assert_close(state.scale, expected, rtol=0, atol=0)
    assert state.radius == pytest.approx(FACTOR * float((expected * theta).norm()), rel=1e-15)
    state.rescaled(2 * jac)  # the running maximum
    torch.testing.assert_close(state.scale, torch.maximum(expected, 2 * jac.norm(dim=0)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("radius", [1e-3, 1e-1, 1.0])
def test_a_short_radius_gives_the_damped_step_of_that_scaled_length(seed, radius):
    jac, r = _problem(seed)
    scale = jac.norm(dim=0)
    state = Radius(scale, radius)
    step, damping = Scaled.of(jac, jac.T @ r, state.scale).step(state.radius)
    assert damping > 0
    # (J^T J + lambda D^2) p = -J^T r, by a dense solve
    matrix = jac.T @ jac + damping * torch.diag(scale**2)
    torch.testing.assert_close(step, torch.linalg.solve(matrix, -(jac.T @ r)), rtol=1e-9, atol=0)
    assert abs(float((scale * step).norm()) - radius) <= 0.1 * radius


def test_a_long_radius_gives_the_gauss_newton_step():
    jac, r = _problem(1)
    state = Radius(jac.norm(dim=0), 1e12)
    step, damping = Scaled.of(jac, jac.T @ r, state.scale).step(state.radius)
    assert damping == 0.0
    expected = torch.linalg.lstsq(jac, -r.unsqueeze(1)).solution.squeeze(1)
    torch.testing.assert_close(step, expected, rtol=1e-8, atol=0)


def test_the_radius_grows_where_the_model_is_exact_and_shrinks_where_it_fails():
    jac, r = _problem(2)
    scale = jac.norm(dim=0)
    cost = 0.5 * float(r.square().sum())
    # linear residuals r + J p: the model is exact, the ratio 1
    state = Radius(scale, 0.05, first=False)
    step, damping = Scaled.of(jac, jac.T @ r, state.scale).step(state.radius)
    exact = 0.5 * float((r + jac @ step).square().sum())
    ratio = update(state, step, damping, jac, cost, exact)
    assert ratio == pytest.approx(1.0, rel=1e-9)
    assert state.radius == pytest.approx(2 * float((scale * step).norm()), rel=1e-15)
    # the cost rose: the ratio is negative and the radius shrinks to at most half the step's
    state = Radius(scale, 0.05, first=False)
    ratio = update(state, step, damping, jac, cost, 2 * cost)
    assert ratio < 0
    assert state.radius <= 0.5 * 0.05 + 1e-15
    # a non-finite cost: the smallest shrink, a tenth
    state = Radius(scale, 0.05, first=False)
    update(state, step, damping, jac, cost, math.nan)
    assert state.radius == pytest.approx(0.1 * min(0.05, float((scale * step).norm()) / 0.1))


def test_the_first_radius_is_at_most_the_first_step():
    jac, r = _problem(3)
    state = Radius.start(torch.ones(4, dtype=D), jac)
    step, damping = Scaled.of(jac, jac.T @ r, state.scale).step(state.radius)
    length = float((state.scale * step).norm())
    cost = 0.5 * float(r.square().sum())
    update(state, step, damping, jac, cost, 0.5 * float((r + jac @ step).square().sum()))
    assert not state.first and state.radius == pytest.approx(2 * length, rel=1e-12)


def test_the_acceleration_solves_the_damped_system_for_its_right_hand_side():
    jac, r = _problem(4)
    scale = jac.norm(dim=0)
    scaled = Scaled.of(jac, jac.T @ r, scale)
    step, damping = scaled.step(0.01)
    b = torch.randn(4, generator=torch.Generator().manual_seed(5), dtype=D)
    matrix = jac.T @ jac + damping * torch.diag(scale**2)
    expected = torch.linalg.solve(matrix, -b)
    torch.testing.assert_close(scaled.acceleration(b, damping), expected, rtol=1e-9, atol=0)
