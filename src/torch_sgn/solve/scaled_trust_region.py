r"""MINPACK's Levenberg-Marquardt step: a trust region of radius :math:`\Delta` in parameters
scaled by the columns of ``J`` (Moré, 1978), for small exact curve fits.

SGN's damping is one number :math:`\rho` added to every direction alike, :math:`(G + \rho I)`.
On a fit whose parameters differ in scale by orders of magnitude and whose path to the minimum
runs along a curved valley, that damping lets one step leave the region where the model holds
(into a plateau where the residuals no longer depend on the parameters) or crawls. MINPACK's
``lmder`` (the method of scipy's ``least_squares(method="lm")``) scales each parameter by the
largest norm its column of ``J`` has had, :math:`D = \mathrm{diag}(\max_k \lVert J_{:,j}
\rVert)`, and bounds the scaled step, :math:`\lVert D p \rVert \le \Delta`:

.. math::
    p = -(J^\top J + \lambda D^2)^{-1} J^\top r, \qquad \lambda \ge 0 \text{ the smallest with }
    \lVert D p \rVert \le 1.1\,\Delta,

found here from the eigendecomposition of :math:`D^{-1} J^\top J D^{-1}` (a few parameters),
within 10% of :math:`\Delta` as ``lmpar`` does. :func:`update` shrinks or widens
:math:`\Delta` from the ratio of actual to predicted reduction by MINPACK's rules, and a trial
point is taken when that ratio is at least ``1e-4``.

:class:`~torch_sgn.curve_steps.CurveSteps` takes these steps where SGN's ended on a plateau
(:func:`torch_sgn.least_squares`).

References:
    J. J. Moré. The Levenberg-Marquardt algorithm: implementation and theory. Numerical
    Analysis, Lecture Notes in Mathematics 630, 1978. J. J. Moré, B. S. Garbow, K. E.
    Hillstrom. User Guide for MINPACK-1. Argonne ANL-80-74, 1980 (``lmder``, ``lmpar``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ACCEPT", "FACTOR", "Radius", "Scaled", "update"]

#: A trial point is taken where the ratio of actual to predicted reduction is at least this.
ACCEPT = 1e-4
#: The first radius: this times the scaled norm of the start (MINPACK's ``factor``).
FACTOR = 100.0


@dataclass
class Radius:
    """The trust region's state: the scaling ``D`` (the largest column norms of ``J`` so
    far), the radius :math:`\\Delta`, and whether no step was tried yet."""

    scale: Tensor
    radius: float
    first: bool = True

    @staticmethod
    def start(theta: Tensor, jac: Tensor) -> Radius:
        norms = torch.linalg.vector_norm(jac, dim=0)
        scale = torch.where(norms > 0, norms, torch.ones_like(norms))
        size = float(torch.linalg.vector_norm(scale * theta))
        return Radius(scale, FACTOR * size if size > 0 else FACTOR)

    def rescaled(self, jac: Tensor) -> None:
        """``D`` after a new ``J``: the running maximum of its column norms."""
        self.scale = torch.maximum(self.scale, torch.linalg.vector_norm(jac, dim=0))


@dataclass(frozen=True)
class Scaled:
    r"""One step's ``J^T J`` and ``J^T r`` in the parameters scaled by ``D``, by the
    eigendecomposition of :math:`D^{-1} J^\top J D^{-1}`: the step at any radius (the trials
    of one step share it)."""

    values: Tensor  # eigenvalues, clipped at 0
    vectors: Tensor
    coefficients: Tensor  # V^T D^-1 J^T r
    scale: Tensor  # D

    @staticmethod
    def of(jac: Tensor, cost_grad: Tensor, scale: Tensor) -> Scaled:
        matrix = (jac / scale).T @ (jac / scale)
        values, vectors = torch.linalg.eigh(0.5 * (matrix + matrix.T))
        return Scaled(values.clamp_min(0.0), vectors, vectors.T @ (cost_grad / scale), scale)

    def step(self, radius: float) -> tuple[Tensor, float]:
        r"""The step ``p`` within the radius and its damping :math:`\lambda`: the
        Gauss-Newton step where it is no longer than :math:`1.1\,\Delta`, else the damped
        step of scaled length within 10% of :math:`\Delta` (bisection on
        :math:`\log\lambda`; the lengths in Python floats, a few parameters)."""
        values, coefficients = self.values.tolist(), self.coefficients.tolist()

        def length(damping: float) -> float:  # ||D p(damping)||
            return math.sqrt(sum((c / (v + damping)) ** 2 for v, c in zip(values, coefficients)))

        damping = 0.0
        if not (min(values) > 0 and length(0.0) <= 1.1 * radius):
            low, high = 0.0, 1.0
            while length(high) > radius:
                high *= 10.0
            for _ in range(200):  # the length falls monotonically in the damping
                damping = math.sqrt(max(low, high * 1e-12) * high)
                size = length(damping)
                if abs(size - radius) <= 0.1 * radius:
                    break
                low, high = (damping, high) if size > radius else (low, damping)
            else:
                damping = high
        return self.solve(self.coefficients, damping), damping

    def solve(self, coefficients: Tensor, damping: float) -> Tensor:
        r""":math:`-(J^\top J + \lambda D^2)^{-1} b` for ``coefficients`` :math:`= V^\top
        D^{-1} b`."""
        return -(self.vectors @ (coefficients / (self.values + damping))) / self.scale

    def acceleration(self, b: Tensor, damping: float) -> Tensor:
        r"""The geodesic acceleration :math:`a = -(J^\top J + \lambda D^2)^{-1} b` of the step
        at ``damping``, for :math:`b = J^\top r_{vv}` (Transtrum and Sethna, 2012)."""
        return self.solve(self.vectors.T @ (b / self.scale), damping)


def update(
    state: Radius, step: Tensor, damping: float, jac: Tensor, cost: float, cost_after: float
) -> float:
    """MINPACK's radius update after a trial of ``step`` (``lmder``): the ratio of the actual
    to the predicted reduction of the cost (returned), the radius shrunk where it is at most
    1/4 (by a factor from the directional derivative, between 1/10 and 1/2), widened to twice
    the step where it is at least 3/4 or the step is Gauss-Newton's."""
    length = float(torch.linalg.vector_norm(state.scale * step))
    if state.first:  # the first radius is at most the first step
        state.radius, state.first = min(state.radius, length), False
    norm = math.sqrt(2 * cost)
    norm_after = math.sqrt(2 * cost_after) if cost_after < math.inf else math.inf  # (NaN too)
    actual = 1 - (norm_after / norm) ** 2 if 0.1 * norm_after < norm else -1.0
    linear = float(torch.linalg.vector_norm(jac @ step)) / norm
    damped = math.sqrt(damping) * length / norm
    predicted = linear**2 + damped**2 / 0.5
    slope = -(linear**2 + damped**2)
    ratio = actual / predicted if predicted != 0 else 0.0
    if ratio <= 0.25:
        shrink = 0.5 if actual >= 0 else 0.5 * slope / (slope + 0.5 * actual)
        if 0.1 * norm_after >= norm or shrink < 0.1:
            shrink = 0.1
        state.radius = shrink * min(state.radius, length / 0.1)
    elif damping == 0 or ratio >= 0.75:
        state.radius = length / 0.5
    return ratio
