"""torch_sgn.fitting against scipy.optimize.least_squares and exact solutions, float64."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from cases import library_calls
from torch_sgn import StepInfo
from torch_sgn.fitting import (
    MESSAGES,
    STEPS_PER_PARAMETER,
    LeastSquaresResult,
    least_squares,
    termination,
)
from torch_sgn.pinn import Residual, Residuals
from torch_sgn.stepper import Stepper

TIGHT = dict(xtol=1e-15, ftol=1e-15, gtol=1e-15)
D64 = torch.float64


class Decay(nn.Module):
    """y = a exp(-k t) + c, the parameters as scalar nn.Parameters."""

    def __init__(self, a=1.0, k=0.1, c=0.0):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a, dtype=torch.float64))
        self.k = nn.Parameter(torch.tensor(k, dtype=torch.float64))
        self.c = nn.Parameter(torch.tensor(c, dtype=torch.float64))


def decay_data():
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(0, 10, 40, dtype=torch.float64)
    y = 3.0 * torch.exp(-0.7 * t) + 0.5 + 0.05 * torch.randn(40, generator=g, dtype=torch.float64)
    return t, y


def decay_residuals(m, t, y):
    return m.a * torch.exp(-m.k * t) + m.c - y


def rosenbrock(x):
    return torch.stack([10 * (x[1] - x[0] ** 2), 1 - x[0]])


def linear_problem():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(30, 5, generator=g, dtype=torch.float64)
    b = torch.randn(30, generator=g, dtype=torch.float64)
    return A, b


# Each case: (name, residual function of a flat tensor (torch or numpy), start).
def _cases():
    t, y = decay_data()
    A, b = linear_problem()

    def decay(x, xp):
        tt, yy = (t, y) if xp is torch else (t.numpy(), y.numpy())
        return x[0] * xp.exp(-x[1] * tt) + x[2] - yy

    def rosen(x, xp):
        return xp.stack([10 * (x[1] - x[0] ** 2), 1 - x[0]])

    def linear(x, xp):
        return (A @ x - b) if xp is torch else (A.numpy() @ x - b.numpy())

    return [
        ("decay", decay, [1.0, 0.1, 0.0]),
        ("rosenbrock", rosen, [-1.2, 1.0]),
        ("linear", linear, [0.0] * 5),
    ]


CASES = _cases()
IDS = [c[0] for c in CASES]


def _ours(fn, start, **kw) -> LeastSquaresResult:
    return least_squares(lambda x: fn(x, torch), torch.tensor(start, dtype=torch.float64), **kw)


def _scipy(fn, start, **kw):
    """scipy's trf with the exact Jacobian (autograd; its default finite differences would
    move the solution by about 1e-8 relative)."""
    scipy_optimize = pytest.importorskip("scipy.optimize")

    def jac(x):
        return torch.autograd.functional.jacobian(lambda v: fn(v, torch), torch.from_numpy(x))

    return scipy_optimize.least_squares(
        lambda x: fn(x, np), np.array(start, dtype=np.float64), jac=lambda x: jac(x).numpy(),
        method="trf", **kw,
    )  # fmt: skip


@pytest.mark.parametrize("name,fn,start", CASES, ids=IDS)
def test_same_solution_as_scipy(name, fn, start):
    ours = _ours(fn, start, **TIGHT)
    ref = _scipy(fn, start, **TIGHT)
    assert ours.success
    np.testing.assert_allclose(ours.x.numpy(), ref.x, rtol=1e-8, atol=1e-10)
    assert ours.cost == pytest.approx(ref.cost, rel=1e-10, abs=1e-20)
    assert ours.steps <= 50


def test_linear_exact_solution():
    A, b = linear_problem()
    exact = torch.linalg.lstsq(A, b.unsqueeze(1)).solution.squeeze(1)
    res = least_squares(lambda x: A @ x - b, torch.zeros(5, dtype=torch.float64), **TIGHT)
    torch.testing.assert_close(res.x, exact, rtol=1e-10, atol=1e-12)
    # The Gauss-Newton model of a linear residual is exact: a few steps, however tight.
    assert res.steps <= 5
    assert res.cost == pytest.approx(0.5 * float((A @ exact - b).square().sum()), rel=1e-12)


# One tolerance on, the others off: the status says which test stopped the fit, as scipy's.
@pytest.mark.parametrize("kind,status", [("gtol", 1), ("ftol", 2), ("xtol", 3)])
@pytest.mark.parametrize("name,fn,start", CASES, ids=IDS)
def test_status_of_one_tolerance_as_scipy(name, fn, start, kind, status):
    tols = dict(xtol=0.0, ftol=0.0, gtol=0.0)
    tols[kind] = 1e-6 if kind != "gtol" else 1e-8
    ref = _scipy(fn, start, **{k: (v if v > 0 else None) for k, v in tols.items()})
    ours = _ours(fn, start, max_steps=200, **tols)
    if ref.status == 0:
        # scipy's ftol alone cannot stop an exact fit (a zero residual, or a linear model its
        # first step solved): its ratio is then 0 / 0. Ours may, where its step still reduced
        # the cost in agreement with the model, but by no other test.
        assert ours.status in (0, status)
    else:
        assert ours.status == ref.status
    if status == 1:  # what gtol means
        assert ours.grad_norm < tols["gtol"]
    assert ours.status in (status, 0)
    # and it stopped near scipy's answer
    np.testing.assert_allclose(ours.x.numpy(), ref.x, rtol=1e-3, atol=1e-5)


def test_default_tolerances_stop_soon():
    t, y = decay_data()
    model = Decay()
    res = least_squares(lambda m: decay_residuals(m, t, y), model)
    ref = _scipy(_cases()[0][1], [1.0, 0.1, 0.0])
    assert res.success and res.status in (1, 2, 3, 4)
    assert res.steps <= 30
    # scipy stops where its own tests say; both agree to the precision those tests give
    np.testing.assert_allclose(res.x.numpy(), ref.x, rtol=1e-5)
    # the module holds the solution; x, fun and cost agree with it
    flat = torch.stack([model.a, model.k, model.c]).detach()
    torch.testing.assert_close(res.x, flat)
    torch.testing.assert_close(res.fun, decay_residuals(model, t, y).detach())
    assert res.cost == pytest.approx(0.5 * float(res.fun.square().sum()), rel=1e-14)
    assert res.evaluations >= 1 + res.steps
    assert res.message and res.last_step is not None


def test_max_steps_status_zero_and_grads_restored():
    t, y = decay_data()
    model = Decay()
    marker = torch.full((), 7.0, dtype=torch.float64)
    model.a.grad = marker
    res = least_squares(lambda m: decay_residuals(m, t, y), model, max_steps=2, **TIGHT)
    assert res.status == 0 and not res.success and res.steps == 2
    assert model.a.grad is marker and model.k.grad is None


def test_tolerances_off_runs_exactly_max_steps():
    res = _ours(CASES[1][1], CASES[1][2], xtol=0, ftol=0, gtol=0, max_steps=3)
    assert res.steps == 3 and res.status == 0


def test_residuals_problem():
    t, y = decay_data()
    model = Decay()
    problem = Residuals(model, {"data": Residual(lambda m, t, y: decay_residuals(m, t, y), (t, y))})
    res = least_squares(problem, **TIGHT)
    ref = _ours(CASES[0][1], CASES[0][2], **TIGHT)
    # The problem's residuals are scaled by 1/sqrt(N): the same minimizer, cost / N.
    torch.testing.assert_close(res.x, ref.x, rtol=1e-8, atol=1e-10)
    assert res.cost == pytest.approx(ref.cost / len(t), rel=1e-10)


def test_parameter_tensor_updated_in_place():
    x = nn.Parameter(torch.tensor([-1.2, 1.0], dtype=torch.float64))
    res = least_squares(rosenbrock, x, **TIGHT)
    torch.testing.assert_close(x.detach(), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(res.x, x.detach())
    plain = torch.tensor([-1.2, 1.0], dtype=torch.float64)
    least_squares(rosenbrock, plain)
    assert plain.tolist() == [-1.2, 1.0]  # a plain tensor is copied


def test_errors_name_the_argument_and_the_fix():
    t, y = decay_data()
    with pytest.raises(ValueError, match=r"residuals: .* not finite at the starting point"):
        least_squares(lambda m: decay_residuals(m, t, y) / 0 * m.a, Decay(a=0.0))
    with pytest.raises(ValueError, match="max_steps"):
        least_squares(lambda m: decay_residuals(m, t, y), Decay(), xtol=0, ftol=0, gtol=0)
    with pytest.raises(ValueError, match="do not depend on the parameters"):
        least_squares(lambda m: decay_residuals(m, t, y).detach(), Decay())
    with pytest.raises(ValueError, match=r"parameter\(s\) \['c'\].*requires_grad_\(False\)"):
        least_squares(lambda m: m.a * torch.exp(-m.k * t) - y, Decay())
    with pytest.raises(ValueError, match="ftol"):
        least_squares(lambda m: decay_residuals(m, t, y), Decay(), ftol=-1.0)
    with pytest.raises(TypeError, match="params_or_module"):
        least_squares(lambda m: m, [1.0, 2.0])


@pytest.mark.parametrize("solver", ["auto", "cg"])  # CurveSteps' checks; the optimizer's
def test_a_curve_fits_start_is_checked_on_either_path(solver):
    t, y = decay_data()
    with pytest.raises(ValueError, match=r"parameter\(s\) \['c'\]"):
        least_squares(lambda m: m.a * torch.exp(-m.k * t) - y, Decay(), solver=solver)
    with pytest.raises(ValueError, match="not finite at the starting point"):
        least_squares(lambda m: decay_residuals(m, t, y) / m.c, Decay(c=0.0), solver=solver)
    with pytest.raises(ValueError, match="residual vector is empty"):
        least_squares(lambda m: decay_residuals(m, t, y)[:0], Decay(), solver=solver)


def test_a_start_that_meets_gtol_takes_no_step():
    t = torch.linspace(0, 1, 9, dtype=torch.float64)
    model = Decay(a=2.0, k=0.5, c=0.1)
    with torch.no_grad():
        y = decay_residuals(model, t, torch.zeros_like(t))  # exact data: r = 0 at the start
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    res = least_squares(lambda m: decay_residuals(m, t, y), model)
    assert (res.status, res.steps, res.cost, res.grad_norm) == (1, 0, 0.0, 0.0)
    assert torch.equal(res.x, start)


def test_frozen_parameter_kept():
    t, y = decay_data()
    model = Decay(c=0.5)
    model.c.requires_grad_(False)
    res = least_squares(lambda m: decay_residuals(m, t, y), model, **TIGHT)
    assert model.c.item() == 0.5 and res.x.numel() == 2
    assert math.isfinite(res.cost)


def _info(**kw) -> StepInfo:
    base = dict(
        loss=1.0, loss_after=1.0, grad_norm=1e-8, iterations=0, residual=0.0,
        stop_reason="cholesky", damping=1e-3, next_damping=1e-3, step_size=0.0,
        tr_ratio=math.nan, predicted_change=-1e-14, loss_evals=1, line_search_ok=False,
        solver="direct", taken=False,
    )  # fmt: skip
    base.update(kw)
    return StepInfo(**base)


def test_a_step_not_taken_at_a_prediction_within_rounding_meets_ftol():
    # predicted 1e-14 (cost units 5e-15): within the loss's rounding (100 eps), above ftol F
    x = torch.ones(3, dtype=torch.float64)
    assert termination(_info(), x, x, 1.0, 0.0, 1e-15) == 2
    # the same step taken (a reduction within rounding, ratio 0): it goes on
    moved = x + 1e-9
    taken = _info(taken=True, step_size=1.0, loss_after=1.0 - 1e-16, line_search_ok=True)
    assert termination(taken, x, moved, 1.0, 0.0, 1e-15) is None
    # a step not taken at a prediction above rounding (its ratio a number): it goes on
    rejected = _info(tr_ratio=-3.0, predicted_change=-1e-6)
    assert termination(rejected, x, x, 1.0, 0.0, 1e-15) is None
    # ftol off: never
    assert termination(_info(), x, x, 1.0, 0.0, 0.0) is None


def test_flat_gradient_puts_zeros_where_a_parameter_is_not_reached():
    from torch_sgn.model.flat_model import flat_gradient

    a, b = torch.ones(2, 2, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    g = torch.arange(4.0, dtype=torch.float64).reshape(2, 2)
    out = flat_gradient([a, b], [g, None])
    assert torch.equal(out, torch.tensor([0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0], dtype=torch.float64))


# NIST StRD's MGH10 (Meyer): y = b1 exp(b2 / (x + b3)), x = 50, 55, ..., 125 (public domain).
MGH10_Y = [
    34780.0, 28610.0, 23650.0, 19630.0, 16370.0, 13720.0, 11540.0, 9744.0,
    8261.0, 7030.0, 6005.0, 5147.0, 4427.0, 3820.0, 3307.0, 2872.0,
]  # fmt: skip
MGH10_CERTIFIED = [5.6096364710e-03, 6.1813463463e03, 3.4522363462e02]


def _mgh10(b):
    x = torch.arange(50.0, 126.0, 5.0, dtype=torch.float64)
    return b[0] * torch.exp(b[1] / (x + b[2])) - torch.tensor(MGH10_Y, dtype=torch.float64)


MGH10_START = [2.0, 4e5, 2.5e4]  # NIST's first start


def _digits_of_mgh10(x: torch.Tensor) -> float:
    certified = torch.tensor(MGH10_CERTIFIED, dtype=torch.float64)
    return float(-torch.log10(((x - certified).abs() / certified).max()))


def test_a_fit_that_ends_on_a_plateau_starts_again_with_the_scaled_trust_region():
    """MGH10 from NIST's first start: SGN's second step lands where the exponential is ~1e-13
    of its size, the residuals no longer depend on the parameters, and the cost's change meets
    ftol after 3 steps. The fit starts again from the start with MINPACK's scaled trust region,
    which reaches the certified values, and says so."""
    start = torch.tensor(MGH10_START, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no plateau at the end: no warning
        fit = least_squares(_mgh10, start.clone(), **TIGHT)
    assert fit.success and "started again with MINPACK's scaled trust region" in fit.message
    assert "after 3 steps" in fit.message and fit.steps <= 300  # within the default max_steps
    assert fit.last_step.stop_reason == "scaled_trust_region"
    assert _digits_of_mgh10(fit.x) > 6


def test_a_fit_that_ends_where_the_jacobian_vanished_says_so():
    """With no steps left for the scaled trust region, the plateau is the result: it warns,
    and its message says it is no minimum, with what to try."""
    start = torch.tensor(MGH10_START, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"Jacobian vanished.*not at a minimum.*max_steps"):
        plateau = least_squares(_mgh10, start.clone(), max_steps=3, **TIGHT)
    assert "Jacobian vanished" in plateau.message and "started again" not in plateau.message
    assert plateau.grad_norm < 1e-6 and plateau.cost > 1e9  # a plateau, far from the fit
    assert plateau.last_step.stop_reason != "scaled_trust_region"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note where J keeps its size
        fit = least_squares(
            _mgh10, start.clone(), geodesic_acceleration="strict", attempts=10, max_steps=1000,
            **TIGHT,
        )  # fmt: skip
    assert fit.success and "vanished" not in fit.message and "started again" not in fit.message
    assert _digits_of_mgh10(fit.x) > 6


def test_a_restart_that_ends_on_a_plateau_too_is_the_result_and_says_so():
    """tanh(x) = 2 has no solution: the cost falls as x grows, where J = 1 - tanh(x)^2 vanishes.
    SGN's steps and then the scaled trust region each end on that plateau; the second end is
    the fit's (not a third start), and the warning no longer suggests the restart."""
    with pytest.warns(UserWarning, match="Jacobian vanished") as record:
        fit = least_squares(lambda x: torch.tanh(x) - 2, torch.tensor([0.5], dtype=D64), **TIGHT)
    assert "started again with MINPACK's scaled trust region" in fit.message
    assert fit.last_step.stop_reason == "scaled_trust_region"
    assert fit.steps < STEPS_PER_PARAMETER and fit.x.item() > 5  # the restart's end, not 0.5
    assert "max_steps" not in str(record[0].message)


def test_no_note_where_the_jacobian_keeps_its_size():
    t, y = decay_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = least_squares(lambda m: decay_residuals(m, t, y), Decay(), **TIGHT)
    assert result.success and result.message == MESSAGES[result.status]


class _Vector(nn.Module):
    def __init__(self, x):
        super().__init__()
        self.x = nn.Parameter(torch.tensor(x, dtype=D64))


def test_a_residuals_fit_tests_gtol_before_each_step(monkeypatch):
    """Both kinds of fit test ``gtol`` at a point before stepping from it: a Residuals problem
    (the optimizer's steps) takes no step that is then undone."""
    calls = []
    finish = Stepper.finish
    monkeypatch.setattr(
        Stepper, "finish", lambda self, *a, **k: calls.append(1) or finish(self, *a, **k)
    )
    A, b = linear_problem()
    problem = Residuals(_Vector([0.0] * 5), {"r": Residual(lambda m: A @ m.x - b)})
    fit = least_squares(problem, xtol=0, ftol=0, gtol=1e-10)
    assert fit.status == 1 and fit.steps >= 1 and len(calls) == fit.steps
    start = Residuals(_Vector(fit.x.tolist()), {"r": Residual(lambda m: A @ m.x - b)})
    again = least_squares(start, xtol=0, ftol=0, gtol=1e-6)  # its start meets gtol
    assert (again.status, again.steps, again.evaluations, again.last_step) == (1, 0, 1, None)
    assert len(calls) == fit.steps  # no step from it


def test_a_residuals_fit_that_ends_on_a_plateau_starts_again_and_says_so():
    """A Residuals problem gets the curve fits' plateau rule: tanh(x) = 2 (no solution; J
    vanishes as x grows) restarts with the scaled trust region and warns at its end."""
    problem = Residuals(_Vector([0.5]), {"r": Residual(lambda m: torch.tanh(m.x) - 2)})
    with pytest.warns(UserWarning, match="Jacobian vanished"):
        fit = least_squares(problem, **TIGHT)
    assert "started again with MINPACK's scaled trust region" in fit.message
    assert fit.last_step.stop_reason == "scaled_trust_region" and fit.x.item() > 5
    assert problem.network.x.item() == fit.x.item()  # the parameters hold the result


def test_a_residuals_fit_builds_no_sgn_and_evaluates_each_point_once(monkeypatch):
    """A Residuals problem's fit takes SGN's steps through its Stepper, not an SGN, and each
    point's step is prepared once: the gtol test reads the gradient from it (the last point's
    step, prepared and then dropped where gtol ends the fit)."""
    prepared = []
    prepare = Stepper.prepare
    monkeypatch.setattr(
        Stepper, "prepare", lambda self, *a, **k: prepared.append(1) or prepare(self, *a, **k)
    )
    A, b = linear_problem()
    problem = Residuals(_Vector([0.0] * 5), {"r": Residual(lambda m: A @ m.x - b)})
    fits = []
    calls = library_calls(lambda: fits.append(least_squares(problem, xtol=0, ftol=0, gtol=1e-10)))
    assert ("optimizer.py", "SGN.__init__") not in calls
    assert ("stepper.py", "Stepper.__init__") in calls  # (the observation sees the fit's calls)
    fit = fits[0]
    assert fit.status == 1 and fit.steps >= 1
    assert len(prepared) == fit.steps + 1  # one per point visited
    reference = np.linalg.lstsq(A.numpy(), b.numpy(), rcond=None)[0]
    np.testing.assert_allclose(fit.x.numpy(), reference, rtol=1e-8, atol=1e-10)
