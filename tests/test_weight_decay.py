"""SGN(weight_decay=lambda): the objective loss + (lambda/2) ||theta||^2, its gradient
g + lambda theta and curvature G + lambda I, against independent float64 references."""

import copy

import pytest
import torch
from torch import nn

from cases import LOSSES, MODELS, dense_parts, flat_parameters, make_batch
from torch_sgn import SGN

pytestmark = pytest.mark.usefixtures("each_engine")  # every test, once per engine

EXACT = dict(
    line_search=False, trust_region=False, lr=1.0, momentum=0.0, cg_tol=0.0,
    geodesic_acceleration=False,
)  # fmt: skip


def _ridge_problem(n=40, features=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    w = torch.randn(features, 1, generator=g, dtype=torch.float64)
    y = x @ w + 0.3 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


def _ridge_solution(x, y, weight_decay):
    """argmin (1/N) ||A w - y||^2 + (lambda/2) ||w||^2 over w = (weight, bias), by least squares
    on the augmented system [A; sqrt(N lambda / 2) I] w = [y; 0] (no normal equations)."""
    n = x.shape[0]
    a = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)
    p = a.shape[1]
    a_aug = torch.cat([a, (n * weight_decay / 2) ** 0.5 * torch.eye(p, dtype=x.dtype)])
    y_aug = torch.cat([y.reshape(-1), torch.zeros(p, dtype=x.dtype)])
    return torch.linalg.lstsq(a_aug, y_aug.unsqueeze(1)).solution.squeeze(1)


@pytest.mark.parametrize("solver", ["direct", "cg"])
@pytest.mark.parametrize("weight_decay", [0.05, 2.0])
def test_one_step_on_ridge_regression_lands_on_the_ridge_solution(solver, weight_decay):
    """A linear model with squared error: the Gauss-Newton model of the penalized objective is
    exact, so one step with a vanishing damping solves the ridge problem, and the trust-region
    ratio is 1."""
    x, y = _ridge_problem()
    model = nn.Linear(5, 1).double()
    opt = SGN(
        model, "mse", solver=solver, weight_decay=weight_decay, damping=1e-12, damping_min=0.0,
        cg_iters=50, cg_tol=0.0,
    )  # fmt: skip
    info = opt.step(x, y)
    expected = _ridge_solution(x, y, weight_decay)
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-9, atol=1e-10)
    assert info.solver == ("direct" if solver == "direct" else "cg")
    assert info.tr_ratio == pytest.approx(1.0, abs=1e-6)
    assert info.step_size == 1.0


@pytest.mark.parametrize("loss_case", [LOSSES[0], LOSSES[2]], ids=lambda c: c.name)
@pytest.mark.parametrize("solver", ["direct", "cg"])
def test_the_step_solves_the_penalized_damped_system(loss_case, solver):
    """d = -(J^T H J + (lambda + rho) I)^{-1} (g + lambda theta) with J, H and g by autograd.
    The batch has fewer outputs than the model has parameters, so without weight decay the
    direct solver would solve through the outputs, where g + lambda theta does not fit."""
    model, x, y = make_batch(MODELS[0], loss_case)
    weight_decay, damping = 0.3, 1e-2
    loss = loss_case.make()
    _, J, H, g, theta = dense_parts(model, loss, x, y)
    assert J.shape[0] < J.shape[1]  # R < P
    P = theta.numel()
    A = J.T @ H @ J + (weight_decay + damping) * torch.eye(P, dtype=J.dtype)
    expected = theta - torch.linalg.solve(A, g + weight_decay * theta)
    opt = SGN(
        model, loss, solver=solver, weight_decay=weight_decay, damping=damping, cg_iters=200,
        **EXACT,
    )  # fmt: skip
    info = opt.step(x, y)
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-8, atol=1e-10)
    assert info.solver == solver


def test_step_info_reports_the_penalized_objective():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    weight_decay = 0.7
    theta = flat_parameters(model)
    penalty = 0.5 * weight_decay * float(theta @ theta)
    with torch.no_grad():
        data_loss = float(nn.functional.mse_loss(model(x), y))
    opt = SGN(model, "mse", weight_decay=weight_decay, solver="cg")
    info = opt.step(x, y)
    after = flat_parameters(model)
    with torch.no_grad():
        objective_after = float(nn.functional.mse_loss(model(x), y))
    objective_after += 0.5 * weight_decay * float(after @ after)
    assert info.penalty == pytest.approx(penalty, rel=1e-12)
    assert info.loss == pytest.approx(data_loss + penalty, rel=1e-12)
    assert info.loss_after == pytest.approx(objective_after, rel=1e-12)
    assert info.loss_after < info.loss
    # Without weight decay the penalty is 0 and the loss is the loss alone.
    plain = SGN(copy.deepcopy(model), "mse").step(x, y)
    assert plain.penalty == 0.0
    with torch.no_grad():
        assert plain.loss == pytest.approx(float(nn.functional.mse_loss(model(x), y)), rel=1e-12)


def test_a_huge_weight_decay_pulls_the_parameters_to_zero():
    """With lambda >> ||G||, the step is -(g + lambda theta) / lambda, close to -theta."""
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse", weight_decay=1e8, damping=1e-12, damping_min=0.0, solver="direct")
    theta = flat_parameters(model)
    opt.step(x, y)
    assert float(flat_parameters(model).abs().max()) < 1e-6 * float(theta.abs().max())


def test_frozen_parameters_keep_their_values_under_weight_decay():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse", weight_decay=0.5, solver="cg")
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt.step(x, y)
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[2].weight, model[2].weight.detach() * 0)


def test_weight_decay_round_trips_through_state_dict():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    batches = [(x + 0.1 * k, y) for k in range(4)]
    opt = SGN(model, "mse", weight_decay=0.25, cg_iters=3, solver="cg")
    opt.step(*batches[0])
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["param_groups"][0]["weight_decay"] == 0.25
    reference = [opt.step(*b) for b in batches[1:]]

    resumed = MODELS[0].build().double()
    resumed.load_state_dict(saved_model)
    opt2 = SGN(resumed, "mse", cg_iters=3, solver="cg")  # weight_decay=0 until loaded
    opt2.load_state_dict(saved_opt)
    assert opt2.param_groups[0]["weight_decay"] == 0.25
    assert [opt2.step(*b) for b in batches[1:]] == reference


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf"), None, "0.1", True])
def test_a_bad_weight_decay_is_refused_by_name(bad):
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"weight_decay=.*must be >= 0 and finite"):
        SGN(model, "mse", weight_decay=bad)


def test_a_bad_weight_decay_set_after_construction_fails_the_step_and_changes_nothing():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse", weight_decay=0.1)
    before = flat_parameters(model)
    opt.param_groups[0]["weight_decay"] = -0.5
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decay'\].*not taken"):
        opt.step(x, y)
    assert torch.equal(flat_parameters(model), before)


def test_a_penalty_inside_a_loss_callable_is_still_refused_with_weight_decay_on():
    model, x, y = make_batch(MODELS[0], LOSSES[0])

    def penalized(outputs, targets):
        return ((outputs - targets) ** 2).mean() + 0.1 * model[0].weight.square().sum()

    opt = SGN(model, penalized, weight_decay=0.1)
    before = flat_parameters(model)
    with pytest.raises(ValueError, match=r"depends on the model's parameters.*weight_decay"):
        opt.step(x, y)
    assert torch.equal(flat_parameters(model), before)


def test_exact_steps_with_weight_decay_go_through_the_outputs_where_they_are_fewer(monkeypatch):
    """The push-through identity handles lambda theta, outside the row space of J: the route
    through the batch's R < P outputs is kept (and gives the dense reference's step, checked
    above for solver="direct"); for a gradient average it is not."""
    from torch_sgn.solve import direct

    calls = []
    solve = direct.solve_in_sample_space
    monkeypatch.setattr(
        direct, "solve_in_sample_space", lambda *a: calls.append(a[0].weight_decay) or solve(*a)
    )
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    SGN(model, "mse", solver="direct", weight_decay=0.3).step(x, y)
    assert calls == [0.3]
    SGN(model, "mse", solver="direct", weight_decay=0.3, momentum=0.5).step(x, y)
    assert calls == [0.3]


@pytest.mark.parametrize("loss_case", [LOSSES[0], LOSSES[2]], ids=lambda c: c.name)
def test_the_routes_through_the_outputs_and_through_g_take_the_same_accelerated_step(
    loss_case, monkeypatch
):
    """With the geodesic acceleration on (a float64 model), whose second solve reuses each
    route's factorization of the penalized system."""
    from torch_sgn import route_plan

    model, x, y = make_batch(MODELS[0], loss_case)
    options = dict(solver="direct", weight_decay=0.2, damping=0.1, geodesic_acceleration=True)
    by_outputs = copy.deepcopy(model)
    first = SGN(by_outputs, loss_case.make(), **options).step(x, y)
    monkeypatch.setattr(route_plan, "samples_fit", lambda *args: False)
    second = SGN(model, loss_case.make(), **options).step(x, y)
    torch.testing.assert_close(
        flat_parameters(by_outputs), flat_parameters(model), rtol=1e-9, atol=1e-11
    )
    assert first.accelerated and second.accelerated
    assert first.loss_after == pytest.approx(second.loss_after, rel=1e-10)


def test_replayed_graph_steps_with_weight_decay_equal_eager_steps(each_engine, cpu_graph_captures):
    """The penalty is added outside the captured set-up, product and trial loss."""
    if each_engine == "functional":
        pytest.skip("the functional engine captures no graphs")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    graph_model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    eager_model = copy.deepcopy(graph_model)
    options = dict(weight_decay=0.1, cg_iters=3, solver="cg")
    graph_opt = SGN(graph_model, "mse", cuda_graphs=True, **options)
    eager_opt = SGN(eager_model, "mse", **options)
    graph_infos = [graph_opt.step(x, y) for x, y in batches]
    eager_infos = [eager_opt.step(x, y) for x, y in batches]
    assert cpu_graph_captures == [3]
    assert graph_infos == eager_infos and graph_infos[0].penalty > 0
    assert torch.equal(flat_parameters(graph_model), flat_parameters(eager_model))


def test_weight_decay_set_in_param_groups_applies_at_the_next_step():
    """Like torch.optim's options, it lives in param_groups: a user or a scheduler may change it."""
    x, y = _ridge_problem()
    model = nn.Linear(5, 1).double()
    opt = SGN(model, "mse", solver="direct", damping=1e-12, damping_min=0.0)
    opt.param_groups[0]["weight_decay"] = 0.5
    info = opt.step(x, y)
    torch.testing.assert_close(
        flat_parameters(model), _ridge_solution(x, y, 0.5), rtol=1e-9, atol=1e-10
    )
    assert info.penalty > 0
