"""Which way a step goes, decided in one place: the step's :class:`Plan`.

What the model and its engine offer an exact step is declared once, in :class:`Capabilities`.
From it, SGN's :class:`~torch_sgn.options.Setup` and the step's
:class:`~torch_sgn.options.Options`, this module makes each step's :class:`Plan`: which rows
it uses, how its ``J`` is formed, the exact route it could take and the route it takes (with
``solver="auto"``'s probe). The plan is filled in the order the step learns what each answer
needs, one field per function, each taking the plan so far and returning it completed:

1. :func:`start`: the rows (the batch's, a sample of them, or all of too many rows,
   :mod:`torch_sgn.many_rows`);
2. :func:`with_jacobian`: how ``J`` is formed, as the linearization on those rows says
   (:attr:`~torch_sgn.linearization.Linearization.jacobian`: by the engine's products, row by
   row, or on all of too many rows by the layers' factors); on a model that is not a residual
   problem, :meth:`Router.row_by_row` says whether the step forms its rows
   (:func:`~torch_sgn.engines.rows.with_jacobian`);
3. :meth:`Router.route`: the exact route (:func:`choose_route`) and, for ``solver="auto"``, the
   phase (:func:`~torch_sgn.solve.auto.plan`: CG, a probe, a verdict).

:class:`Router` holds one optimizer's share of these decisions: its :class:`Capabilities`, its
settings, and what the rules remember between steps (whether the model is per-sample on each
batch shape, the last step's inputs). The least-squares driver's gate
(:func:`curve_steps_allowed`) and the stall test's rule (:mod:`~torch_sgn.solve.stall`) are
the same rules, read from here.

The route cannot be chosen before the linearization: whether a dense ``G`` or the batch's
sample space is on offer is known once the engine has recorded the model on the batch.

The answers are rules on sizes, memory and what the engine offers, never on timings, so that
a run takes the same steps on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from . import many_rows
from .batch import Batch
from .engines.rows import PerSample
from .linearization import Linearization
from .model.flat_model import FunctionalModel
from .options import Options, Setup
from .residual_problem import residual_problem
from .solve import auto, direct
from .solve.descents import CG, MATRIX, SAMPLED, SAMPLES
from .solve.state import StepState

__all__ = [
    "Capabilities", "Plan", "Router", "choose_route", "curve_steps_allowed", "exact_allowed",
    "fits", "fits_one_batch", "forms_jacobian", "forms_rows", "matrix_fits", "samples_fit",
    "start", "through_outputs", "with_jacobian",
]  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The plan of one step (see the module's docstring), filled in by :func:`start`,
    :func:`with_jacobian` and :meth:`Router.route`, in that order.

    Attributes:
        rows: the rows it uses: ``None`` (the batch's), :data:`~torch_sgn.solve.sampled.SAMPLE`
            (a sample of the points, drawn at the step) or :data:`~torch_sgn.solve.sampled.ALL`
            (all of too many rows).
        jacobian: how ``J`` is formed: :data:`~torch_sgn.linearization.ENGINE`,
            :data:`~torch_sgn.linearization.ROWS` or :data:`~torch_sgn.linearization.FACTORS`
            (``None`` until the step is linearized).
        exact: the route the step could take exactly
            (:data:`~torch_sgn.solve.descents.ROUTES`; ``"cg"`` where only CG can run).
        phase: what the step does (:class:`~torch_sgn.solve.auto.Phase`: the route it takes,
            and for ``solver="auto"`` the exact route probed beside it, a probe's verdict).
        route: the route the step takes (its ``phase``'s; a property).
    """

    rows: Optional[str]
    jacobian: Optional[str] = None
    exact: Optional[str] = None
    phase: Optional[auto.Phase] = None

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
            problem), which steps on all of too many rows need (:mod:`torch_sgn.many_rows`).
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
    engine's chains, and a residual problem's rows (:mod:`torch_sgn.engines.rows`).
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
    """The plan's rows: :func:`torch_sgn.many_rows.stage` (``SAMPLE``, ``ALL``, or ``None``: the
    batch's) for ``solver="auto"`` without CUDA graphs where an exact step is allowed; ``None``
    elsewhere."""
    staged = caps.layer_factors and setup.solver == "auto" and not setup.cuda_graphs
    if not (staged and exact_allowed(caps, setup, options)):
        return Plan(None)
    return Plan(many_rows.stage(model, batch, numel, setup.direct_max_params, state))


def forms_rows(setup: Setup, single_process: bool) -> bool:
    """Whether a residual problem's engine forms its rows for exact steps
    (:class:`~torch_sgn.engines.rows.RowsEngine`'s ``exact``): not where its steps go by CG
    alone: ``solver="cg"``, CUDA graphs (the captured products are the route) or a
    data-parallel group (each rank holds its shard's rows only)."""
    return single_process and setup.solver != "cg" and not setup.cuda_graphs


def forms_jacobian(caps: Capabilities, setup: Setup, lin: Linearization) -> bool:
    """Whether the step's exact solves form the ``J`` of a model that is not a residual
    problem row by row (:func:`~torch_sgn.engines.rows.with_jacobian`; a residual problem's
    rows are its engine's, :class:`~torch_sgn.engines.rows.RowsEngine`): with
    ``solver="direct"`` (in place of ``P`` products), where the engine has no route of its own
    (no dense ``G``, no sample space), without CUDA graphs (the captured products are the
    route), in one process and without a curvature subset. The caller checks, once per batch
    shape, that the model is per-sample (:class:`~torch_sgn.engines.rows.PerSample`)."""
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
        self.problem = residual_problem(fmodel.model)
        self._per_sample = PerSample()  # whether the model is per-sample on a batch's shape
        self._last_inputs = auto.BatchMemory()  # the last step's inputs (fits_one_batch)

    def start(self, options: Options, batch: Batch, state: StepState) -> Plan:
        """The step's plan with its rows (:func:`start`)."""
        fm = self.fmodel
        return start(self.caps, self.setup, options, fm.model, batch, fm.numel, state)

    def row_by_row(self, lin: Linearization, theta: Tensor, batch: Batch) -> bool:
        """Whether this step's exact solves form ``J`` row by row (:func:`forms_jacobian`), the
        model being per-sample on batches of this shape
        (:class:`~torch_sgn.engines.rows.PerSample`, checked once per shape and mode)."""
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
        :func:`~torch_sgn.solve.auto.plan` (CG, a probe, a verdict; ``loss_at``: the batch's
        objective at a point, the candidate's)."""
        setup, fm = self.setup, self.fmodel
        route = choose_route(
            setup.solver, lin, rhs, fm.numel, fm.device, options.cg_iters, setup.direct_max_params
        )
        if setup.solver != "auto":
            return replace(plan, exact=route, phase=auto.Phase(route))
        # (asked for "auto" alone: it remembers the batch it sees)
        one_batch = fits_one_batch(self.caps, self._last_inputs.repeated(batch.args))
        taken = auto.plan(
            state.auto, state.step, route, loss0, loss_at, one_batch, fm.calls_autograd
        )
        return replace(plan, exact=route, phase=taken)


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
    problem too large for either matrix, :mod:`torch_sgn.many_rows`).

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
