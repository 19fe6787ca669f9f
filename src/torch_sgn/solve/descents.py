r"""The descents: how one step solves its damped Gauss-Newton system for a given damping.

.. math::
    (G + \rho I)\, d = -\hat m

A *descent* (Optimistix's word, ``optimistix/_solver/levenberg_marquardt.py``) is a small object
``damping -> result`` built once per step from the step's curvature operator and right-hand side,
both explicit values; the step's damping attempts (:mod:`~torch_sgn.solve.step`) call it with
one damping after another and it may keep work between the calls (a matrix formed once, factored
at each damping). Four descents, one per *route*:

* :class:`CGDescent` (``"cg"``): truncated conjugate gradient on ``v -> G v + rho v``;
* :class:`MatrixDescent` (``"matrix"``): exactly, through the ``P x P`` matrix ``G``
  (:func:`~torch_sgn.solve.direct.solve_damped`);
* :class:`SampleSpaceDescent` (``"samples"``): exactly, through the batch's ``R`` outputs
  (:func:`~torch_sgn.solve.direct.solve_in_sample_space`);
* :class:`SampledDescent` (``"sampled"``): CG on every row of a problem too large for
  either, preconditioned by a random sample of its rows (:mod:`~torch_sgn.solve.sampled`).

Every result (:class:`~torch_sgn.solve.cg.CGResult` or
:class:`~torch_sgn.solve.direct.DirectResult`) has ``x`` (``d``), ``residual``
(``A d + rhs`` for the matrix ``A`` actually solved), ``iterations``, ``reason`` (why the
solve stopped, or how it solved) and ``breakdown``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Union

from torch import Tensor

from . import direct, sampled
from .cg import CGResult, conjugate_gradient
from .direct import DirectResult
from .nystrom import NystromApproximation
from .sampled import SampledPreconditioner

if TYPE_CHECKING:
    from ..linearization import SampleSpace

__all__ = [
    "CG",
    "MATRIX",
    "ROUTES",
    "SAMPLED",
    "SAMPLES",
    "CGDescent",
    "Descent",
    "MatrixDescent",
    "Phase",
    "Result",
    "SampleSpaceDescent",
    "SampledDescent",
]

logger = logging.getLogger("torch_sgn")

#: The routes: by CG, exactly through ``G``, exactly through the batch's outputs, by CG on
#: every row preconditioned by a sample of them.
CG, MATRIX, SAMPLES, SAMPLED = "cg", "matrix", "samples", "sampled"
ROUTES = (CG, MATRIX, SAMPLES, SAMPLED)

#: What a descent returns.
Result = Union[CGResult, DirectResult]


@dataclass(frozen=True)
class Phase:
    """What one step of ``solver="auto"`` does.

    ``route``: the route it takes (:data:`ROUTES`); ``probe``: the
    exact route solved besides, whose point is the next step's candidate (``None``: no probe);
    ``verdict``: whether the last probe's candidate won on this step's batch (``None``: none was
    judged); ``one_batch``: a CG step of a run that fits one batch with a forward that
    differentiates itself (:func:`~torch_sgn.solve.core.cg_settings`).
    """

    route: str
    probe: Optional[str] = None
    verdict: Optional[bool] = None
    one_batch: bool = False


class Descent(Protocol):
    """``damping -> result``: the step's damped system solved at one damping."""

    def __call__(self, damping: float) -> Result: ...


@dataclass(frozen=True)
class CGDescent:
    r"""Truncated CG on :math:`(G + \rho I) d = -\hat m` (the paper's Algorithm 2).

    Attributes:
        operator: ``v -> G v`` (a fresh tensor per product).
        rhs: :math:`\hat m`.
        max_iters, tol, rtol, progress_tol: CG's stopping rules
            (:func:`~torch_sgn.solve.cg.conjugate_gradient`).
        x0: the starting iterate (a warm start), or ``None`` for zero.
        preconditioner_exponent: the diagonal preconditioner
            :math:`(\hat m^2 + \rho)^{-\text{exponent}}`, or ``None`` for none.
        nystrom: a low-rank approximation of ``G`` whose preconditioner
            (:meth:`~torch_sgn.solve.nystrom.NystromApproximation.preconditioner`) CG uses at
            each damping, or ``None`` (not with ``preconditioner_exponent``).
    """

    operator: Callable[[Tensor], Tensor]
    rhs: Tensor
    max_iters: int
    tol: float
    rtol: float = 0.0
    progress_tol: float = 0.0
    x0: Optional[Tensor] = None
    preconditioner_exponent: Optional[float] = None
    nystrom: Optional[NystromApproximation] = None

    def __call__(self, damping: float) -> CGResult:
        rhs, operator = self.rhs, self.operator
        precond: Union[None, Tensor, Callable[[Tensor], Tensor]] = None
        if self.preconditioner_exponent is not None:
            precond = (rhs.square() + damping).pow(-self.preconditioner_exponent)
        elif self.nystrom is not None:
            precond = self.nystrom.preconditioner(damping)

        def damped(v: Tensor) -> Tensor:
            return operator(v).add_(v, alpha=damping)  # a product is a fresh tensor

        result = conjugate_gradient(
            damped, -rhs, max_iters=self.max_iters, tol=self.tol, rtol=self.rtol,
            progress_tol=self.progress_tol, x0=self.x0, preconditioner=precond,
        )  # fmt: skip
        return _warned(result)


@dataclass(frozen=True)
class SampledDescent:
    r"""CG on every row, preconditioned by a sample of them (:mod:`~torch_sgn.solve.sampled`),
    to the relative residual :data:`~torch_sgn.solve.sampled.RTOL` in at most
    :data:`~torch_sgn.solve.sampled.ITERATIONS` iterations. Its result carries ``again``, the
    same solve for another right-hand side (the geodesic acceleration's)."""

    operator: Callable[[Tensor], Tensor]
    rhs: Tensor
    preconditioner: SampledPreconditioner

    def __call__(self, damping: float) -> CGResult:
        operator, precond = self.operator, self.preconditioner.preconditioner(damping)

        def damped(v: Tensor) -> Tensor:
            return operator(v).add_(v, alpha=damping)  # a product is a fresh tensor

        def solve(b: Tensor) -> CGResult:
            return conjugate_gradient(
                damped, b, max_iters=sampled.ITERATIONS, rtol=sampled.RTOL,
                preconditioner=precond,
            )  # fmt: skip

        result = _warned(solve(-self.rhs))
        if result.breakdown:
            return result
        return replace(result, again=lambda b: solve(-b).x)


def _warned(result: CGResult) -> CGResult:
    """``result``, with a warning where CG broke down."""
    if result.breakdown:
        logger.warning(
            "CG stopped early (%s) after %d iterations; using its last good iterate",
            result.reason, result.iterations,
        )  # fmt: skip
    return result


@dataclass(frozen=True)
class MatrixDescent:
    """Exactly, through ``G`` formed once (by ``matrix()``, which caches it) and factored at each
    damping, in float64."""

    matrix: Callable[[], Tensor]
    rhs: Tensor

    def __call__(self, damping: float) -> DirectResult:
        return _logged(direct.solve_damped(self.matrix(), self.rhs, damping), damping)


@dataclass(frozen=True)
class SampleSpaceDescent:
    """Exactly, through the ``R x R`` matrix ``J J^T`` of the batch's outputs (fewer than the
    parameters). The right-hand side must be the gradient ``J^T g_out`` itself (no momentum;
    with a weight decay, ``J^T g_out + lambda theta``, whose second term the space solves for):
    the route solves in output space."""

    space: SampleSpace
    rhs: Tensor
    operator: Callable[[Tensor], Tensor]

    def __call__(self, damping: float) -> DirectResult:
        result = direct.solve_in_sample_space(self.space, self.rhs, damping, self.operator)
        return _logged(result, damping)


def _logged(result: DirectResult, damping: float) -> DirectResult:
    if result.reason not in ("cholesky", "lu"):  # an indefinite G, or rounding
        logger.debug(
            "  the direct solve's factorization failed at damping %.3g; solved by the %s "
            "fallback",
            damping, result.reason,
        )  # fmt: skip
    return result
