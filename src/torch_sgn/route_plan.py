"""Which way a step goes, decided in one place.

What the model and its engine offer an exact step is declared once, in :class:`Capabilities`.
From it, SGN's :class:`~torch_sgn.options.Setup` and the step's
:class:`~torch_sgn.options.Options`, this module answers each question a step asks on its way:

1. which rows it uses (:func:`rows_stage`: the batch's, a sample of them, or all of too many
   rows, :mod:`torch_sgn.many_rows`);
2. how its ``J`` is formed (:func:`forms_jacobian`: by the engine's products, or row by row,
   :func:`~torch_sgn.engines.jacobian.with_jacobian`; on all of too many rows, by the layers'
   factors);
3. which route solves it and, for ``solver="auto"``, whether it probes the exact route
   (:func:`phase`: :func:`~torch_sgn.solve.routes.choose_route`, then
   :func:`~torch_sgn.solve.auto.plan`).

The answers are rules on sizes, memory and what the engine offers, never on timings, so that
a run takes the same steps on every machine. The optimizer asks them in this order, since the
route depends on the linearization the first two shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from . import many_rows
from .batch import Batch
from .linearization import Linearization
from .options import Options, Setup
from .solve import auto
from .solve.routes import choose_route
from .solve.state import StepState

__all__ = [
    "Capabilities", "exact_allowed", "fits_one_batch", "forms_jacobian", "phase", "rows_stage",
    "through_outputs",
]  # fmt: skip


@dataclass(frozen=True)
class Capabilities:
    """What a model and its engine offer an exact step, read once, when SGN is built.

    Attributes:
        residual_problem: the model says how its rows are formed (``jacobian_blocks``: a
            :class:`torch_sgn.pinn.Residuals` problem, a least-squares fit of one batch).
        through_outputs: the engine solves through the batch's outputs (the layer-wise
            engine's chains).
        single_process: one process (no data-parallel group).
    """

    residual_problem: bool
    through_outputs: bool
    single_process: bool

    @classmethod
    def of(cls, model: nn.Module, engine: object, single_process: bool) -> Capabilities:
        return cls(
            hasattr(model, "jacobian_blocks"),
            bool(getattr(engine, "may_solve_through_outputs", False)),
            single_process,
        )


def exact_allowed(caps: Capabilities, setup: Setup, options: Options) -> bool:
    """An exact step's conditions: one process, no momentum, no curvature subset."""
    return (
        caps.single_process
        and options.gradient_averaging == 0
        and setup.curvature_fraction == 1
    )  # fmt: skip


def through_outputs(caps: Capabilities, setup: Setup, options: Options) -> bool:
    """Whether steps may go through the batch's outputs (each batch decides): the layer-wise
    engine's chains, and any engine on a residual problem (:mod:`torch_sgn.engines.jacobian`).
    ``solver="direct"`` then checks the ``P x P`` matrix's memory at the steps that cannot,
    not at construction."""
    may = caps.through_outputs or caps.residual_problem
    return may and exact_allowed(caps, setup, options)


def rows_stage(
    caps: Capabilities,
    setup: Setup,
    options: Options,
    model: nn.Module,
    batch: Batch,
    numel: int,
    state: StepState,
) -> Optional[str]:
    """Which rows the step uses: :func:`torch_sgn.many_rows.stage` (``SAMPLE``, ``ALL``, or
    ``None``: the batch's; it reads whether the model has the layers' factors) for
    ``solver="auto"`` without CUDA graphs where an exact step is allowed; ``None`` elsewhere."""
    if setup.solver != "auto" or setup.cuda_graphs or not exact_allowed(caps, setup, options):
        return None
    return many_rows.stage(model, batch, numel, setup.direct_max_params, state)


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


def phase(
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
) -> tuple[str, auto.Phase]:
    """The route the step could take exactly (:func:`~torch_sgn.solve.routes.choose_route`)
    and the phase it takes: that route, or for ``solver="auto"`` the phase of
    :func:`~torch_sgn.solve.auto.plan` (CG, a probe, a verdict). ``one_batch`` is asked only
    for ``"auto"`` (it remembers the batch it sees)."""
    route = choose_route(
        setup.solver, lin, rhs, numel, device, options.cg_iters, setup.direct_max_params
    )
    if setup.solver != "auto":
        return route, auto.Phase(route)
    return route, auto.plan(state, state.step, route, loss0, loss_at, one_batch(), nested)
