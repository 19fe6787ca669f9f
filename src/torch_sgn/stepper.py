"""SGN's step on a model and a loss, without :class:`torch.optim.Optimizer`'s bookkeeping.

:class:`Stepper` holds what a step needs besides its options and state (the model as a
function of a flat vector, the loss, the engine, the route decisions, the communicator) and
runs it in two halves: :meth:`Stepper.prepare` (the guards, the rows, the linearization, the
check of the loss) and :meth:`Stepper.finish` (the route, the core, the commit, the report);
and the checks of a step's batch (:func:`check_batch`) and of the loss and gradient at its
point (:func:`finite_loss`), with errors that say what to do.
:class:`~torch_sgn.SGN` runs both halves in one call; :func:`~torch_sgn.least_squares` builds a
stepper, not an ``SGN``, for a :class:`~torch_sgn.pinn.Residuals` problem and reads each point's
gradient from the prepared step (its ``gtol`` test) before it finishes it, so that the point is
evaluated once. The walk through the files is written in :mod:`torch_sgn.solve.core`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from . import route_plan
from .diagnostics import warn
from .distributed import DataParallel, SingleProcess
from .engines.functional import with_jacobian
from .engines.selection import curvature_subset, select_engine
from .linearization import Batch, Engine, Linearization, check_loss_parameters, weight_penalty
from .losses import OutputLoss
from .model.flat_model import FunctionalModel, Inputs
from .options import Options, Setup
from .residual_problem import ResidualProblem
from .route_plan import (
    NESTED_NOTICE,
    Capabilities,
    Plan,
    Router,
    Rows,
    RowStages,
    through_outputs,
)
from .solve import core, direct
from .solve.descents import SAMPLED, SAMPLES, Accelerate
from .solve.nystrom import NystromCache
from .solve.state import StepState
from .step_info import StepInfo

__all__ = [
    "NOT_A_CLOSURE", "Prepared", "Stepper", "all_finite", "check_batch", "finite_loss", "log_step",
]  # fmt: skip

logger = logging.getLogger("torch_sgn")


class Abandoned(Exception):
    """Why a prepared step's random-state guard closes without a step (nothing was taken)."""


@dataclass
class Prepared:
    """A step up to its linearization, checked: nothing written yet.

    Attributes:
        lin: the linearization the step is taken from (restricted to the trainable parameters
            where some were frozen since the optimizer was built).
        loss: the objective at the point on the step's batch.
        grad_norm: its gradient's 2-norm.
        unrestricted: the linearization before that restriction (its ``grad`` is the whole
            gradient, with the weight decay's term).
        plan: the rows' plan so far (:class:`~torch_sgn.route_plan.Plan`); ``plan.rows`` is
            ``None`` where the step is taken on all of the batch's rows.
    """

    lin: Linearization
    loss: float
    grad_norm: float
    unrestricted: Linearization
    plan: Plan
    # what finish needs besides
    options: Options
    batch: Batch
    inputs: Inputs
    stored: dict
    state: StepState
    work: StepState
    theta: Tensor
    buffers: dict
    trainable: Optional[Tensor]
    rows: Rows
    guard: contextlib.ExitStack

    def abandon(self) -> None:
        """Closes the step without taking it: the random state goes back to where it was
        before :meth:`Stepper.prepare`; the model and the state are untouched."""
        self.guard.__exit__(Abandoned, Abandoned(), None)


class Stepper:
    """SGN's step on ``fmodel`` and ``loss``, in two halves.

    Args:
        fmodel: the model as a function of a flat vector of its parameters.
        loss: the loss in output space.
        comm: the data-parallel communicator (:class:`~torch_sgn.distributed.SingleProcess`
            for one process).
        setup: the settings fixed when the optimizer was built.
        options: the options the step starts with (checked against ``setup`` here).

    The engine (how ``G v`` is computed) is the one ``setup`` asks for
    (:func:`~torch_sgn.engines.selection.select_engine`), in :attr:`engine`.

    Raises:
        ValueError: ``cuda_graphs=True`` in a data-parallel group of several processes,
            ``curvature_fraction < 1`` on a residual problem, or ``solver="direct"``
            where the ``P x P`` matrices do not fit in the device's free memory (and the steps
            cannot go through the batch's outputs).
    """

    def __init__(
        self,
        fmodel: FunctionalModel,
        loss: OutputLoss,
        comm: Union[SingleProcess, DataParallel],
        setup: Setup,
        options: Options,
    ):
        self.fmodel, self.loss, self.comm, self.setup = fmodel, loss, comm, setup
        self.options = options  # the options of the step in progress
        single = isinstance(comm, SingleProcess)
        if setup.cuda_graphs and not single:
            raise ValueError(
                "cuda_graphs=True is not supported in a data-parallel group of several "
                "processes (shards may differ in shape); leave it off there"
            )
        rows = route_plan.forms_rows(setup, single)  # a residual problem's, for exact steps
        self.engine: Engine = select_engine(
            fmodel, loss, setup.engine, setup.cuda_graphs, setup.compile, rows
        )
        self.caps = Capabilities.of(fmodel.model, self.engine, single)
        if setup.curvature_fraction < 1 and self.caps.residual_problem:
            raise ValueError(
                f"curvature_fraction={setup.curvature_fraction}: a Residuals problem's points "
                "belong to its blocks, not to one batch of samples to draw a subset from; use "
                "curvature_fraction=1 (exact steps form G from every residual)"
            )
        self.router = Router(self.caps, setup, fmodel)  # the route decisions
        self.stages = RowStages(fmodel.model, setup.direct_max_params)  # of many rows
        self.nystrom = NystromCache()  # CG's preconditioner="nystrom"
        self.nested_warned = False  # the notice of route_plan.NESTED_NOTICE given
        if setup.solver == "direct" and not through_outputs(self.caps, setup, options):
            # before anything of the matrix's size is allocated
            direct.check_direct_fits(fmodel.numel, torch.float64, fmodel.device)

    # --- the two halves ----------------------------------------------------------------------
    def step(self, options: Options, inputs: Inputs, targets: Tensor, stored: dict) -> StepInfo:
        """One step on the batch ``(inputs, targets)`` from the state ``stored`` (the state
        dict's entries, written back): :meth:`prepare`, then :meth:`finish`."""
        return self.finish(self.prepare(options, inputs, targets, stored))

    def prepare(self, options: Options, inputs: Inputs, targets: Tensor, stored: dict) -> Prepared:
        """The step up to its checked linearization (the loss, its gradient, ``v -> G v``).

        Raises (nothing changed): ``ValueError`` for a batch that does not fit the loss,
        ``FloatingPointError`` for a loss or gradient that is not finite."""
        self.options = options
        check_batch(inputs, targets)
        batch = Batch(inputs, targets)
        state, theta, buffers = StepState.of(stored), self.fmodel.flat(), {}
        # Plan the rows: more than an exact step takes go by samples of them, then all.
        fm = self.fmodel
        plan = self.router.start(options, batch, state)
        rows = self.stages.rows(plan.rows, batch, state)
        batch = rows.batch
        trainable = fm.trainable_mask()
        fm.warn_unfrozen()
        guard = contextlib.ExitStack()
        guard.enter_context(fm.consistent())
        try:
            # Linearize: the loss, its gradient and v -> G v at theta on the batch.
            lin, plan = self._linearize(plan, rows, state.step, theta, buffers)
            unrestricted, work = lin, state  # what the direction is computed from
            if trainable is not None:  # restricted to the parameters still trainable
                lin, work = lin.restricted(trainable), state.restricted(trainable)
            # Check: a finite loss and gradient, else raise with nothing changed.
            loss0, grad_norm = finite_loss(lin, batch, self.loss, self.router.problem)
        except BaseException as e:  # the random state back where it was, then raise
            guard.__exit__(type(e), e, e.__traceback__)
            raise
        return Prepared(
            lin=lin, loss=loss0, grad_norm=grad_norm, unrestricted=unrestricted, plan=plan,
            options=options, batch=batch, inputs=inputs, stored=stored, state=state,
            work=work, theta=theta, buffers=buffers, trainable=trainable, rows=rows,
            guard=guard,
        )  # fmt: skip

    def finish(self, p: Prepared) -> StepInfo:
        """The prepared step's route, the core's step, the commit and the report."""
        options, lin, batch, state, theta = p.options, p.lin, p.batch, p.state, p.theta
        with p.guard:
            # Choose the route: the right-hand side, the descent that may solve exactly, and
            # for solver="auto" whether this step takes it (or probes it).
            rhs = core.right_hand_side(lin.grad, p.work, options)
            loss_at = functools.partial(self._loss_at, lin, batch=batch)
            plan = self.router.route(p.plan, options, lin, rhs[0], batch, state, p.loss, loss_at)
            logger.debug("step %d: %s", state.step, plan)
            if plan.phase.one_batch and not self.nested_warned:
                self.nested_warned = True
                warn(NESTED_NOTICE)
            # Solve with damping attempts, then the line search (nothing written).
            point = self._point(lin, theta, batch, loss_at, p.trainable, state.step, plan.route)
            taken = core.take(lin, p.work, options, plan.phase, plan.exact, rhs, p.loss, point)
        # Commit: nothing above has touched the model or the optimizer's state.
        fm = self.fmodel
        if taken.run.moved:
            fm.write(theta + taken.displacement)
        fm.write_buffers(p.buffers)
        if options.keep_grad:
            fm.write_grad(lin.grad)
        after = core.next_state(state, taken, options)  # the damping, the history
        auto = self.router.advance(state, plan, p.loss, taken.candidate)  # solver="auto"'s
        after = replace(after, auto=auto)
        rows, sample = self.stages.advance(  # the rows' stages advance their own part
            p.rows, after.rows, state.step, p.loss, p.inputs, point.sample
        )
        after = replace(after, rows=rows)
        after.write(p.stored)
        # Report.
        decay = options.weight_decay
        penalty = weight_penalty(theta, decay) if decay else 0.0
        info = replace(
            taken.info(p.grad_norm, options.lr, float(penalty)), plan=plan, sample=sample
        )
        log_step(state.step, info)
        return info

    # --- the step's phases -------------------------------------------------------------------
    def _linearize(
        self, plan: Plan, rows: Rows, t: int, theta: Tensor, buffers: dict
    ) -> tuple[Linearization, Plan]:
        """The model and loss linearized at ``theta`` on the batch (reduced over a data-parallel
        group) by the engine (a residual problem's rows engine forms its rows, and on all of too
        many rows linearizes from the layers' factors where ``plan`` says so,
        :func:`torch_sgn.route_plan.row_stage`), with a row-batched Jacobian where exact steps on
        another model take it, and the weight decay's penalty; and the plan with how ``J`` was
        formed."""
        fm, batch = self.fmodel, rows.batch
        lin = self.stages.linearized(self.engine, theta, rows)
        lin = lin or self.comm.linearize(t, self.engine_for(t), theta, batch, buffers)
        check_loss_parameters(self.loss, fm, lin, theta, batch)
        if self.router.row_by_row(lin, theta, batch):
            lin = with_jacobian(lin, fm, self.loss, theta, batch)
        plan = route_plan.with_jacobian(plan, lin)
        # The L2 penalty, added once here: after the data-parallel reduction (every rank holds
        # the same theta) and before the mask of frozen parameters (which keeps them still).
        return lin.regularized(self.options.weight_decay, theta), plan

    def _point(
        self,
        lin: Linearization,
        theta: Tensor,
        batch: Batch,
        loss_at: Callable[[Tensor], float],
        mask: Optional[Tensor],
        t: int,
        route: str,
    ) -> core.Point:
        """How the step core evaluates at other points of this step's batch: the objective
        (``loss_at``), and the geodesic acceleration's outputs; on all of too many rows, the
        sample that preconditions CG."""
        sample = lin.rows(t) if route == SAMPLED and lin.rows else None
        return core.Point(
            theta=theta,
            loss_at=loss_at,
            accelerator=lambda route: self._accelerator(lin, batch, theta, route, mask),
            sample=sample,
            nystrom=self.nystrom,
        )

    def _accelerator(
        self,
        lin: Linearization,
        batch: Batch,
        theta: Tensor,
        route: str,
        mask: Optional[Tensor],
    ) -> Accelerate:
        r"""``solution -> (lr^2 / 2) a``, the geodesic acceleration's term of an exact step
        by ``route`` (:func:`torch_sgn.solve.core.accelerator`).

        In a data-parallel group each rank differences its shard's outputs and the shards'
        ``J^T H f_vv`` are reduced as the gradient is, so every rank takes the same step."""
        outputs_at = lin.outputs_at
        if outputs_at is None:
            outputs_at = lambda flat: self.fmodel(flat, batch.inputs)  # noqa: E731
        # Through the outputs the system takes its right-hand side in output space.
        samples = route == SAMPLES
        vjp = None
        if not samples:
            vjp = lin.vjp if lin.vjp is not None else self.fmodel.vjp_at(theta, batch.inputs)
        return core.accelerator(
            theta, outputs_at, lambda centre: self.loss.hessian(centre, batch.targets), vjp,
            self.comm.shares, lin.sample_space.size if samples else theta.numel(),
            0.5 * self.options.lr**2, mask,
        )  # fmt: skip

    # --- helpers -----------------------------------------------------------------------------
    def engine_for(self, t: int) -> Engine:
        """The engine for step ``t``: the curvature subset is drawn from a generator seeded
        with ``t``, so a resumed run, or a step retried after a failure, draws the same one."""
        fraction = self.setup.curvature_fraction
        if fraction < 1:
            return curvature_subset(self.engine, self.loss, fraction, seed=t)
        return self.engine

    def _loss_at(self, lin: Linearization, flat: Tensor, batch: Batch) -> float:
        """The objective at ``flat`` on the batch: the loss, and the weight decay's penalty
        (in ``lin.value_at`` where the engine has one)."""
        if lin.value_at is not None:
            return self.comm.loss_value(lambda: lin.value_at(flat))
        weight_decay = self.options.weight_decay

        def value() -> Tensor:
            value = self.loss.value(self.fmodel(flat, batch.inputs), batch.targets)
            return value + weight_penalty(flat, weight_decay) if weight_decay else value

        return self.comm.loss_value(value)


# --- the report ----------------------------------------------------------------------------
def log_step(t: int, info: StepInfo) -> None:
    """Step ``t`` on the ``torch_sgn`` logger: its outcome at INFO, its solve at DEBUG."""
    uphill = ""
    if info.uphill_resolves:
        uphill = f" (uphill: solved again {info.uphill_resolves} times"
        uphill += ")" if info.taken else ", not taken)"
    logger.info(
        "step %d: loss %.6g -> %.6g, damping %.3g, step %.3g%s",
        t, info.loss, info.loss_after, info.damping, info.step_size, uphill,
    )  # fmt: skip
    logger.debug(
        "  |g| %.4g, %s %d it (%s), |r| %.3g, ratio %s, %d loss evals%s",
        info.grad_norm, "CG" if info.solver == "cg" else "direct", info.iterations,
        info.stop_reason, info.residual,
        "-" if info.tr_ratio is None else f"{info.tr_ratio:.3g}", info.loss_evals,
        "" if info.sample is None else f", sample {info.sample}",
    )  # fmt: skip


# --- the checks of a step's batch, and of the loss and gradient at its point -------------
#: Why a step refuses a closure in place of its batch (``SGN.step`` says it first, with
#: PyTorch Lightning's way out where a Lightning closure was passed).
NOT_A_CLOSURE = (
    "SGN.step takes the mini-batch, opt.step(inputs, targets), not a closure: SGN needs the "
    "model's outputs and the targets, not only the loss a closure returns, to form the "
    "Gauss-Newton matrix J^T H J, and runs the forward passes itself"
)


def finite_loss(
    lin: Linearization,
    batch: Batch,
    loss_fn: OutputLoss,
    problem: Optional[ResidualProblem] = None,
) -> tuple[float, float]:
    """The loss and the gradient's norm (one host transfer); raises unless both are finite.

    The batch is scanned for NaN and infinite values only then, to name the cause: a
    non-finite entry that reaches the loss or the gradient is found without a pass over the
    batch in every step (on a distributed step, every rank sees the reduced values, so all
    raise together). On a residual problem (``problem``) the blocks and points whose residuals
    are not finite are named.
    """
    norm = torch.linalg.vector_norm(lin.grad).to(lin.loss.dtype)
    loss, grad_norm = torch.stack([lin.loss.reshape(()), norm]).tolist()
    # A norm that overflows on finite entries is settled by the exact test.
    finite = math.isfinite(loss) and (
        math.isfinite(grad_norm) or bool(torch.isfinite(lin.grad).all())
    )
    if not finite:
        _check_finite_batch(batch.inputs, batch.targets)
        _check_counted_targets(batch.targets, loss_fn)
    if not math.isfinite(loss):
        where = None if problem is None else problem.non_finite(batch.args)
        raise FloatingPointError(
            f"the loss is {loss} at the current parameters on this batch"
            + (f": the residuals are not finite in {where}" if where else "")
            + "; the parameters were not changed. Check the data and the model's output (e.g. "
            "lower the learning rate of an earlier optimizer, or raise `damping`)"
        )
    if not finite:
        raise FloatingPointError(
            "the gradient has non-finite entries at the current parameters; the parameters "
            "were not changed"
        )
    return loss, grad_norm


def check_batch(inputs: Inputs, targets: Optional[Tensor]) -> None:
    """Raises ``TypeError`` unless the batch is a tensor (or a tuple of tensors) and targets."""
    if targets is None:
        if callable(inputs):
            raise TypeError(NOT_A_CLOSURE)
        raise TypeError("SGN.step(inputs, targets) needs the targets of the batch")
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    for i, x in enumerate(items):
        if not isinstance(x, Tensor):
            raise TypeError(
                f"inputs must be a tensor or a tuple of tensors; item {i} is {type(x).__name__}"
            )
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")


def _check_counted_targets(targets: Tensor, loss: OutputLoss) -> None:
    """Raises ``ValueError`` if the batch has no target that a mean of the loss counts."""
    if targets.numel() == 0:
        raise ValueError(
            f"the batch is empty (targets of shape {tuple(targets.shape)}): the mean loss of no "
            "samples is NaN; skip empty batches"
        )
    if loss.reduction == "mean" and loss.normalizer(targets) == 0:
        raise ValueError(
            f"no target of this batch counts toward the mean {loss.name} loss (each one is "
            "ignore_index, or of a class of weight 0), so the mean is 0 / 0: skip such "
            "batches, or use reduction='sum'"
        )


def _check_finite_batch(inputs: Inputs, targets: Tensor) -> None:
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    for i, x in enumerate(items):
        if x.is_floating_point() and not all_finite(x):
            where = "inputs" if not isinstance(inputs, tuple) else f"inputs[{i}]"
            raise ValueError(f"{where} contain NaN or infinite values; clean the batch first")
    if targets.is_floating_point() and not all_finite(targets):
        raise ValueError("targets contain NaN or infinite values; clean the batch first")


def all_finite(x: Tensor) -> bool:
    """Whether every entry is finite, without temporaries the size of ``x``.

    ``isfinite(x)`` allocates about twice the batch in temporaries, more than the rest of a
    step on an input-heavy model; one sum is finite exactly when no entry is NaN or infinite,
    unless finite entries overflow it, and then the exact test decides.
    """
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())
