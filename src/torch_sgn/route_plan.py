"""Which way a step goes, decided in one place: the step's :class:`Plan`.

What the model and its engine offer an exact step is declared once, in :class:`Capabilities`.
From it, SGN's :class:`~torch_sgn.options.Setup` and the step's
:class:`~torch_sgn.options.Options`, this module makes each step's :class:`Plan`: which rows
it uses, how its ``J`` is formed, the exact route it could take and the route it takes (with
``solver="auto"``'s probe). The plan is filled in the order the step learns what each answer
needs, one field per function, each taking the plan so far and returning it completed:

1. :func:`start`: the rows (the batch's, a sample of them, or all of too many rows,
   :mod:`torch_sgn.many_rows`);
2. :func:`with_jacobian`: how ``J`` is formed, from what the linearization on those rows
   offers (by the engine's products, row by row,
   :func:`~torch_sgn.engines.jacobian.with_jacobian`, or on all of too many rows by the
   layers' factors);
3. :func:`with_route`: the exact route (:func:`~torch_sgn.solve.routes.choose_route`) and, for
   ``solver="auto"``, the phase (:func:`~torch_sgn.solve.auto.plan`: CG, a probe, a verdict).

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
from .linearization import Linearization
from .options import Options, Setup
from .residual_problem import residual_problem
from .solve import auto
from .solve.routes import choose_route
from .solve.state import StepState

__all__ = [
    "ENGINE", "FACTORS", "ROWS", "Capabilities", "Plan", "curve_steps_allowed", "exact_allowed",
    "fits_one_batch",
    "forms_jacobian", "start", "through_outputs", "with_jacobian", "with_route",
]  # fmt: skip

#: How a step's ``J`` is formed: by the engine's products (or its own dense ``G`` or sample
#: space), row by row (:func:`~torch_sgn.engines.jacobian.with_jacobian`), or on all of too
#: many rows by the layers' factors (:func:`torch_sgn.many_rows.linearized`).
ENGINE, ROWS, FACTORS = "engine", "rows", "factors"


@dataclass(frozen=True)
class Plan:
    """The plan of one step (see the module's docstring), filled in by :func:`start`,
    :func:`with_jacobian` and :func:`with_route`, in that order.

    Attributes:
        rows: the rows it uses: ``None`` (the batch's), :data:`~torch_sgn.solve.sampled.SAMPLE`
            (a sample of the points, drawn at the step) or :data:`~torch_sgn.solve.sampled.ALL`
            (all of too many rows).
        jacobian: how ``J`` is formed: :data:`ENGINE`, :data:`ROWS` or :data:`FACTORS`
            (``None`` until the step is linearized).
        exact: the route the step could take exactly
            (:data:`~torch_sgn.solve.descents.ROUTES`; ``"cg"`` where only CG can run).
        phase: what the step does (:class:`~torch_sgn.solve.auto.Phase`: the route it takes,
            and for ``solver="auto"`` the exact route probed beside it, a probe's verdict).
    """

    rows: Optional[str]
    jacobian: Optional[str] = None
    exact: Optional[str] = None
    phase: Optional[auto.Phase] = None

    @property
    def route(self) -> str:
        """The route the step takes (its phase's)."""
        assert self.phase is not None, "the route is chosen by with_route"
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
    engine's chains, and any engine on a residual problem (:mod:`torch_sgn.engines.jacobian`).
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


def forms_jacobian(caps: Capabilities, setup: Setup, lin: Linearization) -> bool:
    """Whether the step's exact solves may form ``J`` row by row
    (:func:`~torch_sgn.engines.jacobian.with_jacobian`): on a residual problem unless CG is
    asked for, and on any model with ``solver="direct"`` (in place of ``P`` products); where
    the engine has no route of its own (no dense ``G``, no sample space), without CUDA graphs
    (the captured products are the route), in one process and without a curvature subset.
    ``solver="auto"`` keeps its cost rule on other models. The caller checks, once per batch
    shape, that the model is per-sample (:func:`~torch_sgn.engines.jacobian.per_sample`)."""
    return not (
        setup.solver == "cg"
        or (setup.solver == "auto" and not caps.residual_problem)
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


def with_jacobian(plan: Plan, lin: Linearization, row_by_row: bool) -> Plan:
    """The plan with how ``J`` is formed, from the step's linearization ``lin``: by the layers'
    factors where it holds all of too many rows (``lin.rows``), row by row where ``row_by_row``
    (:func:`forms_jacobian` allowed it and the model was per-sample on the batch), else by the
    engine."""
    how = FACTORS if lin.rows is not None else ROWS if row_by_row else ENGINE
    return replace(plan, jacobian=how)


def with_route(
    plan: Plan,
    setup: Setup,
    options: Options,
    lin: Linearization,
    rhs: Tensor,
    numel: int,
    device: torch.device,
    state: StepState,
    loss0: float,
    loss_at: Callable[[Tensor], float],
    one_batch: Callable[[], bool],
    nested: bool,
) -> Plan:
    """The plan with the route the step could take exactly
    (:func:`~torch_sgn.solve.routes.choose_route`) and the phase it takes: that route, or for
    ``solver="auto"`` the phase of :func:`~torch_sgn.solve.auto.plan` (CG, a probe, a verdict).
    ``one_batch`` is asked only for ``"auto"`` (it remembers the batch it sees)."""
    route = choose_route(
        setup.solver, lin, rhs, numel, device, options.cg_iters, setup.direct_max_params
    )
    if setup.solver != "auto":
        return replace(plan, exact=route, phase=auto.Phase(route))
    taken = auto.plan(state, state.step, route, loss0, loss_at, one_batch(), nested)
    return replace(plan, exact=route, phase=taken)
