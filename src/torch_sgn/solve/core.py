r"""The step core: one SGN step from a linearization, its next state and its report.

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
(``scripts/step_walk.py`` measures it: 16 files besides the problem's own evaluation):
``optimizer.py`` (the call, its options read and checked by ``options.py``) -> ``stepper.py``
(the step's recipe: the batch's checks, the state from ``solve/state.py``) ->
``route_plan.py`` (the rows: the batch's, or a sample's; the problem read through its
protocol; ``batch.py``'s mini-batch) -> the linearization (``distributed.py``'s communicator,
``linearization.py``; ``engines/rows.py``, the problem's engine: the loss and gradient by
``engines/functional.py`` and ``losses.py``, ``J``'s rows and ``G v`` from them) ->
``route_plan.py`` (the route, ``solver="auto"``'s phase) -> this module (the descent:
``solve/descents.py``, ``solve/direct.py``; the damped step, its damping rules and line search:
``solve/step.py``; the geodesic acceleration: ``solve/geodesic.py``) -> ``stepper.py`` (the
commit, this module's :func:`next_state`, ``route_plan.py``'s parts of the state, the report).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from ..linearization import Linearization, RowSample
from ..step_info import StepInfo
from . import geodesic, sampled
from .descents import (
    CG,
    MATRIX,
    SAMPLED,
    SAMPLES,
    CGDescent,
    Descent,
    MatrixDescent,
    Phase,
    Result,
    SampledDescent,
    SampleSpaceDescent,
)
from .direct import DirectResult
from .nystrom import NystromCache
from .quadratic import QuadraticDescent
from .state import DampingState, StepState
from .step import DampingRule, LineSearch, Outcome, Problem, damped_step

if TYPE_CHECKING:
    from ..options import Options

__all__ = [
    "CG_TOL", "ONE_BATCH_CG_ITERS", "ONE_BATCH_CG_RTOL", "Accelerate", "CGSettings", "Point",
    "Step", "cg_settings", "next_state", "right_hand_side", "take",
]  # fmt: skip

logger = logging.getLogger("torch_sgn")

#: ``result -> (lr^2 / 2) a``: the geodesic acceleration's term of an exact solve
#: (:func:`torch_sgn.solve.geodesic.accelerator`).
Accelerate = Callable[[Result], Union[Tensor, geodesic.TooLarge, None]]


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
            acceleration is on (:func:`~torch_sgn.solve.geodesic.wanted`): how the term is
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
    if route != CG and geodesic.wanted(options.geodesic_acceleration, point.theta.dtype):
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
        return SampledDescent(lin.ggn_vp, rhs, sampled.SampledPreconditioner(point.sample))
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
