"""torch_sgn.curve_steps: its J against dense float64 Jacobians of the flat parameters, its
steps against SGN's, and what a curve fit through it leaves behind (storage, an interrupted
fit, the random state). Synthetic curve fits, float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cases import flat_parameters
from torch_sgn import SGN, curve_steps, fitting
from torch_sgn.curve_steps import CurveSteps
from torch_sgn.fitting import least_squares
from torch_sgn.options import Options, Setup
from torch_sgn.pinn import Residual, Residuals
from torch_sgn.route_plan import curve_steps_allowed
from torch_sgn.solve import core
from torch_sgn.solve import step as step_module
from torch_sgn.solve.step import backtracking

D = torch.float64
TIGHT = dict(xtol=1e-15, ftol=1e-15, gtol=1e-15)
OFF = dict(xtol=0.0, ftol=0.0, gtol=0.0)


def _noise(n: int, seed: int, scale: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, generator=g, dtype=D)


T = torch.linspace(0.0, 6.0, 30, dtype=D)
X1 = torch.linspace(-1.0, 1.0, 30, dtype=D)
X2 = torch.cos(3.0 * X1)


class Params(nn.Module):
    """Named parameters (scalars, vectors, matrices), float64."""

    def __init__(self, **values):
        super().__init__()
        for name, value in values.items():
            setattr(self, name, nn.Parameter(torch.tensor(value, dtype=D)))


class Tied(nn.Module):
    """``b`` is ``a``: one Parameter registered under two names."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.5, dtype=D))
        self.k = nn.Parameter(torch.tensor(0.3, dtype=D))
        self.b = self.a


# --- the models: a module's residuals, and the same residuals of the flat parameters --------
Y_DECAY = 3.0 * torch.exp(-0.7 * T) + 0.5 + _noise(30, 0)
Y_RATIONAL = (1.0 + 2.0 * T) / (1.0 + 0.5 * T) + _noise(30, 1)
Y_PEAKS = (
    2.0 * torch.exp(-0.5 * ((T - 2.0) / 0.6) ** 2)
    + 1.0 * torch.exp(-0.5 * ((T - 4.0) / 0.8) ** 2)
    + _noise(30, 2)
)
Y_TWO = 1.5 * torch.exp(0.4 * X1 - 0.8 * X2) + _noise(30, 3)
Y_PAIR = torch.stack([2.0 * torch.exp(-0.5 * T), 0.3 * T], dim=1) + _noise(60, 4).reshape(30, 2)
T_PAIR = torch.stack([T, T / 2], dim=1)


def decay(m):
    return m.a * torch.exp(-m.k * T) + m.c - Y_DECAY


def decay_flat(v):
    return v[0] * torch.exp(-v[1] * T) + v[2] - Y_DECAY


def rational(m):
    return (m.b1 + m.b2 * T) / (1.0 + m.b3 * T) - Y_RATIONAL


def rational_flat(v):
    return (v[0] + v[1] * T) / (1.0 + v[2] * T) - Y_RATIONAL


def _peaks(amp, centre, width):
    return sum(amp[j] * torch.exp(-0.5 * ((T - centre[j]) / width[j]) ** 2) for j in range(2))


def peaks(m):  # vector parameters of shape (2,)
    return _peaks(m.amp, m.centre, m.width) - Y_PEAKS


def peaks_flat(v):
    return _peaks(v[0:2], v[2:4], v[4:6]) - Y_PEAKS


def two_predictors(m):  # a scalar and a vector parameter
    return m.b0 * torch.exp(m.b[0] * X1 + m.b[1] * X2) - Y_TWO


def two_predictors_flat(v):
    return v[0] * torch.exp(v[1] * X1 + v[2] * X2) - Y_TWO


def matrix(m):  # a 2-D parameter
    w = m.w
    return w[0, 0] * torch.exp(-w[0, 1] * T) + w[0, 2] + w[1, 0] * torch.sin(w[1, 1] * T + w[1, 2])


def matrix_flat(v):
    w = v.reshape(2, 3)
    return w[0, 0] * torch.exp(-w[0, 1] * T) + w[0, 2] + w[1, 0] * torch.sin(w[1, 1] * T + w[1, 2])


def vector(m):  # least_squares(fn, x): one vector parameter
    x = m.x
    return x[0] * torch.exp(-x[1] * T) + x[2] * T + x[3] - Y_DECAY


def vector_flat(v):
    return v[0] * torch.exp(-v[1] * T) + v[2] * T + v[3] - Y_DECAY


def pair_elementwise(m):  # residuals of shape (n, 2), each reading one entry of the copies
    return m.a * torch.exp(-m.k * T_PAIR) - Y_PAIR


def pair_elementwise_flat(v):
    return v[0] * torch.exp(-v[1] * T_PAIR) - Y_PAIR


# Models the broadcast copies cannot follow.
def reduction(m):  # a parameter inside a reduction over the residuals
    return m.b * T - (m.b * T).mean() + m.a * torch.exp(-m.k * T) - Y_DECAY


def reduction_flat(v):
    return v[0] * T - (v[0] * T).mean() + v[1] * torch.exp(-v[2] * T) - Y_DECAY


def guarded_float(m):  # float(k) raises on a copy of more than one entry
    if not math.isfinite(float(m.k)):
        raise ValueError("k is not finite")
    return m.a * torch.exp(-m.k * T) - Y_DECAY


def guarded_item(m):
    if m.k.item() < -100.0:
        raise ValueError("k is too small")
    return m.a * torch.exp(-m.k * T) - Y_DECAY


def guarded_flat(v):
    return v[0] * torch.exp(-v[1] * T) - Y_DECAY


def tied(m):
    return m.a * torch.exp(-m.k * T) + m.b * T - Y_DECAY


def tied_flat(v):
    return v[0] * torch.exp(-v[1] * T) + v[0] * T - Y_DECAY


def pair_stacked(m):  # residuals of shape (n, 2) built by stacking: the copies do not broadcast
    return torch.stack([m.a * torch.exp(-m.k * T), m.c * T], dim=1) - Y_PAIR


def pair_stacked_flat(v):
    return torch.stack([v[0] * torch.exp(-v[1] * T), v[2] * T], dim=1) - Y_PAIR


# (name, module factory, fn(module), fn of the flat parameters, J by the broadcast copies)
CASES = [
    ("decay", lambda: Params(a=1.0, k=0.3, c=0.1), decay, decay_flat, True),
    ("rational", lambda: Params(b1=0.8, b2=1.5, b3=0.3), rational, rational_flat, True),
    (
        "peaks",
        lambda: Params(amp=[1.5, 1.2], centre=[1.8, 4.3], width=[0.5, 1.0]),
        peaks,
        peaks_flat,
        True,
    ),
    (
        "two_predictors",
        lambda: Params(b0=1.0, b=[0.2, -0.5]),
        two_predictors,
        two_predictors_flat,
        True,
    ),
    ("matrix", lambda: Params(w=[[2.0, 0.5, 0.3], [0.4, 1.1, 0.2]]), matrix, matrix_flat, True),
    ("vector", lambda: Params(x=[2.0, 0.5, 0.01, 0.3]), vector, vector_flat, True),
    (
        "pair_elementwise",
        lambda: Params(a=1.0, k=0.3),
        pair_elementwise,
        pair_elementwise_flat,
        True,
    ),
    ("reduction", lambda: Params(b=0.4, a=1.0, k=0.3), reduction, reduction_flat, False),
    ("float", lambda: Params(a=1.0, k=0.3), guarded_float, guarded_flat, False),
    ("item", lambda: Params(a=1.0, k=0.3), guarded_item, guarded_flat, False),
    ("tied", Tied, tied, tied_flat, False),
    ("pair_stacked", lambda: Params(a=1.0, k=0.3, c=0.2), pair_stacked, pair_stacked_flat, False),
]
IDS = [c[0] for c in CASES]


def _group(module: nn.Module, fn, **options) -> Options:
    return Options().replace(**options)


def _spy(monkeypatch) -> list:
    """Records each CurveSteps the fits construct."""
    made = []

    class Spy(CurveSteps):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(fitting, "CurveSteps", Spy)
    return made


# --- J -------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
@pytest.mark.parametrize("name,make,fn,flat_fn,broadcast", CASES, ids=IDS)
def test_jacobian_equals_dense_jacobian_of_the_flat_parameters(name, make, fn, flat_fn, broadcast):
    module = make()
    params = list(module.parameters())
    start = flat_parameters(module)
    steps = CurveSteps(fn, module, params, _group(module, fn, damping_update="nielsen"))
    g = torch.Generator().manual_seed(5)
    try:
        for _ in range(3):
            point = start + 0.1 * torch.randn(start.shape, generator=g, dtype=D)
            r, jac = steps.jacobian(point)
            reference = torch.autograd.functional.jacobian(flat_fn, point)
            reference = reference.reshape(-1, point.numel())
            assert jac.shape == reference.shape
            torch.testing.assert_close(jac, reference, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(r, flat_fn(point).reshape(-1), rtol=1e-13, atol=1e-14)
            # the step compares the loss at its start with trial points' losses computed alike
            assert torch.equal(r, steps.residuals_at(point))
        assert steps.broadcast is broadcast
    finally:
        steps.close()


def test_a_small_coupling_through_a_reduction_is_not_taken_for_elementwise():
    def coupled(m):
        return m.b * T - 1e-8 * (m.b * T).mean() + m.c * torch.exp(-T) - Y_DECAY

    def coupled_flat(v):
        return v[0] * T - 1e-8 * (v[0] * T).mean() + v[1] * torch.exp(-T) - Y_DECAY

    module = Params(b=0.4, c=1.0)
    steps = CurveSteps(coupled, module, list(module.parameters()), _group(module, coupled))
    try:
        point = torch.tensor([0.3, 1.2], dtype=D)
        _, jac = steps.jacobian(point)
        reference = torch.autograd.functional.jacobian(coupled_flat, point)
        torch.testing.assert_close(jac, reference, rtol=1e-12, atol=1e-13)
    finally:
        steps.close()


# --- steps ---------------------------------------------------------------------------------
# (module factory, fn(module)): nonlinear fits from a start far enough that the damping moves.
STEP_CASES = {
    "rational": (lambda: Params(b1=0.2, b2=0.5, b3=1.5), rational),
    "peaks": (lambda: Params(amp=[1.0, 1.0], centre=[1.5, 4.5], width=[0.9, 0.9]), peaks),
    "reduction": (lambda: Params(b=0.5, a=0.5, k=2.0), reduction),
}
# The geodesic acceleration is off: CurveSteps takes its second difference one-sided (from the
# J it holds), SGN central (test_the_first_accelerated_step_equals_a_dense_reference).
OPTIONS = [
    {"geodesic_acceleration": False},
    {"geodesic_acceleration": False, "line_search": False},
    {"geodesic_acceleration": False, "attempts": 3},
    {"geodesic_acceleration": False, "damping": 1.0},
    {"geodesic_acceleration": False, "reject_uphill": False},
]


def _sgn_points(make, fn, k: int, **options) -> tuple:
    """The start and the points of k steps of SGN on the problem as least_squares builds it,
    and the steps' StepInfos."""
    module = make()
    problem = Residuals(module, {"residuals": Residual(fn)})
    inputs, targets = problem.batch()
    opt = SGN(
        problem, Residuals.loss, solver="direct", engine="functional", damping_update="nielsen",
        **options,
    )  # fmt: skip
    points, infos = [flat_parameters(module)], []
    for _ in range(k):
        infos.append(opt.step(inputs, targets))
        points.append(flat_parameters(module))
    return points, infos


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_steps_equal_the_optimizers(case, options, monkeypatch):
    make, fn = STEP_CASES[case]
    k = 6
    made = _spy(monkeypatch)
    points, infos = _sgn_points(make, fn, k, **options)
    module = make()
    res = least_squares(fn, module, max_steps=k, **OFF, **options)
    assert len(made) == 1  # the fit took CurveSteps's steps
    assert res.steps == k and res.status == 0
    assert made[0].broadcast is (case != "reduction")
    # not a fit that stands still: the steps moved the point and lowered the loss
    assert (points[-1] - points[0]).norm() > 0.1 * points[0].norm()
    assert infos[-1].loss_after < 0.5 * infos[0].loss
    # ... and stays above the loss's rounding, where the two may part (CurveSteps's line search
    # does not try steps whose predicted decrease is within rounding; SGN's does)
    assert all(i.loss - i.loss_after > 1e-9 * i.loss for i in infos if i.taken)
    torch.testing.assert_close(res.x, points[-1], rtol=1e-9, atol=1e-12)
    last = res.last_step
    assert last.loss == pytest.approx(infos[-1].loss, rel=1e-9)
    assert last.loss_after == pytest.approx(infos[-1].loss_after, rel=1e-9)
    assert last.damping == pytest.approx(infos[-1].damping, rel=1e-9)
    assert last.next_damping == pytest.approx(infos[-1].next_damping, rel=1e-9)
    assert last.step_size == infos[-1].step_size
    assert last.attempts == infos[-1].attempts
    assert last.taken == infos[-1].taken and last.accelerated == infos[-1].accelerated


def test_steps_of_a_vector_parameter_equal_the_optimizers(monkeypatch):
    start = torch.tensor([1.0, 1.5, 0.5, 0.0], dtype=D)
    made = _spy(monkeypatch)
    off = dict(geodesic_acceleration=False)
    points, _ = _sgn_points(lambda: Params(x=start.tolist()), vector, 5, **off)
    res = least_squares(vector_flat, start, max_steps=5, **OFF, **off)
    assert len(made) == 1 and made[0].broadcast is True
    assert (points[-1] - points[0]).norm() > 0.1
    torch.testing.assert_close(res.x, points[-1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("options", [{}, dict(ls_max_evals=1)], ids=["", "ls_max_evals=1"])
@pytest.mark.parametrize("case", [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_trial_points_evaluated_by_the_copies_change_no_step(case, options, monkeypatch):
    # An accepted trial point's forward pass by the broadcast copies serves as the next J's: the
    # same fit to the bit, with fewer calls, as with every point evaluated by a plain call.
    # (With one trial a step, steps are rejected on the way, after which the last point
    # evaluated is not the next step's start.)
    _, make, fn, _, _ = case

    def fit():
        calls = [0]

        def counted(m):
            calls[0] += 1
            return fn(m)

        made = _spy(monkeypatch)
        res = least_squares(counted, make(), max_steps=12, **TIGHT, **options)
        return res, calls[0], made[0]

    shared, shared_calls, lean = fit()
    assert lean._shares_forward
    monkeypatch.setattr(curve_steps, "SHARED_FORWARD_SIZE", 0)
    plain, plain_calls, lean = fit()
    assert not lean._shares_forward
    assert torch.equal(shared.x, plain.x) and torch.equal(shared.fun, plain.fun)
    assert (shared.steps, shared.evaluations, shared.status) == (
        plain.steps, plain.evaluations, plain.status,
    )  # fmt: skip
    assert shared.steps >= 3
    # one call fewer for each step that started where the one before ended
    assert shared_calls < plain_calls


def test_the_first_accelerated_step_equals_a_dense_reference(monkeypatch):
    # theta + v + a / 2: (G + rho I) v = -g, (G + rho I) a = -J^T H f_vv with f_vv by the
    # one-sided difference 2 (r(theta + h v) - r - h J v) / h^2, from J by autograd
    # (the loss sum r^2: g = 2 J^T r, G = 2 J^T J, H = 2).
    made = _spy(monkeypatch)
    res = least_squares(decay, Params(a=2.5, k=0.6, c=0.6), max_steps=1, **OFF)
    assert len(made) == 1 and res.last_step.accelerated and res.last_step.step_size == 1.0
    flat_fn, theta = decay_flat, torch.tensor([2.5, 0.6, 0.6], dtype=D)
    r = flat_fn(theta)
    J = torch.autograd.functional.jacobian(flat_fn, theta)
    A = 2 * J.T @ J + res.last_step.damping * torch.eye(3, dtype=D)
    v = -torch.linalg.solve(A, 2 * J.T @ r)
    h = core.STEP
    fvv = 2 * (flat_fn(theta + h * v) - r - h * (J @ v)) / h**2
    a = -torch.linalg.solve(A, J.T @ (2 * fvv))
    assert 2 * a.norm() <= core.RATIO * v.norm()
    torch.testing.assert_close(res.x, theta + v + 0.5 * a, rtol=1e-10, atol=1e-12)
    assert (a.norm() > 1e-3 * v.norm()) and not torch.allclose(res.x, theta + v)


def test_strict_acceleration_solves_again_where_the_bend_is_too_large(monkeypatch):
    # From this start the first step's acceleration is too large against it (2 |a| / |v|
    # about 4.8): by default the step goes without it; with "strict" the attempt is rejected
    # and the step taken is the dense reference's at the raised damping, accelerated.
    start = dict(a=2.0, k=0.4, c=1.0)
    res = least_squares(decay, Params(**start), max_steps=1, **OFF)
    assert res.last_step.attempts == 1 and not res.last_step.accelerated
    made = _spy(monkeypatch)
    strict = dict(geodesic_acceleration="strict", attempts=10)
    res = least_squares(decay, Params(**start), max_steps=1, **OFF, **strict)
    last = res.last_step
    assert len(made) == 1 and last.attempts > 1 and last.accelerated and last.step_size == 1.0
    theta = torch.tensor(list(start.values()), dtype=D)
    r = decay_flat(theta)
    J = torch.autograd.functional.jacobian(decay_flat, theta)
    A = 2 * J.T @ J + last.damping * torch.eye(3, dtype=D)
    v = -torch.linalg.solve(A, 2 * J.T @ r)
    h = core.STEP
    a = -torch.linalg.solve(A, J.T @ (4 * (decay_flat(theta + h * v) - r - h * (J @ v)) / h**2))
    assert 2 * a.norm() <= core.RATIO * v.norm()
    torch.testing.assert_close(res.x, theta + v + 0.5 * a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("max_steps", [3, 200])  # stopped by max_steps after a move; by tests
def test_the_results_residuals_and_gradient_are_those_at_its_solution(max_steps, monkeypatch):
    made = _spy(monkeypatch)
    res = least_squares(rational, Params(b1=0.2, b2=0.5, b3=1.5), max_steps=max_steps, **TIGHT)
    assert len(made) == 1 and res.steps > 0
    r = rational_flat(res.x)
    J = torch.autograd.functional.jacobian(rational_flat, res.x)
    torch.testing.assert_close(res.fun, r, rtol=1e-13, atol=1e-14)
    assert res.cost == pytest.approx(0.5 * float(r @ r), rel=1e-12)
    assert res.grad_norm == pytest.approx(float((J.T @ r).abs().max()), rel=1e-8, abs=1e-14)


# --- which fits take CurveSteps --------------------------------------------------------------
class Refused(Exception):
    pass


def _refuse(*args, **kwargs):
    raise Refused("CurveSteps constructed")


@pytest.mark.parametrize(
    "options",
    [
        {"weight_decay": 1e-3},
        {"momentum": 0.5},
        {"solver": "cg"},
        {"direct_max_params": 2},
    ],
    ids=lambda o: next(iter(o)),
)
def test_fits_with_options_it_does_not_take_run_through_the_optimizer(options, monkeypatch):
    monkeypatch.setattr(fitting, "CurveSteps", _refuse)
    module = Params(a=1.0, k=0.3, c=0.1)
    start = 0.5 * float(decay(module).detach().square().sum())
    res = least_squares(decay, module, max_steps=4, **OFF, **options)
    assert res.steps == 4 and res.status == 0
    assert res.cost < 0.5 * start
    torch.testing.assert_close(res.x, flat_parameters(module))


def test_options_it_does_not_take_are_refused():
    numel = 3
    assert curve_steps_allowed(Setup(), Options(), numel)
    assert curve_steps_allowed(Setup(solver="direct"), Options(), numel)
    assert not curve_steps_allowed(Setup(solver="cg"), Options(), numel)
    assert not curve_steps_allowed(Setup(curvature_fraction=0.5), Options(), numel)
    assert not curve_steps_allowed(Setup(direct_max_params=2), Options(), numel)
    for key, value in [("momentum", 0.5), ("weight_decay", 1e-3)]:
        assert not curve_steps_allowed(Setup(), Options().replace(**{key: value}), numel), key


def test_a_plain_fit_constructs_it_and_a_residuals_problem_does_not(monkeypatch):
    monkeypatch.setattr(fitting, "CurveSteps", _refuse)
    with pytest.raises(Refused):
        least_squares(decay, Params(a=1.0, k=0.3, c=0.1), max_steps=4)
    with pytest.raises(Refused):
        least_squares(vector_flat, torch.tensor([2.0, 0.5, 0.0, 0.3], dtype=D), max_steps=4)
    module = Params(a=1.0, k=0.3, c=0.1)
    problem = Residuals(module, {"residuals": Residual(decay)})
    res = least_squares(problem, max_steps=4, **OFF)
    assert res.steps == 4


# --- what a fit leaves behind -------------------------------------------------------------------
def _own_storage(params) -> None:
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    assert len(ptrs) == len(params)
    for p in params:
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    before = [p.detach().clone() for p in params]
    with torch.no_grad():
        params[0].add_(1.0)
    for p, b in zip(params[1:], before[1:]):
        assert torch.equal(p.detach(), b)
    with torch.no_grad():
        params[0].copy_(before[0])


def test_parameters_own_their_storage_and_hold_x_after_a_fit(monkeypatch):
    made = _spy(monkeypatch)
    module = Params(amp=[1.5, 1.2], centre=[1.8, 4.3], width=[0.5, 1.0])
    res = least_squares(peaks, module, **TIGHT)
    assert len(made) == 1 and res.success
    params = list(module.parameters())
    assert torch.equal(flat_parameters(module), res.x)
    _own_storage(params)
    assert torch.equal(flat_parameters(module), res.x)


def _counting(fn, at: int):
    calls = [0]

    def counted(m):
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return fn(m)

    return counted, calls


def _accepted_points(make, fn, steps: int) -> list:
    """The start and the points the fit accepts at each of its first steps (the fit is
    deterministic: one fit of j steps per point)."""
    points = [flat_parameters(make())]
    for j in range(1, steps + 1):
        points.append(least_squares(fn, make(), max_steps=j, **OFF).x)
    return points


@pytest.mark.parametrize("at", [2, 3, 5, 9, 14, 20, 24])
def test_an_interrupted_fit_leaves_an_accepted_point_in_own_storage(at, monkeypatch):
    def make():
        return Params(b1=0.2, b2=0.5, b3=1.5)

    counted, calls = _counting(rational, at=10**9)
    least_squares(counted, make(), max_steps=8, **OFF)
    assert calls[0] > 24  # `at` falls inside the fit
    accepted = _accepted_points(make, rational, 8)

    made = _spy(monkeypatch)
    module = make()
    params = list(module.parameters())
    markers = [torch.full_like(p, 7.0) for p in params]
    for p, m in zip(params, markers):
        p.grad = m
    counted, calls = _counting(rational, at=at)
    with pytest.raises(KeyboardInterrupt):
        least_squares(counted, module, max_steps=8, **OFF)
    assert calls[0] == at
    assert made or at <= 2  # past the start's checks, CurveSteps ran
    point = flat_parameters(module)
    assert any(torch.equal(point, a) for a in accepted)
    with torch.no_grad():
        assert float(rational(module).square().sum()) <= float(rational(make()).square().sum())
    _own_storage(params)
    assert all(p.grad is m for p, m in zip(params, markers))


def test_an_interrupt_late_in_the_fit_keeps_its_progress():
    counted, calls = _counting(rational, at=10**9)
    least_squares(counted, Params(b1=0.2, b2=0.5, b3=1.5), max_steps=8, **OFF)
    module = Params(b1=0.2, b2=0.5, b3=1.5)
    start = float(rational(module).detach().square().sum())
    counted, _ = _counting(rational, at=calls[0] - 2)
    with pytest.raises(KeyboardInterrupt):
        least_squares(counted, module, max_steps=8, **OFF)
    with torch.no_grad():
        assert float(rational(module).square().sum()) < 0.5 * start


# --- stopping at the noise floor ------------------------------------------------------------
def _newton(cost, x: torch.Tensor, steps: int = 10) -> torch.Tensor:
    """A minimizer of ``cost`` by Newton's steps from ``x`` (near it) on its dense Hessian: a
    reference by another route, which asserts the point is a minimum (Hessian positive)."""
    for _ in range(steps):
        grad = torch.autograd.functional.jacobian(cost, x)
        hessian = torch.autograd.functional.hessian(cost, x)
        x = x - torch.linalg.solve(hessian, grad)
    assert torch.linalg.eigvalsh(hessian).min() > 0
    return x


# (the truth, the start, the residual function, the same of the flat parameters)
FLOOR_CASES = {
    "decay": ({"a": 3.0, "k": 0.7, "c": 0.5}, {"a": 1.0, "k": 0.3, "c": 0.1}, decay, decay_flat),
    "rational": (
        {"b1": 1.0, "b2": 2.0, "b3": 0.5},
        {"b1": 0.5, "b2": 1.5, "b3": 0.3},
        rational,
        rational_flat,
    ),
    "peaks": (
        {"amp": [2.0, 1.0], "centre": [2.0, 4.0], "width": [0.6, 0.8]},
        {"amp": [1.5, 1.2], "centre": [1.8, 4.3], "width": [0.5, 1.0]},
        peaks,
        peaks_flat,
    ),
}


def _floor_case(case: str):
    """The truth and the start (new modules), the residual function and its flat form."""
    exact, start, model, model_flat = FLOOR_CASES[case]
    return Params(**exact), Params(**start), model, model_flat


# noise: (seed, scale); with the large noise the peaks' fit ends on steps within the loss's
# rounding that are not taken, and stops by ftol there (the same step would come again).
NOISE = {"zero_residual": None, "small_noise": (7, 0.05), "large_noise": (6, 0.5)}


@pytest.mark.parametrize("noise", list(NOISE))
@pytest.mark.parametrize("case", list(FLOOR_CASES))
def test_tight_tolerances_stop_at_the_noise_floor(case, noise, monkeypatch):
    exact, module, model, model_flat = _floor_case(case)
    # data the model meets at `exact` (bit for bit: the same operations), or that plus noise
    offset = model(exact).detach()
    if NOISE[noise] is not None:
        offset = offset + _noise(offset.numel(), *NOISE[noise])

    def fn(m):
        return model(m) - offset

    made = _spy(monkeypatch)
    res = least_squares(fn, module, max_steps=200, **TIGHT)
    assert len(made) == 1
    assert res.status > 0 and res.steps < 50
    if NOISE[noise] is None:
        torch.testing.assert_close(res.x, flat_parameters(exact), rtol=1e-10, atol=1e-12)
        assert res.cost < 1e-24
    else:  # where the loss stops telling points apart: x to about sqrt(eps), the cost to eps

        def cost(v):
            return 0.5 * (model_flat(v) - offset).square().sum()

        reference = _newton(cost, res.x.clone())
        torch.testing.assert_close(res.x, reference, rtol=1e-6, atol=1e-8)
        assert res.cost == pytest.approx(float(cost(reference)), rel=1e-13)


def test_its_line_search_stops_at_the_loss_rounding_and_sgns_does_not(monkeypatch):
    floors = []

    def recording(loss_at, loss0, slope, **kwargs):
        floors.append((loss0, kwargs["floor"]))
        return backtracking(loss_at, loss0, slope, **kwargs)

    monkeypatch.setattr(step_module, "backtracking", recording)
    exact, module, model, _ = _floor_case("peaks")
    offset = model(exact).detach() + _noise(30, *NOISE["large_noise"])

    def fn(m):
        return model(m) - offset

    least_squares(fn, module, max_steps=200, **TIGHT)
    assert floors  # some steps backtracked
    eps = torch.finfo(D).eps
    for loss0, floor in floors:
        assert floor == pytest.approx(100 * eps * loss0, rel=1e-12)
    floors.clear()
    _sgn_points(lambda: _floor_case("peaks")[1], fn, 12)
    assert floors and all(floor == 0.0 for _, floor in floors)


# --- the random state ----------------------------------------------------------------------------
def test_a_fit_leaves_the_global_random_state_alone(monkeypatch):
    made = _spy(monkeypatch)
    state = torch.get_rng_state()
    res = least_squares(peaks, Params(amp=[1.5, 1.2], centre=[1.8, 4.3], width=[0.5, 1.0]))
    assert len(made) == 1 and made[0].broadcast is True  # the check of the copies ran
    assert res.steps > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_a_curvature_fraction_on_a_residuals_problem_is_refused_clearly():
    module = Params(a=1.0, k=0.3, c=0.1)
    problem = Residuals(module, {"residuals": Residual(decay)})
    with pytest.raises(ValueError, match="curvature_fraction=0.5: a Residuals problem"):
        SGN(problem, problem.loss, curvature_fraction=0.5)
    with pytest.raises(ValueError, match="curvature_fraction=0.5: a Residuals problem"):
        least_squares(decay, module, curvature_fraction=0.5, max_steps=3)
    assert float(module.a.detach()) == 1.0
