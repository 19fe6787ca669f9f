r"""A driver that runs SGN to convergence on a nonlinear least-squares problem.

:func:`least_squares` minimizes the cost

.. math::
    F(\theta) = \tfrac12 \lVert r(\theta) \rVert^2

of a residual vector ``r`` of a module's parameters (a curve fit's model and data, or a
:class:`~torch_sgn.pinn.Residuals` problem) by :class:`~torch_sgn.SGN`'s steps, and stops by
the tests of :func:`scipy.optimize.least_squares` (``method="trf"``, no bounds, unit
``x_scale``), with its status codes:

* ``gtol`` (status 1): :math:`\lVert g \rVert_\infty < \text{gtol}`, with
  :math:`g = J^\top r` the gradient of ``F``;
* ``ftol`` (status 2): :math:`dF < \text{ftol}\, F` at a step whose ratio of actual to
  predicted reduction exceeds 1/4;
* ``xtol`` (status 3): :math:`\lVert d\theta \rVert < \text{xtol}\,(\text{xtol} +
  \lVert\theta\rVert)`;
* status 4: ``ftol`` and ``xtol`` at the same step; 0: ``max_steps`` steps taken; -1: a step
  failed (a non-finite loss or gradient at an accepted point).

Example::

    class Decay(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
            self.k = nn.Parameter(torch.tensor(0.1, dtype=torch.float64))

    model = Decay()
    result = least_squares(lambda m: m.a * torch.exp(-m.k * t) - y, model)
    result.x, result.cost, result.status, result.message

References:
    M. A. Branch, T. F. Coleman, Y. Li. A Subspace, Interior, and Conjugate Gradient Method for
    Large-Scale Bound-Constrained Minimization Problems. SIAM J. Sci. Comput. 21(1), 1999
    (scipy's ``trf``, whose tests these are). J. J. More, B. S. Garbow, K. E. Hillstrom. User
    Guide for MINPACK-1. Argonne ANL-80-74, 1980.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .curve_steps import CurveSteps
from .distributed import communicator
from .engines.functional import jacobian_rows
from .linearization import Batch
from .losses import resolve_loss
from .model.flat_model import FunctionalModel, flat_gradient
from .options import SETUP_KEYS, Options, Setup
from .pinn.residuals import Residual, Residuals
from .route_plan import ALL, curve_steps_allowed
from .solve.state import StepState
from .step_info import StepInfo
from .stepper import Prepared, Stepper

__all__ = ["LeastSquaresResult", "least_squares", "termination"]

#: scipy's messages for its status codes (``scipy.optimize.least_squares``).
MESSAGES = {
    -1: "a step failed",
    0: "the maximum number of steps is exceeded",
    1: "`gtol` termination condition is satisfied",
    2: "`ftol` termination condition is satisfied",
    3: "`xtol` termination condition is satisfied",
    4: "both `ftol` and `xtol` termination conditions are satisfied",
}

#: ``max_steps=None`` with a tolerance set: this many steps per parameter (scipy's ``trf``
#: allows ``100 n`` function evaluations by default; one SGN step is at least one).
STEPS_PER_PARAMETER = 100


@dataclass(frozen=True)
class LeastSquaresResult:
    """What :func:`least_squares` found.

    Attributes:
        x: the solution, flat (the trainable parameters in the module's order, detached); the
            module holds it too.
        cost: :math:`\\tfrac12 \\lVert r \\rVert^2` at ``x`` (scipy's ``cost``).
        fun: the residuals at ``x``, flat.
        grad_norm: :math:`\\lVert J^\\top r \\rVert_\\infty` at ``x`` (scipy's ``optimality``).
        status: scipy's code: 1 ``gtol``, 2 ``ftol``, 3 ``xtol``, 4 ``ftol`` and ``xtol``,
            0 ``max_steps`` reached, -1 a step failed.
        message: what the status means.
        success: ``status > 0``.
        steps: the steps taken (none from a point that meets ``gtol``).
        evaluations: residual evaluations: one per point where the tests ran (the residuals and
            the gradient there; a residual function's first one also checks the start), plus
            each step's trial points (:attr:`~torch_sgn.StepInfo.loss_evals`), plus, for
            steps by :class:`~torch_sgn.SGN` itself (a :class:`~torch_sgn.pinn.Residuals`
            problem), the step's own evaluation at its start.
        last_step: the last step's :class:`~torch_sgn.StepInfo` (``None`` without steps).
    """

    x: Tensor
    cost: float
    fun: Tensor
    grad_norm: float
    status: int
    message: str
    success: bool
    steps: int
    evaluations: int
    last_step: Optional[StepInfo] = None


ResidualFn = Callable[..., Tensor]


def least_squares(
    residuals: Union[ResidualFn, Residuals],
    params_or_module: Union[nn.Module, Tensor, None] = None,
    *,
    xtol: float = 1e-8,
    ftol: float = 1e-8,
    gtol: float = 1e-8,
    max_steps: Optional[int] = None,
    solver: str = "auto",
    **sgn_options,
) -> LeastSquaresResult:
    r"""Minimizes :math:`\tfrac12 \lVert r(\theta) \rVert^2` by SGN's steps until scipy's
    tests stop it (see the module's docstring).

    Args:
        residuals: ``residuals(module) -> tensor`` of any shape (the residuals, a function of
            the module's parameters), or a :class:`~torch_sgn.pinn.Residuals` problem on fixed
            points (its weighted residual vector is ``r``).
        params_or_module: the module whose trainable parameters are fitted (updated in
            place), or one tensor of parameters: then ``residuals(x)`` takes that tensor, an
            ``nn.Parameter`` is updated in place, any other tensor is copied. ``None`` (or the
            problem's network) for a :class:`~torch_sgn.pinn.Residuals` problem.
        xtol: relative step size: stop once :math:`\lVert d\theta \rVert < \text{xtol}\,
            (\text{xtol} + \lVert\theta\rVert)`. Default ``1e-8``, as scipy; 0 turns it off.
        ftol: relative reduction of the cost: stop once :math:`dF < \text{ftol}\, F` at a step
            whose actual reduction is more than a quarter of the predicted one. Default
            ``1e-8``, as scipy; 0 turns it off.
        gtol: stop once the gradient's largest entry :math:`\lVert J^\top r\rVert_\infty <
            \text{gtol}` (an absolute test, as scipy's ``trf``). Default ``1e-8``, as scipy;
            0 turns it off.
        max_steps: the most SGN steps. Default ``None``: 100 per parameter, or, with every
            tolerance 0, an error (nothing would stop the fit).
        solver: SGN's ``solver``. Default ``"auto"``, which takes exact Levenberg-Marquardt
            steps at once on such problems.
        **sgn_options: any other argument of :class:`~torch_sgn.SGN` (``damping``,
            ``geodesic_acceleration``, ``attempts``, ...), except ``keep_grad`` (the fit
            leaves each parameter's ``.grad`` as it was). Two defaults differ from
            SGN's: ``damping_update="nielsen"`` (on the NIST StRD suite it took fewer steps
            than the paper's threshold rule), and ``engine="functional"`` (for exact steps the
            engine ``"auto"`` takes on these problems too; with ``solver="cg"`` it makes
            the ``G v`` products by forward mode, where ``"auto"`` traces the problem).

    A residual function's fit (``residuals`` a callable) takes its steps through
    :class:`~torch_sgn.curve_steps.CurveSteps`: SGN's exact steps with these options, without
    the optimizer's per-step set-up (measured in docs/PINN.md), and a line search that gives up
    at the loss's rounding. Fits with ``solver="cg"``, ``weight_decay``,
    ``gradient_averaging`` or ``curvature_fraction``, with more than ``direct_max_params``
    parameters, and :class:`~torch_sgn.pinn.Residuals` problems take SGN's own step, as
    :meth:`~torch_sgn.SGN.step` runs it (:class:`~torch_sgn.stepper.Stepper`; no ``SGN`` is
    built), each point evaluated once: the ``gtol`` test reads the gradient from the step's
    linearization. One driver loop runs both, with the same tests. Where the
    exact steps end on a plateau (``J``'s norm below :math:`\sqrt{\epsilon}` times its norm at
    the start) with steps left, the fit starts again from its start with MINPACK's scaled trust
    region, and ``message`` says so; on a ``Residuals`` problem ``J`` is formed for this test
    at the start and at the end, where it has at most ``direct_max_params ** 2`` entries.

    Returns:
        A :class:`LeastSquaresResult`.

    Warns:
        UserWarning: a fit whose Jacobian vanished on the way (its norm at
            the end below :math:`\sqrt{\epsilon}` times that at the start): it ended on a
            plateau where the residuals no longer depend on the parameters (an exponential
            that underflowed), not at a minimum, whatever its status says. The result's
            ``message`` says so too, with what to try.

    Raises:
        ValueError: the residuals are not finite at the start; they do not depend on (some
            of) the trainable parameters; every tolerance is 0 and ``max_steps`` is ``None``;
            a negative tolerance; a problem whose points are drawn anew at each step.
        TypeError: ``residuals`` or ``params_or_module`` of the wrong kind.

    .. note::
        scipy's trust region retries a rejected step inside one iteration; SGN's step does
        that by its line search (and ``attempts``). The ``ftol`` test's ratio is therefore
        taken at the step accepted by the line search, :math:`\text{pred}(a) =
        \text{pred}(1)\, a (2 - a)` for the step ``a d`` along the Gauss-Newton direction
        ``d`` (exact for CG and direct solutions, which satisfy :math:`g^\top d = -d^\top
        (G + \rho I) d`). Where SGN finds the predicted reduction within rounding of the cost
        (its trust-region ratio is NaN), the ``ftol`` test takes MINPACK's form instead: the
        actual and predicted reductions both below ``ftol F``, or the step not taken (the next
        would be the same step again: MINPACK's "ftol is too small"). A step that does not move
        meets ``xtol`` when the bound :math:`\lVert d \rVert \le \sqrt{2\,\text{pred}/\rho}`
        on its direction does. ``gtol`` is tested at each point before a step from it.
    """
    for name, tol in (("xtol", xtol), ("ftol", ftol), ("gtol", gtol)):
        if not (isinstance(tol, (int, float)) and tol >= 0 and math.isfinite(tol)):
            raise ValueError(f"invalid {name}={tol!r}: must be a finite number >= 0 (0: off)")
    if max_steps is not None and not (isinstance(max_steps, int) and max_steps >= 0):
        raise ValueError(f"invalid max_steps={max_steps!r}: must be an int >= 0 or None")
    if xtol == ftol == gtol == 0 and max_steps is None:
        raise ValueError(
            "xtol, ftol and gtol are all 0 and max_steps is None: nothing would stop the fit; "
            "set a tolerance > 0 or max_steps=<number of steps>"
        )
    if "keep_grad" in sgn_options:
        raise TypeError(
            "keep_grad is not an option of least_squares: the fit leaves each parameter's "
            ".grad as it was"
        )

    # Exact steps form J row-batched (torch_sgn.engines.functional): the functional engine, which
    # traces nothing, is the rows engine's under "auto" too; the default pins it for CG fits.
    sgn_options.setdefault("engine", "functional")
    sgn_options.setdefault("damping_update", "nielsen")
    problem, params, curve = _problem(residuals, params_or_module)
    inputs, targets = problem.batch()
    if max_steps is None:
        max_steps = STEPS_PER_PARAMETER * sum(p.numel() for p in params)
    return _run(
        problem, params, inputs, targets, xtol, ftol, gtol, max_steps, solver, sgn_options,
        curve,
    )  # fmt: skip


def _run(
    problem: Residuals,
    params: List[nn.Parameter],
    inputs: Tuple[Tensor, ...],
    targets: Tensor,
    xtol: float,
    ftol: float,
    gtol: float,
    max_steps: int,
    solver: str,
    sgn_options: dict,
    curve: Optional[Tuple[ResidualFn, nn.Module]],
) -> LeastSquaresResult:
    """The fit: its phases (:class:`_Phase`) run by :func:`_drive`, and their result."""
    options, setup = _settings(solver, sgn_options)
    numel = sum(p.numel() for p in params)
    jacobians = _Jacobians(setup.direct_max_params**2)
    exact = (
        max_steps > 0
        and curve_steps_allowed(setup, options, numel)
        and all(p.is_floating_point() for p in params)
    )
    leans: List[CurveSteps] = []  # (each closed at the end)

    def lean_steps(fn: ResidualFn, module: nn.Module, check=None) -> CurveSteps:
        leans.append(CurveSteps(fn, module, params, options, check=check))
        return leans[-1]

    def stepped() -> _Stepped:  # SGN's step, built where it runs
        fmodel, loss = FunctionalModel(problem), resolve_loss(problem.loss)
        comm = communicator(fmodel, loss, sgn_options.get("process_group"))
        stepper = Stepper(fmodel, loss, comm, setup, options)
        return _Stepped(stepper, options, problem, params, inputs, targets, jacobians)

    phases: List[Callable[[], _Phase]]
    if curve is not None and exact:
        # A residual function's fit, whose steps CurveSteps takes: the checks of the start on
        # its first evaluations (the residuals and J there).
        names = _names(problem, params)
        lean = lean_steps(*curve, check=lambda r, reached: _check_start(r, names, reached))
        phases = [
            lambda: _Curve(lean, lean.step, jacobians),
            lambda: _Curve.scaled(lean, jacobians),
        ]
    else:
        phases = [stepped]
        if exact:  # (CurveSteps made where it takes over: it rewrites the parameters' storage)
            fn = lambda m: m(*inputs)  # noqa: E731
            phases.append(lambda: _Curve.scaled(lean_steps(fn, problem), jacobians))

    def finish(theta: Tensor) -> None:  # the parameters hold the last accepted point
        for lean in leans:
            lean.write(theta)
            lean.close()

    run = _drive(phases, _flat(params), xtol, ftol, gtol, max_steps, options.lr, finish)
    message = MESSAGES[run.status]
    if run.restarted is not None:
        message += (
            f" (SGN's steps ended on a plateau after {run.restarted} steps, where the residuals' "
            "Jacobian vanished: the fit started again with MINPACK's scaled trust region)"
        )
    vanished = _vanished(run.norms, params[0].dtype, run.restarted is not None)
    if vanished is not None:
        warnings.warn(f"least_squares: {vanished}", stacklevel=3)
        message += f"; but {vanished}"
    fun, grad = run.end
    return LeastSquaresResult(
        x=_flat(params),
        cost=0.5 * float(fun.square().sum()),
        fun=fun,
        grad_norm=_sup(grad),
        status=run.status,
        message=message,
        success=run.status > 0,
        steps=run.steps,
        evaluations=run.evaluations,
        last_step=run.info,
    )


def _settings(solver: str, sgn_options: dict) -> Tuple[Options, Setup]:
    """The fit's options and settings, checked as :class:`~torch_sgn.SGN` checks its
    arguments."""
    setup_args = {k: v for k, v in sgn_options.items() if k in SETUP_KEYS}
    rest = {k: v for k, v in sgn_options.items() if k not in SETUP_KEYS and k not in _ONLY_SGN}
    options = Options().replace(**rest)
    return options, Setup().replace(solver=solver, **setup_args)


#: SGN's arguments that are neither options nor settings (passed to it as they are).
_ONLY_SGN = ("process_group",)


# --- the driver ---------------------------------------------------------------------------------
@dataclass
class _Jacobians:
    """``J`` at the fit's start and where it was formed last, for the plateau test (its norm
    vanished on the way: :func:`_plateau`). The optimizer's steps form ``J`` for it alone, at
    the start and at the end, where it has at most ``limit`` entries."""

    limit: int
    first: Optional[Tensor] = None
    last: Optional[Tensor] = None

    def formed(self, jac: Tensor) -> None:
        self.first = jac if self.first is None else self.first
        self.last = jac

    def norms(self) -> Tuple[float, float]:
        """The Frobenius norms of ``J`` at the start and at the end (NaN: not formed)."""
        if self.first is None or self.last is None:
            return (math.nan, math.nan)
        return _norms(self.first, self.last)


class _Phase(Protocol):
    """One kind of step of the fit: SGN's steps by :class:`~torch_sgn.curve_steps.CurveSteps`
    or by SGN's :class:`~torch_sgn.stepper.Stepper`, or the scaled trust region that takes
    over where they end on a plateau."""

    #: residual evaluations of the last step besides its start's and its trial points'
    #: (``StepInfo.loss_evals``)
    step_evaluations: int
    #: residual evaluations before the first :meth:`start` (the checks of the start)
    first_evaluations: int
    jacobians: _Jacobians

    def start(self, theta: Tensor) -> Tensor:
        """The cost's gradient ``J^T r`` at ``theta`` (the parameters hold it), where a step
        from it starts: one evaluation, the step's own."""

    def step(self, theta: Tensor) -> Tuple[Tensor, StepInfo]:
        """The step from :meth:`start`'s point: the next point (``theta`` where the step is not
        taken) and its info; raises ``FloatingPointError`` where it failed (the parameters
        keep ``theta``)."""

    def end(self, theta: Tensor) -> Tuple[Tensor, Tensor]:
        """``(r, J^T r)`` at the phase's last point: :meth:`start`'s where it was there,
        else formed now; a step started and not taken is dropped."""


@dataclass(frozen=True)
class _Run:
    """What :func:`_drive` ran: steps, residual evaluations, status, the last step's info, the
    residuals and the cost's gradient at the end, the Frobenius norms of ``J`` at the start and
    at the end, and the steps taken when the scaled trust region took over (``None``: it did
    not)."""

    steps: int
    evaluations: int
    status: int
    info: Optional[StepInfo]
    end: Tuple[Tensor, Tensor]
    norms: Tuple[float, float]
    restarted: Optional[int]


def _drive(
    phases: Sequence[Callable[[], _Phase]],
    theta: Tensor,
    xtol: float,
    ftol: float,
    gtol: float,
    max_steps: int,
    lr: float,
    finish: Callable[[Tensor], None],
) -> _Run:
    """The fit's steps from ``theta``, stopped by scipy's tests: ``gtol`` (and a gradient that
    is not finite) at each point before its step, ``ftol`` and ``xtol`` after it
    (:func:`termination`). Without steps (``max_steps=0``), the start's ``gtol`` alone.

    The first phase's steps first; where they stop on a plateau (``J``'s norm below
    ``sqrt(eps)`` times its norm at the start, :func:`_plateau`) with steps left, the fit starts
    again from its start with the next phase's steps (made then), the steps counted on."""
    start = theta
    steps, status, info, restarted = 0, None, None, None
    evaluations = 0
    try:
        for k, make in enumerate(phases):
            phase = make()
            evaluations += phase.first_evaluations if k == 0 else 0
            while status is None and steps < max_steps:
                grad = phase.start(theta)
                evaluations += 1
                sup = _sup(grad)  # NaN or infinite where an entry is
                if not math.isfinite(sup):
                    status = -1
                elif sup < gtol:  # (at the start too: the fit's first test)
                    status = 1
                else:
                    try:
                        point, info = phase.step(theta)
                    except FloatingPointError:
                        status = -1
                        break
                    evaluations += phase.step_evaluations + info.loss_evals
                    steps += 1
                    status = termination(info, theta, point, lr, xtol, ftol)
                    theta = point
            end = phase.end(theta)
            if max_steps == 0 and _sup(end[1]) < gtol:
                status = 1
            norms = phase.jacobians.norms()
            again = k + 1 < len(phases) and status != -1 and steps < max_steps
            if not (again and _plateau(norms, theta.dtype)):
                break  # (the scaled trust region's end is the fit's, plateau or not)
            restarted, status, theta = steps, None, start
    finally:
        finish(theta)
    status = 0 if status is None else status
    return _Run(steps, evaluations, status, info, end, norms, restarted)


class _Curve:
    """Steps by :class:`~torch_sgn.curve_steps.CurveSteps` (``take``: its ``step`` or its
    ``scaled_step``), ``J`` formed at every point."""

    step_evaluations = 0
    first_evaluations = 1  # (the checks of the start, by the plain call)

    def __init__(self, lean: CurveSteps, take: Callable, jacobians: _Jacobians):
        self.lean, self.take, self.jacobians = lean, take, jacobians
        self.formed: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]] = None  # theta, r, J, g

    @classmethod
    def scaled(cls, lean: CurveSteps, jacobians: _Jacobians) -> _Curve:
        return cls(lean, lean.scaled_step, jacobians)

    def start(self, theta: Tensor) -> Tensor:
        r, jac = self.lean.jacobian(theta)
        grad = jac.T @ r  # the cost's gradient
        self.formed = (theta, r, jac, grad)
        self.jacobians.formed(jac)
        return grad

    def step(self, theta: Tensor) -> Tuple[Tensor, StepInfo]:
        assert self.formed is not None and self.formed[0] is theta
        return self.take(theta, *self.formed[1:])

    def end(self, theta: Tensor) -> Tuple[Tensor, Tensor]:
        if self.formed is None or self.formed[0] is not theta:  # the last step moved
            self.start(theta)
        return self.formed[1], self.formed[3]


class _Stepped:
    """Steps by SGN's :class:`~torch_sgn.stepper.Stepper` on the parameters in place. Each
    point is evaluated once: :meth:`start` prepares the step (its linearization) and reads the
    cost's gradient from it, :meth:`step` finishes it. The first point is evaluated by autograd
    (its checks) and its step prepared by :meth:`step`; where a step's gradient is not the
    cost's (the step takes a sample of the rows, or ``weight_decay`` adds its term) the
    cost's is evaluated by autograd besides."""

    first_evaluations = 0  # (the first start checks the start)

    def __init__(
        self,
        stepper: Stepper,
        options: Options,
        problem: Residuals,
        params: List[nn.Parameter],
        inputs: Tuple[Tensor, ...],
        targets: Tensor,
        jacobians: _Jacobians,
    ):
        self.stepper, self.options, self.problem, self.params = stepper, options, problem, params
        self.inputs, self.targets, self.jacobians = inputs, targets, jacobians
        self.stored: dict = {}  # the steps' state (StepState's entries)
        StepState.first(options).write(self.stored)
        self.checked = False  # the start checked
        self.prepared: Optional[Tuple[Tensor, Prepared]] = None  # (theta, its step)
        self.step_evaluations = 0
        self.jacobian_at: Optional[Tensor] = None  # where J was formed last

    def start(self, theta: Tensor) -> Tensor:
        self._drop()
        if not self.checked:
            self.checked, self.step_evaluations = True, 1
            self._jacobian(theta)
            return self._gradient(check=True)
        try:
            prepared = self._prepare()
        except FloatingPointError:  # (the driver's status -1)
            self.step_evaluations = 0
            return torch.full_like(theta, math.nan)
        self.prepared = (theta, prepared)
        whole = prepared.plan.rows in (None, ALL) and not self.options.weight_decay
        self.step_evaluations = 0 if whole else 1
        if whole:  # the gradient of the sum of squares, 2 J^T r
            return 0.5 * prepared.unrestricted.grad
        return self._gradient(check=False)

    def step(self, theta: Tensor) -> Tuple[Tensor, StepInfo]:
        prepared = self._prepare() if self.prepared is None else self.prepared[1]
        assert self.prepared is None or self.prepared[0] is theta
        self.prepared = None
        info = self.stepper.finish(prepared)
        return _flat(self.params), info

    def end(self, theta: Tensor) -> Tuple[Tensor, Tensor]:
        self._drop()
        self._jacobian(theta)
        check, self.checked = not self.checked, True  # (no step: the start checked here)
        return _residuals_and_gradient(self.problem, self.params, self.inputs, check=check)

    def _prepare(self) -> Prepared:
        return self.stepper.prepare(self.options, self.inputs, self.targets, self.stored)

    def _gradient(self, check: bool) -> Tensor:
        """The cost's gradient by autograd (``check``: and the checks of the start)."""
        return _residuals_and_gradient(self.problem, self.params, self.inputs, check=check)[1]

    def _drop(self) -> None:
        """Drops a step started and not taken (the gtol test ended the fit at its point)."""
        if self.prepared is not None:
            self.prepared[1].abandon()
            self.prepared = None

    def _jacobian(self, theta: Tensor) -> None:
        """``J`` at ``theta`` for the plateau test, where it has at most the limit's entries."""
        if self.jacobian_at is theta:
            return
        if self.problem.count(self.inputs) * theta.numel() <= self.jacobians.limit:
            batch = Batch(self.inputs, self.targets)
            self.jacobians.formed(jacobian_rows(FunctionalModel(self.problem), theta, batch)[1])
            self.jacobian_at = theta


def _norms(first: Tensor, last: Tensor) -> Tuple[float, float]:
    """The Frobenius norms of ``J`` at the start (``first``) and at the end (``last``)."""
    start, end = torch.stack([torch.linalg.matrix_norm(first), torch.linalg.matrix_norm(last)])
    return float(start), float(end)


def _plateau(norms: Tuple[float, float], dtype: torch.dtype) -> bool:
    """Whether ``J`` vanished on the way: its norm at the end (``norms[1]``) below ``sqrt(eps)``
    times its norm at the start (``norms[0]``; NaN: no)."""
    start, end = norms
    return end <= math.sqrt(torch.finfo(dtype).eps) * start


def _vanished(norms: Tuple[float, float], dtype: torch.dtype, restarted: bool) -> Optional[str]:
    """What to tell where ``J`` vanished on the way (:func:`_plateau`), else ``None``; after
    the scaled trust region's restart (``restarted``), without suggesting it.

    Such an end is no fit: the residuals no longer depend on the parameters there (an
    exponential that underflowed, a sigmoid saturated), so the gradient vanishes, and the
    tests that stop a fit (a tiny gradient, a tiny change of the cost) are met by the plateau.
    A minimum of a well-posed fit keeps ``J`` of full size.
    """
    if not _plateau(norms, dtype):
        return None
    restart = (
        ""
        if restarted
        else " more steps (max_steps: with steps left, a fit that ends on a "
        "plateau starts again with MINPACK's scaled trust region), or"
    )
    return (
        f"the residuals' Jacobian vanished on the way (its norm fell from {norms[0]:.3g} at "
        f"the start to {norms[1]:.3g}): the fit ended on a plateau where the residuals no "
        "longer depend on the parameters (an exponential that underflowed, a saturated unit), "
        f"not at a minimum. Try another start, or{restart} geodesic_acceleration='strict' "
        "with attempts=10, which rejects steps that leave the region where the model's "
        "linearization holds"
    )


def termination(
    info: StepInfo, before: Tensor, after: Tensor, lr: float, xtol: float, ftol: float
) -> Optional[int]:
    """scipy's ``check_termination`` on one step from ``before`` to ``after`` (its
    :class:`~torch_sgn.StepInfo` ``info``, SGN's step size ``lr``): the status a fit ends with
    (2 ``ftol``, 3 ``xtol``, 4 both; see the module's docstring), or ``None`` to go on."""
    cost = info.loss / 2
    reduction = (info.loss - info.loss_after) / 2
    predicted_full = max(-info.predicted_change / 2, 0.0)
    a = info.step_size / lr if lr > 0 else 0.0
    predicted = predicted_full * a * (2 - a)
    ratio = reduction / predicted if predicted > 0 else math.nan
    noise = info.tr_ratio is not None and math.isnan(info.tr_ratio)
    # At a prediction within rounding a step not taken would be the same step again (same point,
    # same damping): no reduction can be told from rounding there, MINPACK's "ftol too small".
    ftol_met = reduction < ftol * cost and (
        ratio > 0.25 or (noise and (predicted_full < ftol * cost or not info.taken))
    )
    if a > 0:  # (one copy to the host for both norms)
        norms = torch.stack(
            [torch.linalg.vector_norm(after - before), torch.linalg.vector_norm(before)]
        )
        dx, size = norms.tolist()
    else:
        size = float(torch.linalg.vector_norm(before))
        # no move: the bound on the rejected direction's length
        dx = math.sqrt(2 * predicted_full / info.damping) if info.damping > 0 else math.inf
    xtol_met = dx < xtol * (xtol + size)
    if ftol_met and xtol_met:
        return 4
    if ftol_met:
        return 2
    if xtol_met:
        return 3
    return None


# --- the problem ------------------------------------------------------------------------------
class _Vector(nn.Module):
    """One tensor of parameters, for ``least_squares(fn, x)``."""

    def __init__(self, x: nn.Parameter):
        super().__init__()
        self.x = x


def _problem(
    residuals: Union[ResidualFn, Residuals], params_or_module: Union[nn.Module, Tensor, None]
) -> Tuple[Residuals, List[nn.Parameter], Optional[Tuple[ResidualFn, nn.Module]]]:
    """The problem, its trainable parameters, and for a residual function ``(fn, module)``
    with ``fn(module)`` the residuals."""
    curve = None
    if isinstance(residuals, Residuals):
        if params_or_module is not None and params_or_module not in (
            residuals,
            residuals.network,
        ):
            raise TypeError(
                "params_or_module: with a Residuals problem pass None (its network's "
                "parameters are fitted), or the problem or its network"
            )
        drawn = [n for n, b in zip(residuals.names, residuals.blocks) if b.sample is not None]
        if drawn:
            raise ValueError(
                f"residuals: block(s) {drawn} draw their points anew at each step (sample=); "
                "least_squares fits a fixed problem: pass fixed points=..."
            )
        problem = residuals
    elif callable(residuals):
        if isinstance(params_or_module, nn.Module):
            problem = Residuals(params_or_module, {"residuals": Residual(residuals)})
            curve = (residuals, params_or_module)
        elif isinstance(params_or_module, Tensor):
            x = params_or_module
            if not isinstance(x, nn.Parameter):
                x = nn.Parameter(x.detach().clone())
            fn = residuals
            vector = _Vector(x)
            problem = Residuals(vector, {"residuals": Residual(lambda u: fn(u.x))})
            curve = (lambda u: fn(u.x), vector)
        else:
            raise TypeError(
                "params_or_module must be the nn.Module whose parameters are fitted (or one "
                f"tensor of parameters), got {type(params_or_module).__name__}"
            )
    else:
        raise TypeError(
            "residuals must be a callable module -> residual tensor or a "
            f"torch_sgn.pinn.Residuals, got {type(residuals).__name__}"
        )
    params = [p for p in problem.parameters() if p.requires_grad]
    if not params:
        raise ValueError("params_or_module has no trainable parameters to fit")
    return problem, params, curve


def _residuals_and_gradient(
    problem: Residuals, params: List[nn.Parameter], inputs: Sequence[Tensor], check: bool
) -> Tuple[Tensor, Tensor]:
    """The residuals, flat and detached, and the cost's gradient :math:`J^\\top r`."""
    with torch.enable_grad():
        r = problem(*inputs).reshape(-1)
        grads: Sequence[Optional[Tensor]] = [None] * len(params)
        if r.grad_fn is not None:
            grads = torch.autograd.grad(0.5 * r.square().sum(), params, allow_unused=True)
    if check:  # (a gradient is None exactly where the residuals do not reach the parameter)
        _check_start(r, _names(problem, params), grads)
    if r.grad_fn is None:
        return r.detach(), torch.zeros_like(_flat(params))
    return r.detach(), flat_gradient(params, grads)


def _names(problem: Residuals, params: Sequence[nn.Parameter]) -> List[str]:
    """The parameters' names in the problem's network."""
    names = {id(p): n for n, p in problem.network.named_parameters()}
    return [names[id(p)] for p in params]


def _check_start(r: Tensor, names: Sequence[str], reached: Sequence[Optional[Tensor]]) -> None:
    """Refuses residuals at the start that are not finite, empty, or do not depend on every
    trainable parameter (named ``names``; ``reached``: a gradient of the residuals by autograd
    for each, ``None`` where it does not reach it)."""
    bad = ~torch.isfinite(r.detach())
    if bad.any():
        first = int(bad.nonzero()[0])
        raise ValueError(
            f"residuals: {int(bad.sum())} of {r.numel()} residuals are not finite at the "
            f"starting point (the first at index {first}); start from parameters where the "
            "model is finite"
        )
    if r.numel() == 0:
        raise ValueError("residuals: the residual vector is empty")
    if r.grad_fn is None:
        raise ValueError(
            "residuals: the residuals do not depend on the parameters (no gradient reaches "
            "them): compute them from the module passed (not from detached copies or .data)"
        )
    unused = [n for n, g in zip(names, reached) if g is None]
    if unused:
        raise ValueError(
            f"residuals: do not depend on parameter(s) {unused}: use them in the residuals or "
            "freeze them (requires_grad_(False))"
        )


def _flat(params: Sequence[Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _sup(v: Tensor) -> float:
    return float(v.abs().max()) if v.numel() else 0.0
