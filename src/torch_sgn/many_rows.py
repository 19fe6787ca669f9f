"""The plan of a step on more rows than an exact step takes (:mod:`torch_sgn.solve.sampled`).

A residual problem (:class:`torch_sgn.pinn.Residuals`, zero targets) whose residuals ``R`` and
parameters ``P`` both exceed ``SGN(direct_max_params)`` fits neither the ``R x R`` Gram matrix
nor the ``P x P`` matrix of an exact step. ``solver="auto"`` then takes it in two stages, by a
rule on sizes, memory and the losses, never on timings:

1. ``SAMPLE``: exact steps on a sample of the points (about
   :data:`~torch_sgn.solve.sampled.POINTS`, no more rows than ``direct_max_params``), drawn
   anew at each step by a generator seeded with the step, every block keeping its share. Each
   step's loss, on a fresh sample, estimates the full loss without bias.
2. ``ALL``: once those losses stall (:func:`~torch_sgn.solve.sampled.stalled`: the steps ride
   their samples' noise) and the factors of every row fit in memory
   (:func:`~torch_sgn.solve.sampled.all_rows_fit`), conjugate gradient on every row,
   preconditioned by a sample's Gauss-Newton matrix: the steps converge to the minimizer of
   the whole problem.

The stage and the stall test's losses are kept in the optimizer's
:class:`~torch_sgn.solve.state.StepState` (``all_rows``, ``sampled_losses``), saved with its
state dict, so a resumed run takes the same steps.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import List, Optional, Tuple

from torch import Tensor, nn

from .engines.jacobian import by_factors
from .linearization import Batch, Linearization
from .losses import OutputLoss
from .model.flat_model import FunctionalModel
from .solve import sampled
from .solve.state import StepState

__all__ = [
    "linearized", "next_state", "points_used", "sample_points", "sampled_batch", "stage",
]  # fmt: skip

logger = logging.getLogger("torch_sgn")


def stage(
    model: nn.Module, batch: Batch, numel: int, max_params: int, state: StepState
) -> Optional[str]:
    """``SAMPLE`` or ``ALL`` for a residual problem too large for an exact step (see the
    module's docstring), ``None`` for any other problem or batch."""
    if (
        not hasattr(model, "layer_factors")
        or numel <= max_params
        or model.count(batch.args) <= max_params
        or bool(batch.targets.any())
    ):
        return None
    return sampled.ALL if state.all_rows else sampled.SAMPLE


def sample_points(model: nn.Module, batch: Batch, max_params: int) -> int:
    """The points a sample draws: :data:`~torch_sgn.solve.sampled.POINTS`, and no more rows
    than ``max_params`` (at the most rows a point has)."""
    counts = model.points(batch.args)
    per_point = -(-model.count(batch.args) // max(1, sum(counts)))
    return min(sampled.POINTS, max(1, max_params // per_point))


def sampled_batch(
    stage: Optional[str], model: nn.Module, batch: Batch, max_params: int, step: int
) -> Tuple[Batch, Optional[List[Tensor]]]:
    """A ``SAMPLE`` step's batch, the points drawn at step ``step`` (zero targets), and the
    points' indices in each block; ``(batch, None)`` for any other step."""
    if stage != sampled.SAMPLE:
        return batch, None
    counts = model.points(batch.args)
    device = batch.targets.device
    index = sampled.draw(counts, sample_points(model, batch, max_params), step, device)
    inputs = model.subset(batch.args, index)
    return Batch(inputs, batch.targets.new_zeros(model.count(inputs))), index


def linearized(
    fmodel: FunctionalModel, loss: OutputLoss, flat: Tensor, batch: Batch, max_params: int
) -> Optional[Linearization]:
    """An ``ALL`` step's linearization on every row, from the layers' factors, its samples
    of :func:`sample_points` points (:func:`~torch_sgn.engines.jacobian.by_factors`)."""
    points = sample_points(fmodel.model, batch, max_params)
    return by_factors(fmodel, loss, flat, batch, points)


def next_state(
    state: StepState, stage: str, loss0: float, model: nn.Module, inputs: object
) -> StepState:
    """The state after a step of ``stage``: a sampled step's loss joins the stall test, and
    once the losses stall the next steps go on all rows, where their memory fits."""
    if stage != sampled.SAMPLE:
        return state
    losses = [*(state.sampled_losses or ()), loss0][-2 * sampled.WINDOW :]
    if sampled.stalled(losses):
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        device = args[0].device
        if sampled.all_rows_fit(model, model.points(args), args, device):
            logger.info("step %d: the sampled steps stalled; steps on all rows", state.step)
            return replace(state, all_rows=True, sampled_losses=None)
    return replace(state, sampled_losses=losses)


def points_used(
    sample: Optional[sampled.RowSample], drawn: Optional[List[Tensor]]
) -> Optional[tuple]:
    """:attr:`StepInfo.sample <torch_sgn.StepInfo.sample>`: the points drawn from each block,
    by the step's sample (``SAMPLE``) or its preconditioner's (``ALL``)."""
    if sample is not None:
        return tuple(sample.points)
    return None if drawn is None else tuple(int(i.numel()) for i in drawn)
