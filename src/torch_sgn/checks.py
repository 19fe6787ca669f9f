"""Checks of a step's batch and of the loss and gradient at the current point, with errors that
say what to do."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .batch import Batch, Inputs
from .linearization import Linearization
from .losses import OutputLoss
from .residual_problem import ResidualProblem

__all__ = ["all_finite", "check_batch", "finite_loss"]


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
    if targets is None:
        if callable(inputs):
            raise TypeError(
                "SGN.step takes the mini-batch, opt.step(inputs, targets), not a closure: SGN "
                "needs the model's outputs and the targets, not only the loss a closure "
                "returns, to form the Gauss-Newton matrix J^T H J, and runs the forward passes "
                "itself"
            )
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
