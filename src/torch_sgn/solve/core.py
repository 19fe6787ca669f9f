r"""The step core: one SGN step from a linearization (its descent, one per route; the geodesic
acceleration of an exact step; the damped step; the probe), its next state and its report.

Whoever linearizes hands the core the same things: the linearization at the point
(:class:`~torch_sgn.linearization.Linearization`: the loss's gradient, ``v -> G v`` and the
exact routes it offers), the state (:class:`~torch_sgn.solve.state.StepState`), the options
(:class:`~torch_sgn.options.Options`), the step's route (its
:class:`~torch_sgn.solve.descents.Phase`, chosen by :mod:`torch_sgn.route_plan`) and the
:class:`Point`: how to evaluate the objective and the model's outputs at other parameters. It
returns a :class:`Step`, from which :func:`next_state` makes the state the next step starts
from and :meth:`Step.info` the :class:`~torch_sgn.StepInfo`. Two callers:

* :class:`torch_sgn.stepper.Stepper` (what :meth:`torch_sgn.SGN.step` and a
  ``Residuals`` problem's :func:`~torch_sgn.least_squares` run): linearize (an engine, or a
  residual problem's rows) -> plan (:mod:`torch_sgn.route_plan`) -> :func:`take` -> commit
  (write the parameters, then :func:`next_state`);
* :class:`torch_sgn.curve_steps.CurveSteps` (a least-squares fit's exact steps): a
  linearization from the residuals ``r`` and their Jacobian ``J`` -> :func:`take` by the route
  ``"matrix"``.

The walk of one ``SGN.step`` on a :class:`torch_sgn.pinn.Residuals` problem, file by file
(``scripts/step_walk.py`` measures it: 12 files besides the problem's own evaluation):
``optimizer.py`` (the call, its options read and checked by ``options.py``) -> ``stepper.py``
(the step's recipe: the batch's checks, the state from ``solve/state.py``) ->
``route_plan.py`` (the rows: the batch's, or a sample's, the problem read through its protocol)
-> the linearization (``distributed.py``'s communicator, ``linearization.py``;
``engines/functional.py``'s rows engine, the problem's: the loss and gradient by the functional
engine and ``losses.py``, ``J``'s rows and ``G v`` from them) -> ``route_plan.py`` (the route,
``solver="auto"``'s phase) -> this module (the route's descent, solved by ``solve/direct.py``;
the damped step, its damping rules and line search: ``solve/step.py``; the geodesic
acceleration) -> ``stepper.py`` (the commit, this module's :func:`next_state`,
``route_plan.py``'s parts of the state, the report).

**The geodesic acceleration** of exact Levenberg-Marquardt steps (Transtrum and Sethna, 2012;
:func:`accelerator`). A Gauss-Newton step ``v`` solves the damped system of the linearized model, so
it misses the curvature of the model's outputs along ``v``. Where the fit to a smooth target winds
along a narrow curved valley (a small network fitted to high precision), the linear model's steps
shrink to a crawl. Geodesic acceleration adds the second-order term of the path that keeps the
outputs' velocity ``J v``: the step becomes

.. math::
    \delta = v + \tfrac12 a, \qquad (G + \rho I)\, a = -J^\top H f_{vv},

with :math:`f_{vv}` the second directional derivative of the outputs along ``v``, taken here by
a central difference, :math:`(f(\theta + h v) - 2 f(\theta) + f(\theta - h v)) / h^2`, two
forward passes beside the step's own; where ``J v`` is at hand (a curve fit's ``J`` formed
whole), by the one-sided difference :math:`2 (f(\theta + h v) - f(\theta) - h J v) / h^2`, one
pass (Transtrum and Sethna's choice; its error is :math:`O(h)` against the central one's
:math:`O(h^2)`). The system is the step's own, so its factorization serves again: one more
solve. The term is kept only while it is small against the step,
:math:`2\lVert a \rVert \le \alpha \lVert v \rVert` (their :math:`\alpha = 0.75`), and only
where the difference stands above the rounding of the outputs (in float32 near a precise fit
it would be noise). Then ``v`` alone is the step, or with ``geodesic_acceleration="strict"``
(:attr:`~torch_sgn.solve.step.DampingRule.strict_acceleration`) an ``a`` too large rejects the
attempt, as in Transtrum and Sethna's algorithm: it is solved again with more damping.

The trust-region ratio and the line search's slope are those of ``v``; the line search
backtracks along the parabola :math:`s v + \tfrac{s^2}{2} a`, whose slope at 0 is ``v``'s.

Reference:
    M. K. Transtrum and J. P. Sethna. Improvements to the Levenberg-Marquardt algorithm for
    nonlinear least-squares minimization. arXiv:1201.5885, 2012.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from ..linearization import Linearization, RowSample
from ..step_info import StepInfo
from . import direct, sampled
from .cg import CGResult, conjugate_gradient
from .descents import (
    CG,
    MATRIX,
    SAMPLED,
    SAMPLES,
    TOO_LARGE,
    Accelerate,
    Descent,
    Phase,
    TooLarge,
)
from .direct import DirectResult
from .nystrom import NystromApproximation, NystromCache
from .quadratic import QuadraticDescent
from .sampled import SampledPreconditioner
from .state import DampingState, StepState
from .step import DampingRule, LineSearch, Outcome, Problem, damped_step

if TYPE_CHECKING:
    from ..linearization import SampleSpace
    from ..options import Options

__all__ = [
    "CG_TOL", "NOISE", "ONE_BATCH_CG_ITERS", "ONE_BATCH_CG_RTOL", "RATIO", "STEP", "CGDescent",
    "CGSettings", "MatrixDescent", "Point", "SampleSpaceDescent", "SampledDescent", "Step",
    "above_rounding", "accelerator", "accepted", "cg_settings", "next_state", "right_hand_side",
    "second_difference", "take", "wanted",
]  # fmt: skip

logger = logging.getLogger("torch_sgn")

#: CG's iterations at least, and its relative residual, on a run of one batch whose forward
#: differentiates itself (:func:`cg_settings`).
ONE_BATCH_CG_ITERS = 100
ONE_BATCH_CG_RTOL = 1e-3
#: CG's absolute tolerance where ``cg_tol=None`` (the default) on float32 parameters: the
#: original's and the paper's ``CG_TOL``, near the rounding of a float32 loss's gradient.
CG_TOL = 1e-6


@dataclass(frozen=True)
class CGSettings:
    """A CG step's iterations, absolute and relative tolerances and preconditioner (the values
    of ``SGN``'s ``cg_iters``, ``cg_tol``, ``cg_rtol`` and ``preconditioner``)."""

    iters: int
    tol: float
    rtol: float
    preconditioner: object


def cg_settings(options: Options, step: int, one_batch: bool, dtype: torch.dtype) -> CGSettings:
    """The settings of a CG step ``step`` from SGN's ``options``: ``warmup_cg_iters``
    during the first ``warmup_steps``; ``cg_tol=None``: :data:`CG_TOL` for parameters of
    ``dtype`` float32 or narrower, off (0) for float64; on a run of one batch without an
    exact route (``solver="auto"``, :attr:`~torch_sgn.solve.descents.Phase.one_batch`) at least
    :data:`ONE_BATCH_CG_ITERS` iterations, the relative tolerance :data:`ONE_BATCH_CG_RTOL`
    where none is set, and the Nystrom preconditioner where none is set."""
    iters = options.cg_iters
    if options.warmup_cg_iters is not None and step < options.warmup_steps:
        iters = options.warmup_cg_iters
    tol = options.cg_tol
    if tol is None:
        tol = CG_TOL if torch.finfo(dtype).bits <= 32 else 0.0
    settings = CGSettings(iters, tol, options.cg_rtol, options.preconditioner)
    if not one_batch:
        return settings
    return CGSettings(
        max(iters, ONE_BATCH_CG_ITERS),
        settings.tol,
        settings.rtol or ONE_BATCH_CG_RTOL,
        settings.preconditioner or ("nystrom" if dtype == torch.float64 else False),
    )


@dataclass(frozen=True)
class Point:
    """What the core needs of the step's point beyond its linearization.

    Attributes:
        theta: the parameters, flat.
        loss_at: ``flat -> objective`` at other parameters on the step's batch, with its
            random numbers (the trust region's and the line search's trial points).
        accelerator: ``route -> accelerate`` for an exact route, where the geodesic
            acceleration is on (:func:`wanted`): how the term is
            formed at this point (the model's outputs at trial points, the loss's Hessian).
        sample: the weighted rows of a sample that precondition CG on every row (the route
            ``"sampled"``), else ``None``.
        search: the line search, where it is not :meth:`LineSearch.of` the options (the
            curve-fit steps stop backtracking at the loss's rounding).
        nystrom: the Nystrom preconditioner's cache (``preconditioner="nystrom"``).
    """

    theta: Tensor
    loss_at: Callable[[Tensor], float]
    accelerator: Callable[[str], Accelerate]
    sample: Optional[RowSample] = None
    search: Optional[LineSearch] = None
    nystrom: Optional[NystromCache] = None


@dataclass(frozen=True)
class Step:
    """A step the core took, not yet committed.

    Attributes:
        run: the outcome of its route (:class:`~torch_sgn.solve.step.Outcome`).
        exact: the route it could take exactly (``"cg"`` where only CG can run).
        phase: what it did (its route, and ``solver="auto"``'s probe and verdict).
        loss0: the objective at its start.
        momentum_buffer: the gradient's new moving average (``None`` without momentum).
        candidate: ``solver="auto"``'s probe point, judged at the next step (``None``: no
            probe, or its exact step did not move).
        evals: the objective's evaluations at trial points, the probe's included.
    """

    run: Outcome
    exact: str
    phase: Phase
    loss0: float
    momentum_buffer: Optional[Tensor]
    candidate: Optional[Tensor]
    evals: int

    @property
    def displacement(self) -> Optional[Tensor]:
        """The parameters' change, or ``None`` where the step does not move them."""
        run = self.run
        return run.trial.displacement(run.step_factor) if run.moved else None

    def info(self, grad_norm: float, lr: float, penalty: float = 0.0) -> StepInfo:
        """The :class:`StepInfo` of the step: ``grad_norm`` at its start, step length ``lr``
        and the weight decay's ``penalty`` in its loss."""
        run, loss0 = self.run, self.loss0
        trial, search, result = run.trial, run.search, run.trial.result
        return StepInfo(
            loss=loss0,
            loss_after=search.loss if run.moved else loss0,
            grad_norm=grad_norm,
            iterations=result.iterations,
            residual=trial.solution.residual_norm,
            stop_reason=result.reason,
            damping=run.damping,
            next_damping=run.next_damping,
            step_size=lr * run.step_factor,
            tr_ratio=run.ratio,
            predicted_change=trial.solution.predicted,
            loss_evals=self.evals,
            line_search_ok=search.success,
            attempts=run.attempts,
            solver="direct" if isinstance(result, DirectResult) else "cg",
            accelerated=run.moved and trial.curve is not None,
            taken=run.moved,
            uphill_resolves=run.resolves,
            penalty=penalty,
        )


def right_hand_side(
    grad: Tensor, state: StepState, options: Options
) -> Tuple[Tensor, Optional[Tensor]]:
    r"""``(m_hat, m)``: the right-hand side, the bias-corrected gradient average
    :math:`\hat m = m / (1 - \beta^{t+1})` of :math:`m \leftarrow \beta m + (1 - \beta) g`, and
    the new average ``m``; ``(grad, None)`` without momentum."""
    beta = options.gradient_averaging
    if beta == 0:
        return grad, None
    m = state.history.momentum_buffer
    m = (1 - beta) * grad if m is None else beta * m + (1 - beta) * grad
    return m / (1 - beta ** (state.step + 1)), m


def take(
    lin: Linearization,
    state: StepState,
    options: Options,
    phase: Phase,
    exact: str,
    rhs: Tuple[Tensor, Optional[Tensor]],
    loss0: float,
    point: Point,
) -> Step:
    """The step by ``phase``'s route: its damping attempts and line search; with
    ``solver="auto"``'s probe, the exact route's step too, its point the next step's candidate.
    Nothing is written.

    Args:
        lin: the linearization at ``point.theta``.
        state: the state the step starts from.
        options: SGN's options.
        phase: the route it takes (and the probe).
        exact: the route it could take exactly.
        rhs: :func:`right_hand_side`'s ``(m_hat, m)``.
        loss0: the objective at the point.
        point: how to evaluate at other points.
    """
    m_hat, buffer = rhs
    theta = point.theta

    def loss_at(displacement: Tensor, a: float = 1.0) -> float:
        value = point.loss_at(theta + displacement)
        logger.debug("  line search: a=%.4g loss=%.6g", a, value)
        return value

    problem = Problem(lin.grad, m_hat, loss0, loss_at)
    run = _solve(phase.route, lin, problem, state, options, point, phase.one_batch)
    candidate, evals = None, run.evals
    if phase.probe is not None:  # the exact step too, judged on the next batch
        probe = _solve(phase.probe, lin, problem, state, options, point)
        evals += probe.evals
        if probe.moved:
            candidate = theta + probe.trial.displacement(probe.step_factor)
    return Step(run, exact, phase, loss0, buffer, candidate, evals)


def _solve(
    route: str,
    lin: Linearization,
    problem: Problem,
    state: StepState,
    options: Options,
    point: Point,
    one_batch: bool = False,
) -> Outcome:
    """The step by ``route``: its descent's damping attempts and the line search."""
    descent = _descent(route, lin, problem.rhs, state, options, point, one_batch)
    if route == CG and options.step_rule == "quadratic":
        prev = state.history.prev_step
        descent = QuadraticDescent(descent, lin.ggn_vp, lin.grad, problem.rhs, prev)
    accelerate = None
    if route != CG and wanted(options.geodesic_acceleration, point.theta.dtype):
        accelerate = point.accelerator(route)
    rule = DampingRule.of(options, exact=route != CG)
    search = point.search if point.search is not None else LineSearch.of(options)
    return damped_step(descent, problem, state, rule, search, accelerate)


def _descent(
    route: str,
    lin: Linearization,
    rhs: Tensor,
    state: StepState,
    options: Options,
    point: Point,
    one_batch: bool,
) -> Descent:
    r"""``damping -> solution`` of :math:`(G + \rho I) d = -\hat m` for this step's
    linearization by ``route``: the step's attempts share it and differ only in the damping
    (the direct solver forms its matrix once and factors it for each)."""
    if route == SAMPLED:
        assert point.sample is not None
        return SampledDescent(lin.ggn_vp, rhs, SampledPreconditioner(point.sample))
    if route == SAMPLES:
        assert lin.sample_space is not None and rhs is lin.grad
        return SampleSpaceDescent(lin.sample_space, lin.grad, lin.ggn_vp)
    if route == MATRIX:
        return MatrixDescent(lin.ggn_matrix, rhs)
    cg = cg_settings(options, state.step, one_batch, rhs.dtype)
    x0 = None
    prev = state.history.prev_direction
    if options.warm_start > 0 and prev is not None:
        x0 = options.warm_start * prev
    kind = cg.preconditioner
    exponent = options.preconditioner_exponent if kind in (True, "diagonal") else None
    approx = None
    if kind == "nystrom":
        assert point.nystrom is not None
        rank, every = options.preconditioner_rank, options.preconditioner_every
        approx = point.nystrom.at(lin.ggn_vp, rhs, state.step, rank, every)
    return CGDescent(
        lin.ggn_vp, rhs, cg.iters, cg.tol, cg.rtol, options.cg_progress_tol, x0, exponent,
        approx,
    )  # fmt: skip


def next_state(state: StepState, step: Step, options: Options) -> StepState:
    """The state the next step starts from, after ``step`` (committed) from ``state``, with
    SGN's ``options``: the damping its trust region set and what the next solve reads of this
    one. ``solver="auto"``'s part and the rows' stages are their own owners'
    (:meth:`torch_sgn.route_plan.Router.advance`, :func:`torch_sgn.route_plan.advance_rows`)."""
    t, run = state.step, step.run
    growth = run.growth if options.damping_update == "nielsen" else state.damping.growth
    after = replace(state, step=t + 1, damping=DampingState(run.next_damping, growth))
    history = after.history
    if step.momentum_buffer is not None:
        history = replace(history, momentum_buffer=step.momentum_buffer)
    if options.warm_start > 0:
        history = replace(history, prev_direction=run.trial.result.x)
    if options.step_rule == "quadratic":
        moved = run.moved and not isinstance(run.trial.result, DirectResult)
        history = replace(history, prev_step=step.displacement if moved else None)
    return replace(after, history=history)


# --- the descents, one per route -----------------------------------------------------------
@dataclass(frozen=True)
class CGDescent:
    r"""Truncated CG on :math:`(G + \rho I) d = -\hat m` (the paper's Algorithm 2).

    Attributes:
        operator: ``v -> G v`` (a fresh tensor per product).
        rhs: :math:`\hat m`.
        max_iters, tol, rtol, progress_tol: CG's stopping rules
            (:func:`~torch_sgn.solve.cg.conjugate_gradient`).
        x0: the starting iterate (a warm start), or ``None`` for zero.
        preconditioner_exponent: the diagonal preconditioner
            :math:`(\hat m^2 + \rho)^{-\text{exponent}}`, or ``None`` for none.
        nystrom: a low-rank approximation of ``G`` whose preconditioner
            (:meth:`~torch_sgn.solve.nystrom.NystromApproximation.preconditioner`) CG uses at
            each damping, or ``None`` (not with ``preconditioner_exponent``).
    """

    operator: Callable[[Tensor], Tensor]
    rhs: Tensor
    max_iters: int
    tol: float
    rtol: float = 0.0
    progress_tol: float = 0.0
    x0: Optional[Tensor] = None
    preconditioner_exponent: Optional[float] = None
    nystrom: Optional[NystromApproximation] = None

    def __call__(self, damping: float) -> CGResult:
        rhs, operator = self.rhs, self.operator
        precond: Union[None, Tensor, Callable[[Tensor], Tensor]] = None
        if self.preconditioner_exponent is not None:
            precond = (rhs.square() + damping).pow(-self.preconditioner_exponent)
        elif self.nystrom is not None:
            precond = self.nystrom.preconditioner(damping)

        def damped(v: Tensor) -> Tensor:
            return operator(v).add_(v, alpha=damping)  # a product is a fresh tensor

        result = conjugate_gradient(
            damped, -rhs, max_iters=self.max_iters, tol=self.tol, rtol=self.rtol,
            progress_tol=self.progress_tol, x0=self.x0, preconditioner=precond,
        )  # fmt: skip
        return _warned(result)


@dataclass(frozen=True)
class SampledDescent:
    r"""CG on every row, preconditioned by a sample of them (:mod:`~torch_sgn.solve.sampled`),
    to the relative residual :data:`~torch_sgn.solve.sampled.RTOL` in at most
    :data:`~torch_sgn.solve.sampled.ITERATIONS` iterations. Its result carries ``again``, the
    same solve for another right-hand side (the geodesic acceleration's)."""

    operator: Callable[[Tensor], Tensor]
    rhs: Tensor
    preconditioner: SampledPreconditioner

    def __call__(self, damping: float) -> CGResult:
        operator, precond = self.operator, self.preconditioner.preconditioner(damping)

        def damped(v: Tensor) -> Tensor:
            return operator(v).add_(v, alpha=damping)  # a product is a fresh tensor

        def solve(b: Tensor) -> CGResult:
            return conjugate_gradient(
                damped, b, max_iters=sampled.ITERATIONS, rtol=sampled.RTOL,
                preconditioner=precond,
            )  # fmt: skip

        result = _warned(solve(-self.rhs))
        if result.breakdown:
            return result
        return replace(result, again=lambda b: solve(-b).x)


def _warned(result: CGResult) -> CGResult:
    """``result``, with a warning where CG broke down."""
    if result.breakdown:
        logger.warning(
            "CG stopped early (%s) after %d iterations; using its last good iterate",
            result.reason, result.iterations,
        )  # fmt: skip
    return result


@dataclass(frozen=True)
class MatrixDescent:
    """Exactly, through ``G`` formed once (by ``matrix()``, which caches it) and factored at each
    damping, in float64."""

    matrix: Callable[[], Tensor]
    rhs: Tensor

    def __call__(self, damping: float) -> DirectResult:
        return _logged(direct.solve_damped(self.matrix(), self.rhs, damping), damping)


@dataclass(frozen=True)
class SampleSpaceDescent:
    """Exactly, through the ``R x R`` matrix ``J J^T`` of the batch's outputs (fewer than the
    parameters). The right-hand side must be the gradient ``J^T g_out`` itself (no momentum;
    with a weight decay, ``J^T g_out + lambda theta``, whose second term the space solves for):
    the route solves in output space."""

    space: SampleSpace
    rhs: Tensor
    operator: Callable[[Tensor], Tensor]

    def __call__(self, damping: float) -> DirectResult:
        result = direct.solve_in_sample_space(self.space, self.rhs, damping, self.operator)
        return _logged(result, damping)


def _logged(result: DirectResult, damping: float) -> DirectResult:
    if result.reason not in ("cholesky", "lu"):  # an indefinite G, or rounding
        logger.debug(
            "  the direct solve's factorization failed at damping %.3g; solved by the %s "
            "fallback",
            damping, result.reason,
        )  # fmt: skip
    return result


# --- the geodesic acceleration (see the module's docstring) -------------------------------
#: The largest ``2 |a| / |v|`` for which the acceleration is used (Transtrum and Sethna's
#: :math:`\alpha`).
RATIO = 0.75

#: The central difference's step along ``v`` (theirs: 0.1).
STEP = 0.1

#: The second difference is used only where it exceeds this many units of rounding of the
#: outputs (``eps`` times their size).
NOISE = 100.0


def wanted(option: Union[None, bool, str], dtype: torch.dtype) -> bool:
    """Whether exact steps take the acceleration under SGN's ``geodesic_acceleration`` option:
    ``None`` (the default) for float64 parameters only, otherwise as set (``"strict"``: on)."""
    return dtype == torch.float64 if option is None else bool(option)


def second_difference(
    outputs_at: Callable[[Tensor], Tensor],
    theta: Tensor,
    v: Tensor,
    centre: Tensor,
    h: float = STEP,
    jvp: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Tensor, Tensor]:
    r""":math:`f_{vv} \approx (f(\theta + h v) - 2 f(\theta) + f(\theta - h v)) / h^2`, or with
    ``jvp`` :math:`2 (f(\theta + h v) - f(\theta) - h J v) / h^2`, and what
    :func:`above_rounding` judges it by.

    Args:
        outputs_at: ``flat -> f(flat)``, the outputs on the step's batch.
        theta: the point.
        v: the direction.
        centre: ``outputs_at(theta)``, computed by the same function (so that the difference
            cancels exactly where ``f`` is linear along ``v``).
        h: the step of the difference.
        jvp: ``v -> J v`` at ``theta`` (outputs-shaped), for the one-sided difference; ``None``:
            the central one.

    Returns:
        ``f_vv`` and the squared norms of the difference and of the three terms it sums (in
        float64; a sum over the samples, so shards of a batch add theirs up).
    """
    plus = outputs_at(theta + h * v)
    if jvp is None:
        other = outputs_at(theta - h * v)
        difference = plus - 2 * centre + other
    else:  # half the difference, whose terms' rounding above_rounding weighs alike
        other = h * jvp(v)
        difference = plus - centre - other
    terms = torch.stack([difference, plus, centre, other]).double()
    norms = terms.square().reshape(4, -1).sum(dim=1)
    if jvp is None:
        return difference / (h * h), norms
    return difference * (2.0 / (h * h)), norms


def above_rounding(norms: Tensor, dtype: torch.dtype) -> bool:
    """Whether the second difference (squared norms from :func:`second_difference`) is finite
    and above :data:`NOISE` units of the outputs' rounding in ``dtype``: else it says nothing
    about the curvature (outputs linear along the step, or float32 near a precise fit)."""
    size, plus, centre, other = norms.sqrt().tolist()
    scale = plus + 2 * centre + other
    if not (size == size and scale < float("inf")):  # NaN or overflow
        return False
    return size > NOISE * torch.finfo(dtype).eps * scale


def accepted(v: Tensor, a: Tensor) -> Optional[Tensor]:
    r"""``a`` where it is finite and :math:`2\lVert a \rVert \le` :data:`RATIO`
    :math:`\lVert v \rVert`, else ``None``."""
    size, step = torch.stack([torch.linalg.vector_norm(a), torch.linalg.vector_norm(v)]).tolist()
    if not size == size or not 2 * size <= RATIO * step:  # NaN fails both
        return None
    return a


def accelerator(
    theta: Tensor,
    outputs_at: Callable[[Tensor], Tensor],
    hessian_at: Callable[[Tensor], Callable[[Tensor], Tensor]],
    vjp: Optional[Callable[[Tensor], Tensor]],
    share: Callable[..., tuple[Tensor, Tensor]],
    size: int,
    scale: float,
    mask: Optional[Tensor] = None,
    centre: Optional[Tensor] = None,
    jvp: Optional[Callable[[Tensor], Tensor]] = None,
) -> Callable[[DirectResult], Union[Tensor, TooLarge, None]]:
    r"""``result -> scale * a``, the acceleration's term of one exact solve of the step at
    ``theta`` (``None`` where it is not used: no factorization to solve again, a breakdown or a
    difference within rounding; :data:`TOO_LARGE` where ``a`` fails :func:`accepted`).

    Args:
        theta: the point.
        outputs_at: ``flat -> outputs`` on the step's batch, with the step's random numbers.
        hessian_at: ``outputs -> (t -> H t)``, the loss's Hessian in output space.
        vjp: output-shaped ``u -> J^T u`` at ``theta``; ``None`` where the solve takes its
            right-hand side in output space (through the batch's outputs).
        share: ``(compute, sizes, what) -> (mean, sum)``, the data-parallel communicator's
            reduction of each rank's ``J^T H f_vv`` and norms
            (:meth:`~torch_sgn.distributed.SingleProcess.shares`).
        size: the length of the right-hand side (``P``, or the batch's outputs ``R``).
        scale: ``lr^2 / 2``: the term enters the step as ``s d + s^2 scale a``.
        mask: 1 at the parameters still trainable (``None``: all are).
        centre: ``outputs_at(theta)`` where the caller has it (equal to it bit for bit), else
            ``None``: computed at the first use, and shared by the step's attempts.
        jvp: ``v -> J v`` at ``theta``, where the caller has ``J``: the one-sided difference
            (one evaluation instead of two).
    """

    def curve(result: DirectResult) -> Union[Tensor, TooLarge, None]:
        if result.again is None or result.breakdown:
            return None
        v = result.x

        def local() -> tuple[Tensor, Tensor]:  # (J^T) H f_vv and the rounding's norms
            nonlocal centre
            if centre is None:
                centre = outputs_at(theta)
            fvv, norms = second_difference(outputs_at, theta, v, centre, jvp=jvp)
            hf = hessian_at(centre)(fvv)
            if vjp is None:
                return hf, norms
            b = vjp(hf)
            return (b if mask is None else b * mask), norms

        b, norms = share(local, (size, 4), "the geodesic acceleration")
        if not above_rounding(norms, theta.dtype):
            return None
        a = accepted(v, result.again(b))
        return TOO_LARGE if a is None else a.mul_(scale)

    return curve
