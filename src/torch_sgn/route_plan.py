"""Which way a step goes, decided in one place: the step's :class:`Plan`, the stages of a
problem of many rows and ``solver="auto"``'s switch.

What the model and its engine offer an exact step is declared once, in :class:`Capabilities`.
From it, SGN's :class:`~torch_sgn.options.Setup` and the step's
:class:`~torch_sgn.options.Options`, this module makes each step's :class:`Plan`: which rows
it uses, how its ``J`` is formed, the exact route it could take and the route it takes (with
``solver="auto"``'s probe). The plan is filled in the order the step learns what each answer
needs, one field per function, each taking the plan so far and returning it completed:

1. :func:`start`: the rows (the batch's, a sample of them, or all of too many rows:
   :func:`row_stage`, below);
2. :func:`with_jacobian`: how ``J`` is formed, as the linearization on those rows says
   (:attr:`~torch_sgn.linearization.Linearization.jacobian`: by the engine's products, row by
   row, or on all of too many rows by the layers' factors); on a model that is not a residual
   problem, :meth:`Router.row_by_row` says whether the step forms its rows
   (:func:`~torch_sgn.engines.functional.with_jacobian`);
3. :meth:`Router.route`: the exact route (:func:`choose_route`) and, for ``solver="auto"``, the
   phase (:func:`auto_phase`: CG, a probe, a verdict).

:class:`Router` holds one optimizer's share of these decisions: its :class:`Capabilities`, its
settings, and what the rules remember between steps (whether the model is per-sample on each
batch shape, the last step's inputs). The least-squares driver's gate
(:func:`curve_steps_allowed`) is the same rules, read from here. The route cannot be chosen
before the linearization: whether a dense ``G`` or the batch's sample space is on offer is
known once the engine has recorded the model on the batch.

**Many rows.** A residual problem (:class:`torch_sgn.pinn.Residuals`, zero targets) whose
residuals ``R`` and parameters ``P`` both exceed ``SGN(direct_max_params)`` fits neither the
``R x R`` Gram matrix nor the ``P x P`` matrix of an exact step; one with more than
``direct_max_params`` rows and at least :data:`~torch_sgn.solve.sampled.ROWS_PER_PARAMETER`
rows per parameter fits the ``P x P`` matrix, but forming it from every row costs ``R P^2``.
``solver="auto"`` takes both in stages (:func:`row_stage`):

1. :data:`SAMPLE`: exact steps on a sample of the points
   (:data:`~torch_sgn.solve.sampled.POINTS` at first, never more rows than
   ``direct_max_params``), drawn anew at each step by a generator seeded with the step, every
   block keeping its share (:mod:`torch_sgn.solve.sampled`). Each step's loss, on a fresh
   sample, estimates the whole loss without bias.
2. When those losses stall (:data:`SAMPLE_STALL`: the steps ride their samples' noise), the
   sample doubles, up to ``direct_max_params`` rows: a larger sample, less noise.
3. :data:`ALL`: when the largest sample stalls too, and the factors of every row fit in memory
   (:func:`all_rows_fit`), conjugate gradient on every row, preconditioned by a sample's
   Gauss-Newton matrix: the steps converge to the minimizer of the whole problem, not to a
   neighbourhood of it.

:class:`RowStages` is the part a stepper holds: the step's :class:`Rows` (drawn at its start),
an ``ALL`` step's linearization, and after the step the part's state
(:class:`~torch_sgn.solve.state.RowsState`: the stalls so far, the stall test's losses;
:func:`advance_rows`) and the points it used.

**solver="auto"** starts with the paper's CG steps and switches for good to exact steps when
either test says they do better (``docs/SOLVERS.md``: early on a noisy mini-batch the truncated
CG step moves along the few directions of largest curvature, where an exact step with a small
damping also fits the batch's noise; exact steps fit a precise target orders of magnitude
sooner). A run that fits one batch, where there is no noise to fit, takes exact steps at once.

- **probe**: every :data:`PROBE_EVERY` steps (from the first) the step's exact solution is
  computed as well (its own damping attempts and line search on the batch), and the point it
  reaches is kept as a candidate. The next step evaluates the candidate on its own batch, which
  neither step was fitted to, and compares it with the loss at the point the CG step reached:
  the exact step wins when its loss is lower by at least the share :data:`MARGIN`, and that
  step already runs exact.
- **stall**: the batch losses of its CG steps stall (:data:`CG_STALL`: CG's plateau).

A run that fits one batch with a model whose ``forward`` differentiates its own output by
``torch.autograd.grad``, where no engine forms the Jacobian cheaply, keeps CG, solved further
(:func:`~torch_sgn.solve.core.cg_settings`), and SGN says once (:data:`NESTED_NOTICE`) that
the same problem written with :mod:`torch_sgn.pinn` takes exact steps. Its state
(:class:`~torch_sgn.solve.state.AutoState`) is advanced by :func:`advance_auto`; a
data-parallel group decides alike on every rank: the losses compared are reduced.

Every state of these rules is saved with the optimizer's state dict, so a resumed run takes the
same steps; and every rule is on sizes, memory, what the engine offers and the losses, never on
timings, so that a run takes the same steps on every machine.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .engines.functional import PerSample, RowsEngine
from .linearization import Batch, Linearization, RowSample
from .model.flat_model import FunctionalModel
from .options import Options, Setup
from .residual_problem import ResidualProblem, residual_problem
from .solve import direct, sampled
from .solve.descents import CG, MATRIX, SAMPLED, SAMPLES, Phase
from .solve.direct import available_memory
from .solve.state import AutoState, RowsState, StepState

__all__ = [
    "ALL", "CG_STALL", "MARGIN", "NESTED_NOTICE", "PROBE_EVERY", "SAMPLE", "SAMPLE_STALL",
    "BatchMemory", "Capabilities", "Plan", "Router", "RowStages", "Rows", "StallTest",
    "advance_auto", "advance_rows", "all_rows_fit", "auto_phase", "choose_route",
    "curve_steps_allowed", "exact_allowed", "exact_wins", "fits", "fits_one_batch",
    "forms_jacobian", "forms_rows", "matrix_fits", "points_used", "row_stage", "sample_points",
    "sampled_batch", "samples_fit", "start", "through_outputs", "with_jacobian",
]  # fmt: skip

logger = logging.getLogger("torch_sgn")


@dataclass(frozen=True)
class StallTest:
    """The losses stall when the mean of the last ``window`` fell by less than ``share`` (of
    its size) below the mean of the ``window`` before.

    Attributes:
        window: the losses in each of the two windows compared.
        share: the relative fall of the windows' mean above which the losses have not stalled.
    """

    window: int
    share: float

    def kept(self, losses: Optional[Sequence[float]], loss: float) -> List[float]:
        """``losses`` with ``loss`` appended, the last ``2 * window`` of them (what the test
        reads)."""
        return [*(losses or ()), loss][-2 * self.window :]

    def stalled(self, losses: Sequence[float]) -> bool:
        """Whether ``losses`` have stalled; ``False`` until both windows are full."""
        if len(losses) < 2 * self.window:
            return False
        w = self.window
        before, last = sum(losses[-2 * w : -w]), sum(losses[-w:])
        return before - last <= self.share * abs(before)


@dataclass(frozen=True)
class Plan:
    """The plan of one step (see the module's docstring), filled in by :func:`start`,
    :func:`with_jacobian` and :meth:`Router.route`, in that order.

    Attributes:
        rows: the rows it uses: ``None`` (the batch's), :data:`SAMPLE` (a sample of the
            points, drawn at the step) or :data:`ALL` (all of too many rows).
        jacobian: how ``J`` is formed: :data:`~torch_sgn.linearization.ENGINE`,
            :data:`~torch_sgn.linearization.ROWS` or :data:`~torch_sgn.linearization.FACTORS`
            (``None`` until the step is linearized).
        exact: the route the step could take exactly
            (:data:`~torch_sgn.solve.descents.ROUTES`; ``"cg"`` where only CG can run).
        phase: what the step does (:class:`~torch_sgn.solve.descents.Phase`: the route it takes,
            and for ``solver="auto"`` the exact route probed beside it, a probe's verdict).
        route: the route the step takes (its ``phase``'s; a property).
    """

    rows: Optional[str]
    jacobian: Optional[str] = None
    exact: Optional[str] = None
    phase: Optional[Phase] = None

    @property
    def route(self) -> str:
        """The route the step takes (its phase's)."""
        assert self.phase is not None, "the route is chosen by Router.route"
        return self.phase.route


@dataclass(frozen=True)
class Capabilities:
    """What a model and its engine offer an exact step, read once, when SGN is built.

    Attributes:
        residual_problem: the model is a residual problem
            (:class:`~torch_sgn.residual_problem.ResidualProblem`: a
            :class:`torch_sgn.pinn.Residuals` problem, a least-squares fit of one batch): it
            says how its rows are formed.
        through_outputs: the engine solves through the batch's outputs (the layer-wise
            engine's chains).
        single_process: one process (no data-parallel group).
        layer_factors: the model may form ``J``'s factors layer by layer (a residual
            problem), which steps on all of too many rows need (:func:`row_stage`).
    """

    residual_problem: bool
    through_outputs: bool
    single_process: bool
    layer_factors: bool = False

    @classmethod
    def of(cls, model: nn.Module, engine: object, single_process: bool) -> Capabilities:
        problem = residual_problem(model) is not None
        return cls(
            problem,
            bool(getattr(engine, "may_solve_through_outputs", False)),
            single_process,
            problem,
        )


def exact_allowed(caps: Capabilities, setup: Setup, options: Options) -> bool:
    """An exact step's conditions: one process, no momentum, no curvature subset."""
    return caps.single_process and _exact_options(setup, options)


def _exact_options(setup: Setup, options: Options) -> bool:
    return options.gradient_averaging == 0 and setup.curvature_fraction == 1


def curve_steps_allowed(setup: Setup, options: Options, numel: int) -> bool:
    """Whether a least-squares fit's steps may be taken without the optimizer, by
    :class:`~torch_sgn.curve_steps.CurveSteps`: exact steps (``solver`` ``"auto"`` or
    ``"direct"``) under :func:`exact_allowed`'s conditions (it runs in one process), no weight
    decay (its loss is the residuals' alone), and a ``P x P`` matrix of at most
    ``direct_max_params`` rows."""
    return (
        setup.solver != "cg"
        and _exact_options(setup, options)
        and options.weight_decay == 0
        and numel <= setup.direct_max_params
    )


def through_outputs(caps: Capabilities, setup: Setup, options: Options) -> bool:
    """Whether steps may go through the batch's outputs (each batch decides): the layer-wise
    engine's chains, and a residual problem's rows (:mod:`torch_sgn.engines.functional`).
    ``solver="direct"`` then checks the ``P x P`` matrix's memory at the steps that cannot,
    not at construction."""
    may = caps.through_outputs or caps.residual_problem
    return may and exact_allowed(caps, setup, options)


def start(
    caps: Capabilities,
    setup: Setup,
    options: Options,
    model: nn.Module,
    batch: Batch,
    numel: int,
    state: StepState,
) -> Plan:
    """The plan's rows: :func:`row_stage` (``SAMPLE``, ``ALL``, or ``None``: the batch's) for
    ``solver="auto"`` without CUDA graphs where an exact step is allowed; ``None`` elsewhere."""
    staged = caps.layer_factors and setup.solver == "auto" and not setup.cuda_graphs
    if not (staged and exact_allowed(caps, setup, options)):
        return Plan(None)
    return Plan(row_stage(model, batch, numel, setup.direct_max_params, state))


def forms_rows(setup: Setup, single_process: bool) -> bool:
    """Whether a residual problem's engine forms its rows for exact steps
    (:class:`~torch_sgn.engines.functional.RowsEngine`'s ``exact``): not where its steps go by CG
    alone: ``solver="cg"``, CUDA graphs (the captured products are the route) or a
    data-parallel group (each rank holds its shard's rows only)."""
    return single_process and setup.solver != "cg" and not setup.cuda_graphs


def forms_jacobian(caps: Capabilities, setup: Setup, lin: Linearization) -> bool:
    """Whether the step's exact solves form the ``J`` of a model that is not a residual
    problem row by row (:func:`~torch_sgn.engines.functional.with_jacobian`; a residual problem's
    rows are its engine's, :class:`~torch_sgn.engines.functional.RowsEngine`): with
    ``solver="direct"`` (in place of ``P`` products), where the engine has no route of its own
    (no dense ``G``, no sample space), without CUDA graphs (the captured products are the
    route), in one process and without a curvature subset. The caller checks, once per batch
    shape, that the model is per-sample (:class:`~torch_sgn.engines.functional.PerSample`)."""
    return not (
        caps.residual_problem
        or setup.solver != "direct"
        or setup.cuda_graphs
        or lin.dense_ggn is not None
        or lin.sample_space is not None
        or not caps.single_process
        or setup.curvature_fraction != 1
    )


def fits_one_batch(caps: Capabilities, repeated: bool) -> bool:
    """Whether the run fits one batch rather than a stream of mini-batches: a residual
    problem (whose points may be drawn anew), or inputs that are the previous step's tensors,
    unchanged (``repeated``: a full-batch fit). ``solver="auto"`` then takes exact steps at
    once."""
    return repeated or caps.residual_problem


def with_jacobian(plan: Plan, lin: Linearization) -> Plan:
    """The plan with how ``J`` is formed, as the step's linearization ``lin`` says
    (:attr:`~torch_sgn.linearization.Linearization.jacobian`)."""
    return replace(plan, jacobian=lin.jacobian)


class Router:
    """One optimizer's route decisions: its :class:`Capabilities` and settings, and what the
    rules remember between steps.

    Args:
        caps: what the model and its engine offer.
        setup: SGN's settings.
        fmodel: the model, evaluated functionally.
    """

    def __init__(self, caps: Capabilities, setup: Setup, fmodel: FunctionalModel):
        self.caps, self.setup, self.fmodel = caps, setup, fmodel
        #: the model as a residual problem (``None``: it is not one)
        self.problem = fmodel.problem
        self._per_sample = PerSample()  # whether the model is per-sample on a batch's shape
        self._last_inputs = BatchMemory()  # the last step's inputs (fits_one_batch)

    def start(self, options: Options, batch: Batch, state: StepState) -> Plan:
        """The step's plan with its rows (:func:`start`)."""
        fm = self.fmodel
        return start(self.caps, self.setup, options, fm.model, batch, fm.numel, state)

    def row_by_row(self, lin: Linearization, theta: Tensor, batch: Batch) -> bool:
        """Whether this step's exact solves form ``J`` row by row (:func:`forms_jacobian`), the
        model being per-sample on batches of this shape
        (:class:`~torch_sgn.engines.functional.PerSample`, checked once per shape and mode)."""
        if lin.rows is not None or not forms_jacobian(self.caps, self.setup, lin):
            return False
        return self._per_sample(self.fmodel, theta, batch)

    def route(
        self,
        plan: Plan,
        options: Options,
        lin: Linearization,
        rhs: Tensor,
        batch: Batch,
        state: StepState,
        loss0: float,
        loss_at: Callable[[Tensor], float],
    ) -> Plan:
        """The plan with the route the step could take exactly (:func:`choose_route`) and the
        phase it takes: that route, or for ``solver="auto"`` the phase of
        :func:`auto_phase` (CG, a probe, a verdict; ``loss_at``: the batch's
        objective at a point, the candidate's)."""
        setup, fm = self.setup, self.fmodel
        route = choose_route(
            setup.solver, lin, rhs, fm.numel, fm.device, options.cg_iters, setup.direct_max_params
        )
        if setup.solver != "auto":
            return replace(plan, exact=route, phase=Phase(route))
        # (asked for "auto" alone: it remembers the batch it sees)
        one_batch = fits_one_batch(self.caps, self._last_inputs.repeated(batch.args))
        taken = auto_phase(
            state.auto, state.step, route, loss0, loss_at, one_batch, fm.calls_autograd
        )
        return replace(plan, exact=route, phase=taken)

    def advance(
        self, state: StepState, plan: Plan, loss0: float, candidate: Optional[Tensor]
    ) -> AutoState:
        """``solver="auto"``'s part of the state after the step of ``plan`` (committed) from
        ``state`` (``loss0`` its objective at the start, ``candidate`` its probe's point):
        advanced by :func:`advance_auto` where an exact route existed, else as it was."""
        if self.setup.solver != "auto" or plan.exact == CG:
            return state.auto
        t = state.step
        part, switched = advance_auto(state.auto, t, plan.phase, loss0, candidate)
        if switched is not None:
            logger.info("step %d: solver='auto' switches to exact steps (%s)", t, switched)
        return part


def choose_route(
    solver: str,
    lin: Linearization,
    rhs: Tensor,
    numel: int,
    device: torch.device,
    cg_iters: int,
    max_params: int,
) -> str:
    """How this step solves: ``"cg"``, ``"matrix"`` directly through the ``P x P`` matrix ``G``,
    ``"samples"`` directly through the batch's outputs
    (:func:`~torch_sgn.solve.direct.solve_in_sample_space`), ``"sampled"`` by CG on every row
    preconditioned by a sample of them, where the linearization offers that sample (a residual
    problem too large for either matrix, :func:`row_stage`).

    ``solver="auto"``: the direct solver wherever its matrix has at most ``max_params`` rows,
    through the outputs where they are fewer than the parameters, and through ``G`` only where
    the engine forms it from the per-sample Jacobian (or ``P <= cg_iters``): from products with
    the identity's columns ``G`` costs ``P`` products, which on a model of thousands of
    parameters is hundreds of times CG's ``k``. Else CG.

    Raises:
        ValueError: ``solver="direct"`` on a step whose ``P x P`` matrices do not fit in the
            device's free memory and that cannot go through the outputs.
    """
    if solver == "cg":
        return CG
    if lin.rows is not None and rhs is lin.grad:  # too many rows for either matrix
        return SAMPLED
    if samples_fit(solver, lin, rhs, numel, device, max_params):
        return SAMPLES
    if solver == "direct":
        try:  # raised here, before the step changes anything
            direct.check_direct_fits(numel, torch.float64, device)
        except ValueError as e:
            raise ValueError(
                f"{e}. This step could not go through the batch's outputs either (that "
                "route needs fewer outputs than parameters, no momentum, one process and "
                "a chain of linear layers and activations); the step was not taken"
            ) from None
        return MATRIX
    cheap = lin.dense_ggn is not None or numel <= cg_iters
    return MATRIX if cheap and matrix_fits(numel, device, max_params) else CG


def samples_fit(
    solver: str,
    lin: Linearization,
    rhs: Tensor,
    numel: int,
    device: torch.device,
    max_params: int,
) -> bool:
    """Whether the step can be solved through the batch's outputs, more cheaply than through
    ``G`` (fewer outputs than parameters, the plain gradient as right-hand side), within
    ``max_params`` for ``"auto"`` and in the free memory."""
    space = lin.sample_space
    if space is None or rhs is not lin.grad or space.size >= numel:
        return False
    if solver == "auto" and space.size > max_params:
        return False
    return fits(space.size, device)


def matrix_fits(numel: int, device: torch.device, max_params: int) -> bool:
    """Whether ``solver="auto"`` may form the ``P x P`` matrix: at most ``max_params`` rows, in
    the free memory."""
    return numel <= max_params and fits(numel, device)


def fits(n: int, device: torch.device) -> bool:
    """Whether the direct solver's ``n x n`` float64 matrices fit in the device's free memory."""
    try:
        direct.check_direct_fits(n, torch.float64, device)
    except ValueError:
        return False
    return True


# --- the stages of many rows --------------------------------------------------------------
#: The stages of a problem of many rows: exact steps on a sample of the points, then steps on
#: all rows.
SAMPLE, ALL = "sample", "all"
#: The stall test of the sampled steps' losses: 50 steps a window, a fall of 1%.
SAMPLE_STALL = StallTest(50, 0.01)


def row_stage(
    model: ResidualProblem, batch: Batch, numel: int, max_params: int, state: StepState
) -> Optional[str]:
    """``SAMPLE`` or ``ALL`` for a residual problem (``model``, one that may form its layers'
    factors, :class:`~torch_sgn.residual_problem.ResidualProblem`) too large for an exact
    step, or with at least :data:`~torch_sgn.solve.sampled.ROWS_PER_PARAMETER` times as many
    rows as parameters (see the module's docstring), ``None`` for any other batch."""
    if bool(batch.targets.any()):
        return None
    rows = model.count(batch.args)
    if rows <= max_params or (numel <= max_params and rows < sampled.ROWS_PER_PARAMETER * numel):
        return None
    points = sample_points(model, batch, max_params, state.rows.stalls)
    return SAMPLE if points else ALL


def sample_points(model: ResidualProblem, batch: Batch, max_params: int, stalls: int) -> int:
    """The points a sample draws after ``stalls`` stalls: :data:`~torch_sgn.solve.sampled.POINTS`
    doubled at each, and no more rows than ``max_params`` (at the most rows a point has); 0
    once the largest sample has stalled."""
    counts = model.points(batch.args)
    per_point = -(-model.count(batch.args) // max(1, sum(counts)))
    largest = max(1, max_params // per_point)
    if stalls and sampled.POINTS * 2 ** (stalls - 1) >= largest:
        return 0
    return min(sampled.POINTS * 2**stalls, largest)


def sampled_batch(
    stage: Optional[str], model: ResidualProblem, batch: Batch, max_params: int, state: StepState
) -> Tuple[Batch, Optional[List[Tensor]]]:
    """A ``SAMPLE`` step's batch, the points drawn at its step (zero targets), and the points'
    indices in each block; ``(batch, None)`` for any other step."""
    if stage != SAMPLE:
        return batch, None
    counts = model.points(batch.args)
    points = sample_points(model, batch, max_params, state.rows.stalls)
    index = sampled.draw(counts, points, state.step, batch.targets.device)
    inputs = model.subset(batch.args, index)
    return Batch(inputs, batch.targets.new_zeros(model.count(inputs))), index


def advance_rows(
    state: RowsState,
    t: int,
    stage: Optional[str],
    loss0: float,
    model: ResidualProblem,
    inputs: object,
    max_params: int,
) -> RowsState:
    """The rows' state after step ``t`` of ``stage``: a sampled step's loss joins the stall
    test; once the losses stall, the sample doubles, or past the largest the steps go on all
    rows where the layers' factors follow the network and fit in memory (else the largest
    sample goes on)."""
    if stage != SAMPLE:
        return state
    losses = SAMPLE_STALL.kept(state.sampled_losses, loss0)
    if SAMPLE_STALL.stalled(losses):
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        batch = Batch(args, args[0].new_zeros(0))
        grows = sample_points(model, batch, max_params, state.stalls + 1) > 0
        factors = model.factors_follow  # (else all rows would be CG)
        fit = factors and all_rows_fit(model, model.points(args), args, args[0].device)
        if grows or fit:
            what = "the sample doubles" if grows else "steps on all rows"
            logger.info("step %d: the sampled steps stalled; %s", t, what)
            return RowsState(stalls=state.stalls + 1)
    return replace(state, sampled_losses=losses)


def points_used(sample: Optional[RowSample], drawn: Optional[List[Tensor]]) -> Optional[tuple]:
    """:attr:`StepInfo.sample <torch_sgn.StepInfo.sample>`: the points drawn from each block,
    by the step's sample (``SAMPLE``) or its preconditioner's (``ALL``)."""
    if sample is not None:
        return tuple(sample.points)
    return None if drawn is None else tuple(int(i.numel()) for i in drawn)


@dataclass(frozen=True)
class Rows:
    """One step's rows: its stage (``None``: the batch's rows; ``SAMPLE``; ``ALL``), the batch
    the step is taken on, and for ``SAMPLE`` the indices of the points drawn from each block."""

    stage: Optional[str]
    batch: Batch
    drawn: Optional[List[Tensor]] = None


class RowStages:
    """The stages of a residual problem of many rows (see the module's docstring) as one part
    of a stepper: :meth:`rows` at the step's start, :meth:`linearized` for an ``ALL`` step,
    :meth:`advance` after it. The stage itself is the route plan's
    (:func:`start`, which applies :func:`row_stage`).

    Args:
        model: the model (a :class:`~torch_sgn.residual_problem.ResidualProblem` wherever a
            stage is not ``None``).
        max_params: SGN's ``direct_max_params``.
    """

    def __init__(self, model: object, max_params: int):
        self.model, self.max_params = model, max_params

    def rows(self, stage: Optional[str], batch: Batch, state: StepState) -> Rows:
        """The step's rows at ``stage``: a ``SAMPLE`` step's drawn points (:func:`sampled_batch`),
        else the batch."""
        drawn_batch, drawn = sampled_batch(stage, self.model, batch, self.max_params, state)
        return Rows(stage, drawn_batch, drawn)

    def linearized(self, engine: RowsEngine, flat: Tensor, rows: Rows) -> Optional[Linearization]:
        """An ``ALL`` step's linearization on every row, from the layers' factors
        (:meth:`~torch_sgn.engines.functional.RowsEngine.all_rows`), whose samples (its
        preconditioner's) have the first sample's size; ``None`` for other steps, and where
        the factors do not give it."""
        if rows.stage != ALL:
            return None
        points = sample_points(self.model, rows.batch, self.max_params, 0)
        return engine.all_rows(flat, rows.batch, points)

    def advance(
        self,
        rows: Rows,
        state: RowsState,
        t: int,
        loss0: float,
        inputs: object,
        sample: Optional[RowSample],
    ) -> Tuple[RowsState, Optional[tuple]]:
        """After step ``t`` (its loss ``loss0``, its batch's ``inputs``): the part's state
        (:func:`advance_rows`) and :attr:`StepInfo.sample <torch_sgn.StepInfo.sample>`
        (:func:`points_used`; ``None`` for a step on the batch's rows)."""
        after = advance_rows(state, t, rows.stage, loss0, self.model, inputs, self.max_params)
        return after, points_used(sample, rows.drawn)


def all_rows_fit(
    model: nn.Module, counts: Sequence[int], inputs: Sequence[Tensor], device: torch.device
) -> bool:
    """Whether steps on all rows fit in a quarter of the device's free memory: the layers'
    factors of every point (:mod:`torch_sgn.pinn.layer_kernel`), ``C (in + 1 + out)`` float64
    numbers per point and linear layer for ``C`` channels (the value, the input's directions
    and the Laplacian), and the pass that forms them about as much again."""
    dim = max((x.shape[-1] if x.dim() > 1 else 1) for x in inputs) if inputs else 1
    widths = sum(
        m.in_features + 1 + m.out_features for m in model.modules() if isinstance(m, nn.Linear)
    )
    need = 2 * 8 * (dim + 2) * widths * sum(counts)
    free = available_memory(device)
    return free is None or need <= free / 4


# --- solver="auto" -----------------------------------------------------------------------
#: Steps from one probe to the next (the first step probes).
PROBE_EVERY = 10
#: The share by which the exact candidate's loss must be below CG's for the switch.
MARGIN = 0.01
#: The stall test of the CG steps' batch losses: 20 steps a window, a fall of 10%.
CG_STALL = StallTest(20, 0.1)


#: What SGN says once where it takes such CG steps (figures from
#: ``benchmarks/pinns/pinn_autograd.py``'s record, quoted in ``docs/PINN.md``).
NESTED_NOTICE = (
    "this model's forward differentiates its output by torch.autograd.grad: SGN steps by "
    "preconditioned conjugate gradient through the nested graph. Written with torch_sgn.pinn "
    "(Residuals and its operators: laplacian, gradient, hessian, derivative), the same problem "
    "takes exact Gauss-Newton steps: on a nonlinear Poisson problem each cost 1/7 of these, and "
    "in the same 40 CPU seconds its error ended 12,000 times lower "
    "(docs/PINN.md#autograd-in-forward)"
)


def exact_wins(exact_loss: float, cg_loss: float) -> bool:
    """Whether the exact candidate's loss is below CG's by the share :data:`MARGIN`."""
    return exact_loss < cg_loss - MARGIN * abs(cg_loss)


def auto_phase(
    state: AutoState,
    t: int,
    route: str,
    loss0: float,
    loss_at: Callable[[Tensor], float],
    one_batch: bool = False,
    nested: bool = False,
) -> Phase:
    """The phase of step ``t``. ``route``: the exact route the step could take (``"cg"`` where
    only CG can run); ``loss0``: the batch loss at the current point; ``loss_at``: the batch loss
    at a point (the candidate's); ``one_batch``: the run fits one batch (a full-batch fit, a
    least-squares problem), where no noise argues for CG: exact steps at once; ``nested``: the
    model's forward differentiates itself (CG steps of one batch then solve further)."""
    if route == CG or state.exact or one_batch:
        return Phase(route, one_batch=one_batch and nested and route == CG)
    if state.candidate is not None:
        verdict = exact_wins(loss_at(state.candidate), loss0)
        return Phase(route if verdict else CG, verdict=verdict)
    next_probe = 0 if state.next_probe is None else state.next_probe
    return Phase(CG, probe=route if t >= next_probe else None)


def advance_auto(
    state: AutoState, t: int, phase: Phase, loss0: float, candidate: Optional[Tensor]
) -> tuple[AutoState, Optional[str]]:
    """The state after the committed step ``t`` of ``solver="auto"`` whose exact route existed
    (``phase`` from :func:`auto_phase`, ``candidate`` the probe's point, ``None`` where its
    exact step did not move), and the reason of a switch made here (``"probe"``, ``"stall"``) or
    ``None``."""
    if state.exact:
        return state, None
    reason = None
    if phase.verdict is not None:
        state = replace(state, candidate=None)
        reason = "probe" if phase.verdict else None
    elif phase.probe is not None:
        state = replace(state, next_probe=t + PROBE_EVERY)
        if candidate is not None:
            state = replace(state, candidate=candidate)
    recent = CG_STALL.kept(state.recent, loss0)
    state = replace(state, recent=recent)
    if reason is None and CG_STALL.stalled(recent):
        reason = "stall"
    if reason is not None:
        state = AutoState(exact=True)
    return state, reason


class BatchMemory:
    """Whether a step's inputs are the previous step's tensors, unchanged: the same objects
    (weak references: a new batch in the freed memory of the last one is another batch), not
    written in place since: a full-batch fit rather than a stream of mini-batches."""

    def __init__(self) -> None:
        self._last: tuple = ()

    def repeated(self, args: tuple) -> bool:
        last = self._last
        same = len(last) == len(args) and all(
            ref() is x and version == x._version for (ref, version), x in zip(last, args)
        )
        self._last = tuple((weakref.ref(x), x._version) for x in args)
        return same
