"""The plan of a step on more rows than an exact step takes (:mod:`torch_sgn.solve.sampled`).

A residual problem (:class:`torch_sgn.pinn.Residuals`, zero targets) whose residuals ``R`` and
parameters ``P`` both exceed ``SGN(direct_max_params)`` fits neither the ``R x R`` Gram matrix
nor the ``P x P`` matrix of an exact step. One with more than ``direct_max_params`` rows and at
least :data:`~torch_sgn.solve.sampled.ROWS_PER_PARAMETER` rows per parameter fits the ``P x P``
matrix, but forming it from every row costs ``R P^2``. ``solver="auto"`` takes both in stages,
by a rule on sizes, memory and the losses, never on timings:

1. ``SAMPLE``: exact steps on a sample of the points (:data:`~torch_sgn.solve.sampled.POINTS`
   at first, never more rows than ``direct_max_params``), drawn anew at each step by a
   generator seeded with the step, every block keeping its share. Each step's loss, on a
   fresh sample, estimates the whole loss without bias.
2. When those losses stall (:func:`~torch_sgn.solve.sampled.stalled`: the steps ride their
   samples' noise), the sample doubles, up to ``direct_max_params`` rows: a larger sample,
   less noise.
3. ``ALL``: when the largest sample stalls too, and the factors of every row fit in memory
   (:func:`~torch_sgn.solve.sampled.all_rows_fit`), conjugate gradient on every row,
   preconditioned by a sample's Gauss-Newton matrix: the steps converge to the minimizer of
   the whole problem, not to a neighbourhood of it.

The stalls so far and the stall test's losses are this part's own state
(:class:`~torch_sgn.solve.state.RowsState` in the optimizer's
:class:`~torch_sgn.solve.state.StepState`), advanced here (:func:`advance`) and saved with the
optimizer's state dict, so a resumed run takes the same steps.

:class:`RowStages` is the part a stepper holds: the step's :class:`Rows` (drawn at its start),
an ``ALL`` step's linearization, and after the step the part's state and the points it used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

from torch import Tensor

from .batch import Batch
from .engines.rows import RowsEngine
from .linearization import Linearization, RowSample
from .residual_problem import ResidualProblem
from .solve import sampled
from .solve.state import RowsState, StepState

__all__ = [
    "RowStages", "Rows", "advance", "points_used", "sample_points", "sampled_batch", "stage",
]  # fmt: skip

logger = logging.getLogger("torch_sgn")


def stage(
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
    return sampled.SAMPLE if points else sampled.ALL


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
    if stage != sampled.SAMPLE:
        return batch, None
    counts = model.points(batch.args)
    points = sample_points(model, batch, max_params, state.rows.stalls)
    index = sampled.draw(counts, points, state.step, batch.targets.device)
    inputs = model.subset(batch.args, index)
    return Batch(inputs, batch.targets.new_zeros(model.count(inputs))), index


def advance(
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
    if stage != sampled.SAMPLE:
        return state
    losses = sampled.STALL_TEST.kept(state.sampled_losses, loss0)
    if sampled.stalled(losses):
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        batch = Batch(args, args[0].new_zeros(0))
        grows = sample_points(model, batch, max_params, state.stalls + 1) > 0
        factors = model.factors_follow  # (else all rows would be CG)
        fit = factors and sampled.all_rows_fit(model, model.points(args), args, args[0].device)
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
    (:func:`torch_sgn.route_plan.start`, which applies :func:`stage`).

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
        (:meth:`~torch_sgn.engines.rows.RowsEngine.all_rows`), whose samples (its
        preconditioner's) have the first sample's size; ``None`` for other steps, and where
        the factors do not give it."""
        if rows.stage != sampled.ALL:
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
        (:func:`advance`) and :attr:`StepInfo.sample <torch_sgn.StepInfo.sample>`
        (:func:`points_used`; ``None`` for a step on the batch's rows)."""
        after = advance(state, t, rows.stage, loss0, self.model, inputs, self.max_params)
        return after, points_used(sample, rows.drawn)
