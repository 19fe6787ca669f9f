"""What a residual problem offers a step: the :class:`ResidualProblem` protocol.

A model that is a least-squares problem of residual blocks (:class:`torch_sgn.pinn.Residuals`,
and through it the DeepXDE adapter's problems and :func:`torch_sgn.least_squares`' wrapped
functions) tells the step how its rows are formed, which a general model cannot:

* its rows: how many a batch of points gives (:meth:`ResidualProblem.count`), how many points
  each block holds (:meth:`~ResidualProblem.points`), and the batch of a subset of them
  (:meth:`~ResidualProblem.subset`), which the sampled steps of many rows draw;
* the Jacobian's rows, block by block (:meth:`~ResidualProblem.jacobian_blocks`): each point's
  rows depend on that point alone, so ``vmap`` of ``jacrev`` forms them
  (:mod:`torch_sgn.engines.functional`);
* the layers' factors of ``J`` (:meth:`~ResidualProblem.layer_factors`, ``None`` where the
  network's layers do not give them) and whether they were checked against ``J``'s rows and
  followed them (:attr:`~ResidualProblem.factors_follow`);
* where its residuals are not finite (:meth:`~ResidualProblem.non_finite`), which a step that
  meets a NaN loss names.

:func:`residual_problem` reads a model once: the protocol, or ``None``. Nothing else in the
package asks a model whether it has one of these methods.

This module is a leaf: it imports nothing of the package, so the residual problems
(:mod:`torch_sgn.pinn`) and the step's parts that consume them import it alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from torch import Tensor

__all__ = ["JacobianBlock", "ResidualProblem", "residual_problem"]


@dataclass(frozen=True)
class JacobianBlock:
    """Rows of the model's outputs taken together: ``rows(flat, *point) -> outputs of one
    point`` (flat), vmapped over ``points`` (tensors sharing their leading dimension; none for a
    block of the parameters alone, whose ``rows(flat)`` is taken once)."""

    rows: Callable[..., Tensor]
    points: Tuple[Tensor, ...]


@runtime_checkable
class ResidualProblem(Protocol):
    """A model whose output is a vector of residuals of blocks of points (see the module's
    docstring). ``inputs`` is a batch's tensors, every block's points in order; ``fmodel`` the
    step's :class:`~torch_sgn.model.flat_model.FunctionalModel` of the problem, ``flat`` the
    parameters."""

    def count(self, inputs: Sequence[Tensor]) -> int:
        """The number of residuals ``R`` on ``inputs``."""

    def points(self, inputs: Sequence[Tensor]) -> List[int]:
        """The number of points of each block in ``inputs`` (0 for a block without points)."""

    def subset(self, inputs: Sequence[Tensor], index: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """``inputs`` with only the points ``index[b]`` of each block ``b``."""

    def jacobian_blocks(self, fmodel: Any, inputs: Sequence[Tensor]) -> List[JacobianBlock]:
        """The blocks of rows whose Jacobians are formed separately."""

    def layer_factors(self, fmodel: Any, flat: Tensor, inputs: Sequence[Tensor]) -> Optional[Any]:
        """``J``'s factors from the network's layers
        (:class:`~torch_sgn.pinn.layer_kernel.LayerFactors`), or ``None``."""

    def non_finite(self, inputs: Sequence[Tensor]) -> Optional[str]:
        """Which blocks and points give residuals that are not finite (``None``: none)."""

    @property
    def factors_follow(self) -> bool:
        """Whether the layers' factors were checked against ``J``'s rows and followed them."""


def residual_problem(model: object) -> Optional[ResidualProblem]:
    """``model`` as a :class:`ResidualProblem`, or ``None`` where it is not one."""
    return model if isinstance(model, ResidualProblem) else None
