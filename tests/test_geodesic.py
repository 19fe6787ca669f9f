"""Geodesic acceleration of exact steps: against dense float64 references built by autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from cases import dense_parts, flat_parameters
from torch_sgn import SGN, route_plan
from torch_sgn.solve import core
from torch_sgn.solve import step as step_module
from torch_sgn.solve.direct import solve_damped
from torch_sgn.solve.step import LineSearchResult

EXACT = dict(line_search=False, trust_region=False, lr=1.0, momentum=0.0, solver="direct")


def _near_fit(n: int, width: int = 6, classes: int = 0, seed: int = 0):
    """A tanh MLP and targets from a nearby MLP: a small residual and a small step, where the
    acceleration is small against the step (used); ``classes``: class probabilities."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    out = classes or 2
    model = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, out)).double()
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        y = teacher(x)
    if classes:  # class probabilities, which a nearby model fits closely
        y = torch.softmax(y, dim=1)
    return model, x, y


def _reference_step(model, loss, x, y, rho: float, predicted: list | None = None):
    """The plain step ``d`` and the acceleration ``a`` (or ``None`` where it is dropped);
    ``predicted`` receives ``g^T d`` and ``d^T (G + rho I) d``."""
    f, J, H, g, theta = dense_parts(model, loss, x, y)
    A = J.T @ H @ J + rho * torch.eye(len(theta), dtype=theta.dtype)
    d = -torch.linalg.solve(A, g)
    h = core.STEP
    fvv = (f(theta + h * d) - 2 * f(theta) + f(theta - h * d)).reshape(-1) / h**2
    a = -torch.linalg.solve(A, J.T @ H @ fvv)
    used = 2 * float(a.norm()) <= core.RATIO * float(d.norm())
    if predicted is not None:
        predicted += [float(g @ d), float(d @ A @ d)]
    return theta, d, a if used else None


# --- the second difference ------------------------------------------------------------------------
def test_second_difference_matches_the_exact_second_directional_derivative():
    model, x, _ = _near_fit(8)
    f, _, _, _, theta = dense_parts(model, "mse", x, torch.zeros(8, 2, dtype=torch.float64))
    v = 0.3 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(1)).double()

    def along(s: Tensor) -> Tensor:
        return f(theta + s * v)

    def slope(s: Tensor) -> Tensor:
        return torch.func.jvp(along, (s,), (torch.ones_like(s),))[1]

    zero = torch.zeros((), dtype=torch.float64)
    exact = torch.func.jvp(slope, (zero,), (torch.ones_like(zero),))[1]
    errors = []
    for h in (core.STEP, core.STEP / 2):
        fvv, norms = core.second_difference(f, theta, v, f(theta), h)
        assert core.above_rounding(norms, torch.float64)
        errors.append(float((fvv - exact).norm() / exact.norm()))
    assert errors[0] < 0.05
    assert errors[1] < 0.3 * errors[0]  # a central difference: second order in h


def test_the_one_sided_difference_is_first_order_and_refused_within_rounding():
    # 2 (f(theta + h v) - f(theta) - h J v) / h^2, with J v by autograd: its error falls
    # linearly with h (the central difference's falls quadratically).
    model, x, _ = _near_fit(8)
    f, J, _, _, theta = dense_parts(model, "mse", x, torch.zeros(8, 2, dtype=torch.float64))
    v = 0.3 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(1)).double()
    jvp = lambda u: (J @ u).reshape(f(theta).shape)  # noqa: E731
    exact = torch.func.jvp(
        lambda s: torch.func.jvp(lambda t: f(theta + t * v), (s,), (torch.ones_like(s),))[1],
        (torch.zeros((), dtype=torch.float64),), (torch.ones((), dtype=torch.float64),),
    )[1]  # fmt: skip
    errors = []
    for h in (core.STEP, core.STEP / 4):
        fvv, norms = core.second_difference(f, theta, v, f(theta), h, jvp=jvp)
        assert core.above_rounding(norms, torch.float64)
        errors.append(float((fvv - exact).norm() / exact.norm()))
    assert errors[0] < 0.2
    assert 0.15 * errors[0] < errors[1] < 0.4 * errors[0]  # first order: about a quarter
    # outputs linear in the parameters: a one-sided difference of rounding only
    linear = nn.Linear(3, 2).double()
    f, J, _, _, theta = dense_parts(linear, "mse", x, torch.zeros(8, 2, dtype=torch.float64))
    jvp = lambda u: (J @ u).reshape(f(theta).shape)  # noqa: E731
    _, norms = core.second_difference(f, theta, v[: theta.numel()], f(theta), jvp=jvp)
    assert not core.above_rounding(norms, torch.float64)


def test_second_difference_within_rounding_is_refused():
    # Outputs linear in the parameters: the difference is rounding only, and says nothing.
    model = nn.Linear(3, 2).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    f, _, _, _, theta = dense_parts(model, "mse", x, torch.zeros(5, 2, dtype=torch.float64))
    v = torch.randn(theta.shape, dtype=torch.float64)
    _, norms = core.second_difference(f, theta, v, f(theta))
    assert not core.above_rounding(norms, torch.float64)
    bent = lambda flat: f(flat) + 0.1 * flat.square().sum()  # noqa: E731
    _, norms = core.second_difference(bent, theta, v, bent(theta))
    assert core.above_rounding(norms, torch.float64)
    # The same relative size passes in float64 and not in float32.
    small = torch.tensor([1e-12, 1.0, 1.0, 1.0], dtype=torch.float64)  # squared: 1e-6 x 4
    assert core.above_rounding(small, torch.float64)
    assert not core.above_rounding(small, torch.float32)
    assert not core.above_rounding(torch.tensor([float("nan"), 1, 1, 1]), torch.float64)


def test_an_acceleration_larger_than_the_ratio_allows_is_dropped():
    v = torch.ones(4, dtype=torch.float64)
    assert core.accepted(v, torch.full((4,), 0.4).double()) is None  # 2 * 0.8 > 0.75 * 2
    small = torch.full((4,), 0.3).double()
    assert core.accepted(v, small) is small
    assert core.accepted(v, torch.full((4,), float("nan")).double()) is None


# --- the solvers' second solve --------------------------------------------------------------------
@pytest.mark.parametrize("indefinite", [False, True], ids=["cholesky", "eigh"])
def test_a_direct_solution_solves_again_with_its_factorization(indefinite):
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(7, 7, generator=g, dtype=torch.float64))
    eigs = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.1, 0.0, -1.0 if indefinite else 0.0])
    G = q @ torch.diag(eigs.double()) @ q.T
    rho = 1e-2
    result = solve_damped(G, torch.randn(7, generator=g, dtype=torch.float64), rho)
    assert result.reason == ("eigh" if indefinite else "cholesky")
    A = q @ torch.diag(eigs.double().clamp_min(0) + rho) @ q.T
    b = torch.randn(7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(result.again(b), -torch.linalg.solve(A, b), rtol=1e-10, atol=1e-12)


def test_a_breakdown_has_no_second_solve():
    G = torch.full((3, 3), float("nan"), dtype=torch.float64)
    assert solve_damped(G, torch.ones(3, dtype=torch.float64), 1e-3).again is None


# --- SGN steps ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "engine,n,loss,route,lr",
    [
        ("layerwise", 40, "mse", "matrix", 1.0),  # 80 outputs > 32 parameters: through G
        ("layerwise", 40, "mse", "matrix", 0.5),  # the term scales as lr^2
        ("layerwise", 6, "mse", "samples", 1.0),  # 12 outputs < 32 parameters: through the outputs
        ("layerwise", 6, "mse", "samples", 0.5),
        ("layerwise", 8, "cross_entropy", "samples", 1.0),  # a non-symmetric H K: LU
        ("functional", 40, "mse", "matrix", 1.0),  # J^T u from the engine's recorded pass
        ("traced", 40, "mse", "matrix", 1.0),  # J^T u from a pass of the optimizer's own
    ],
)
def test_accelerated_step_matches_the_dense_reference(engine, n, loss, route, lr, monkeypatch):
    classes = 3 if loss == "cross_entropy" else 0
    model, x, y = _near_fit(n, classes=classes)
    rho = 1e-3
    predicted = []
    theta, d, a = _reference_step(model, loss, x, y, rho, predicted)
    assert a is not None  # near a fit the acceleration is small against the step
    routes = []
    original = route_plan.choose_route
    monkeypatch.setattr(
        route_plan, "choose_route", lambda *args: routes.append(original(*args)) or routes[-1]
    )
    options = {**EXACT, "lr": lr}
    opt = SGN(model, loss, damping=rho, engine=engine, **options)
    info = opt.step(x, y)
    assert routes == [route] and info.solver == "direct" and info.accelerated
    expected = theta + lr * d + 0.5 * lr**2 * a
    torch.testing.assert_close(
        flat_parameters(model, trainable=True), expected, rtol=1e-8, atol=1e-10
    )
    # The trust region judges the plain step: its prediction is that of lr d.
    slope, curvature = predicted
    change = lr * slope + 0.5 * lr**2 * curvature
    assert info.predicted_change == pytest.approx(change, rel=1e-8)


def test_the_acceleration_is_dropped_where_it_is_large_against_the_step(monkeypatch):
    model, x, y = _near_fit(40)
    plain = copy.deepcopy(model)
    rho = 1e-3
    theta, d, _ = _reference_step(model, "mse", x, y, rho)
    monkeypatch.setattr(core, "RATIO", 0.0)  # every acceleration is too large
    info = SGN(model, "mse", damping=rho, **EXACT).step(x, y)
    assert not info.accelerated
    torch.testing.assert_close(
        flat_parameters(model, trainable=True), theta + d, rtol=1e-9, atol=1e-11
    )
    SGN(plain, "mse", damping=rho, geodesic_acceleration=False, **EXACT).step(x, y)
    assert torch.equal(
        flat_parameters(model, trainable=True), flat_parameters(plain, trainable=True)
    )


def test_the_line_search_backtracks_along_the_parabola(monkeypatch):
    model, x, y = _near_fit(40)
    rho = 1e-3
    predicted = []
    theta, d, a = _reference_step(model, "mse", x, y, rho, predicted)
    slopes = []

    def half(loss_along, loss0, slope, **kwargs):
        slopes.append(slope)
        return LineSearchResult(0.5, loss_along(0.5), 1, True)

    monkeypatch.setattr(step_module, "backtracking", half)
    opt = SGN(model, "mse", damping=rho, trust_region=False, lr=1.0, solver="direct")
    info = opt.step(x, y)
    assert info.accelerated and info.step_size == 0.5
    torch.testing.assert_close(
        flat_parameters(model, trainable=True), theta + 0.5 * d + 0.125 * a, rtol=1e-8, atol=1e-10
    )
    assert slopes == [pytest.approx(predicted[0], rel=1e-8)]  # the Armijo slope is d's


def test_a_frozen_parameter_stays_frozen_under_the_acceleration():
    model, x, y = _near_fit(40)
    opt = SGN(model, "mse", damping=1e-3, **EXACT)
    first = next(model.parameters())
    first.requires_grad_(False)  # frozen after construction: G and J^T u restricted
    theta, d, a = _reference_step(model, "mse", x, y, 1e-3)
    frozen = first.detach().clone()
    info = opt.step(x, y)
    assert info.accelerated and torch.equal(first, frozen)
    torch.testing.assert_close(
        flat_parameters(model, trainable=True), theta + d + 0.5 * a, rtol=1e-8, atol=1e-10
    )


def test_cg_steps_and_the_paper_take_no_acceleration(monkeypatch):
    model, x, y = _near_fit(40)
    calls = []
    monkeypatch.setattr(core, "second_difference", lambda *a: calls.append(1))
    assert not SGN(copy.deepcopy(model), "mse", solver="cg").step(x, y).accelerated
    assert not SGN.paper(copy.deepcopy(model), "mse").step(x, y).accelerated
    assert not calls


def test_geodesic_option_is_checked():
    model, x, y = _near_fit(40)
    with pytest.raises(ValueError, match="geodesic_acceleration.*'strict'"):
        SGN(model, "mse", geodesic_acceleration="yes")


def test_strict_rejects_an_attempt_whose_acceleration_is_too_large(monkeypatch):
    # RATIO set between the acceleration's 2 |a| / |d| at rho and at 1.5 rho (the threshold
    # rule's raise after a failed attempt): "strict" rejects the first attempt and takes the
    # second, accelerated; True takes the first without its acceleration.
    model, x, y = _near_fit(40)
    plain = copy.deepcopy(model)
    rho = 1e-3
    monkeypatch.setattr(core, "RATIO", float("inf"))  # the references keep every a
    theta, d0, a0 = _reference_step(model, "mse", x, y, rho)
    _, d1, a1 = _reference_step(model, "mse", x, y, 1.5 * rho)
    r0, r1 = (2 * float(a.norm() / d.norm()) for a, d in ((a0, d0), (a1, d1)))
    assert r1 < 0.9 * r0  # more damping, a shorter step, a smaller bend
    monkeypatch.setattr(core, "RATIO", 0.5 * (r0 + r1))
    options = dict(damping=rho, attempts=2, **EXACT)
    info = SGN(model, "mse", geodesic_acceleration="strict", **options).step(x, y)
    assert info.attempts == 2 and info.accelerated and info.damping == pytest.approx(1.5 * rho)
    torch.testing.assert_close(
        flat_parameters(model, trainable=True), theta + d1 + 0.5 * a1, rtol=1e-8, atol=1e-10
    )
    info = SGN(plain, "mse", geodesic_acceleration=True, **options).step(x, y)
    assert info.attempts == 1 and not info.accelerated
    torch.testing.assert_close(
        flat_parameters(plain, trainable=True), theta + d0, rtol=1e-9, atol=1e-11
    )


def test_the_default_accelerates_float64_models_only():
    model, x, y = _near_fit(40)
    options = dict(damping=1e-3, **EXACT)
    assert SGN(copy.deepcopy(model), "mse", **options).step(x, y).accelerated
    x32, y32 = x.float(), y.float()
    assert not SGN(copy.deepcopy(model).float(), "mse", **options).step(x32, y32).accelerated
    forced = SGN(copy.deepcopy(model).float(), "mse", geodesic_acceleration=True, **options)
    assert forced.step(x32, y32).accelerated
