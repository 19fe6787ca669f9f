"""step_rule="quadratic": the step size and momentum chosen on the damped quadratic model
(torch_sgn.solve.quadratic), against dense float64 references."""

import copy

import pytest
import torch
from torch import nn

from cases import LOSS, MODELS, dense_ggn, flat_parameters, make_batch
from torch_sgn import SGN
from torch_sgn.solve.cg import conjugate_gradient
from torch_sgn.solve.core import CGDescent
from torch_sgn.solve.quadratic import QuadraticDescent, step_coefficients
from torch_sgn.solve.step import Solution


def _problem(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    J = torch.randn(2 * n, n, generator=g, dtype=torch.float64)
    G = J.T @ J / n
    grad = torch.randn(n, generator=g, dtype=torch.float64)
    d = torch.randn(n, generator=g, dtype=torch.float64)
    prev = torch.randn(n, generator=g, dtype=torch.float64)
    return G, grad, d, prev


def _model_value(grad, A, s):
    return grad @ s + 0.5 * s @ A @ s


@pytest.mark.parametrize("seed", range(3))
def test_coefficients_minimise_the_model_over_the_span_by_brute_force(seed):
    G, grad, d, prev = _problem(seed=seed)
    A = G + 1e-2 * torch.eye(len(grad), dtype=torch.float64)
    alpha, beta = step_coefficients(grad, d, A @ d, prev, A @ prev)
    best = _model_value(grad, A, alpha * d + beta * prev)
    # Brute force: a grid of (alpha, beta) around the solution, fine near it.
    offsets = torch.linspace(-1, 1, 81, dtype=torch.float64) ** 3 * (1 + abs(alpha) + abs(beta))
    a, b = torch.meshgrid(alpha + offsets, beta + offsets, indexing="ij")
    S = a.reshape(-1, 1) * d + b.reshape(-1, 1) * prev
    values = S @ grad + 0.5 * ((S @ A) * S).sum(1)
    assert best <= values.min() + 1e-12 * abs(best)
    # and the model's gradient is orthogonal to the span there
    residual = A @ (alpha * d + beta * prev) + grad
    torch.testing.assert_close(
        torch.stack([d @ residual, prev @ residual]), torch.zeros(2, dtype=torch.float64),
        atol=1e-10, rtol=0,
    )  # fmt: skip


def test_without_a_previous_update_or_along_it_the_rule_is_one_dimensional():
    G, grad, d, _ = _problem()
    A = G + 1e-3 * torch.eye(len(grad), dtype=torch.float64)
    exact = -(grad @ d) / (d @ A @ d)
    alpha, beta = step_coefficients(grad, d, A @ d, None, None)
    assert beta == 0.0 and alpha == pytest.approx(exact.item(), rel=1e-12)
    parallel = -3 * d  # a singular 2x2 system
    alpha, beta = step_coefficients(grad, d, A @ d, parallel, A @ parallel)
    assert beta == 0.0 and alpha == pytest.approx(exact.item(), rel=1e-12)


def test_quadratic_descent_returns_the_step_with_its_residual_and_predicted_change():
    G, grad, _, prev = _problem(seed=4)
    rho = 0.05
    A = G + rho * torch.eye(len(grad), dtype=torch.float64)
    inner = CGDescent(lambda v: G @ v, grad, max_iters=2, tol=0.0)
    result = QuadraticDescent(inner, lambda v: G @ v, grad, grad, prev)(rho)
    d = conjugate_gradient(lambda v: A @ v, -grad, max_iters=2, tol=0.0).x
    # the reference: the minimiser over span{d, prev} by a dense least-squares solve
    B = torch.stack([d, prev], 1)
    c = torch.linalg.solve(B.T @ A @ B, -B.T @ grad)
    s = B @ c
    torch.testing.assert_close(result.x, s, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(result.residual, A @ s + grad, rtol=1e-9, atol=1e-12)
    predicted = Solution.of(grad, grad, result, 1.0).predicted
    assert predicted == pytest.approx(_model_value(grad, A, s).item(), rel=1e-9)
    assert predicted < _model_value(grad, A, d).item()  # better than d alone


def test_sgn_step_is_the_dense_minimiser_over_the_direction_and_the_last_update():
    model, x, y = make_batch(MODELS[0], LOSS["cross_entropy"])
    rho = 1e-2
    opt = SGN(
        model, "cross_entropy", solver="cg", cg_iters=1, cg_tol=0.0, damping=rho,
        trust_region=False, line_search=False, step_rule="quadratic",
    )  # fmt: skip
    theta0 = flat_parameters(model)
    opt.step(x, y)
    theta1 = flat_parameters(model)
    opt.step(x, y)
    theta2 = flat_parameters(model)
    # Reference at theta1: G and g by dense autograd, CG's one iteration in closed form.
    G, g, _ = dense_ggn(model_at(model, theta1), "cross_entropy", x, y)
    A = G + rho * torch.eye(len(g), dtype=torch.float64)
    d = -(g @ g) / (g @ A @ g) * g
    B = torch.stack([d, theta1 - theta0], 1)
    expected = B @ torch.linalg.solve(B.T @ A @ B, -B.T @ g)
    torch.testing.assert_close(theta2 - theta1, expected, rtol=1e-7, atol=1e-10)
    assert opt.state[opt.param_groups[0]["params"][0]]["prev_step"] is not None


def model_at(model, theta):
    nn.utils.vector_to_parameters(theta, model.parameters())
    return model


def test_exact_directions_take_the_full_step():
    """With CG solved to convergence, d minimises the model everywhere: alpha = 1, beta = 0,
    so the rule takes the same steps as ``"lr"`` with ``lr=1``."""
    runs = []
    for rule in ("lr", "quadratic"):
        model, x, y = make_batch(MODELS[0], LOSS["mse"])
        opt = SGN(
            model, "mse", solver="cg", cg_iters=200, cg_tol=1e-13, damping=1e-1,
            trust_region=False, line_search=False, step_rule=rule,
        )  # fmt: skip
        for _ in range(3):
            opt.step(x, y)
        runs.append(flat_parameters(model))
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-8, atol=1e-10)


def test_invalid_step_rule_is_refused_by_name():
    model, _, _ = make_batch(MODELS[0], LOSS["mse"])
    with pytest.raises(ValueError, match="step_rule='momentum'.*'lr', 'quadratic'"):
        SGN(model, "mse", step_rule="momentum")


def test_a_resumed_run_takes_the_same_quadratic_steps():
    """The previous update is part of the state: a run resumed from a state_dict goes on with
    the same momentum."""
    model, x, y = make_batch(MODELS[0], LOSS["cross_entropy"])
    options = dict(solver="cg", cg_iters=2, step_rule="quadratic")
    opt = SGN(model, "cross_entropy", **options)
    opt.step(x, y)
    twin = copy.deepcopy(model)
    resumed = SGN(twin, "cross_entropy", **options)
    resumed.load_state_dict(opt.state_dict())
    fresh_model = copy.deepcopy(model)
    fresh = SGN(fresh_model, "cross_entropy", **options)  # no previous update: beta = 0
    for o in (opt, resumed, fresh):
        o.step(x, y)
    torch.testing.assert_close(flat_parameters(twin), flat_parameters(model), rtol=1e-12, atol=0)
    assert not torch.allclose(
        flat_parameters(fresh_model), flat_parameters(model), rtol=1e-6, atol=0
    )
