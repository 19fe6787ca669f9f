r"""Exact Gauss-Newton steps on many residuals: samples of the rows, and conjugate gradient on
all the rows preconditioned by the Gauss-Newton matrix of a random subset of them.

:mod:`torch_sgn.route_plan` plans the stages (exact steps on samples, then on all rows, and
when each stalls); this module holds what the steps take of them: how a sample is drawn
(:func:`allocate`, :func:`draw`) and the last stage's preconditioner
(:class:`SampledPreconditioner`), described below.

Where a least-squares problem has more residuals ``R`` than an exact step can take through the
``R x R`` Gram matrix, and more parameters ``P`` than it can take through the ``P x P`` matrix
(a PINN of 10,000 parameters on 10,000 or 1,000,000 points), SGN still solves the full
problem's damped system

.. math::
    (G + \rho I)\, d = -g, \qquad G = J^\top H J,

on every row, by conjugate gradient: each iteration is one product ``J^T H J v`` over all the
rows, matrix-free, and no matrix larger than ``m x m`` is formed. What makes a few iterations
enough is the preconditioner (sketch-and-precondition: Rokhlin and Tygert 2008, Avron,
Maymounkov and Toledo 2010, with row sampling in place of a dense sketch): the Gauss-Newton
matrix of ``m`` rows drawn at random, each block's rows weighted by ``N_b / n_b`` (its points
over the points drawn from it) so that it estimates ``G`` without bias,

.. math::
    M = h\, \tilde J^\top \tilde J + \mu I, \qquad \tilde J = D^{1/2} J_S, \qquad
    \mu = \rho + \tau,

applied through the ``m x m`` matrix :math:`\tilde K = \tilde J \tilde J^\top` by the
push-through identity

.. math::
    M^{-1} v = \frac1\mu \Big(v - \tilde J^\top \big(\tfrac\mu h I + \tilde K\big)^{-1}
    \tilde J v\Big),

with one eigendecomposition of :math:`\tilde K` per step serving every damping. ``h`` is the
loss's output-space Hessian, a multiple of the identity (squared errors). The shift
:math:`\tau = h \lambda_{\min}` (the smallest eigenvalue of :math:`\tilde K` above its
rounding) treats the directions the sample does not see as curved like the least-curved
direction it does see, as the Nystrom preconditioner does (Frangella, Tropp, Udell 2023):
without it a small damping makes the preconditioner's inverse huge there.

The step's first CG iterate is the sampled exact step with the full gradient, minimized along
its line on the full model; further iterations converge to the full problem's exact step. A
fixed point of the steps is a stationary point of the full problem: no sampling noise remains
(unlike exact steps on a sample of the rows alone, whose iterates wander in a neighbourhood of
the minimizer whose size the sample's noise sets).

The rows are drawn from a generator seeded by the step, so that a resumed run draws the same
rows. Every block keeps at least its share of the sample (:func:`allocate`): the few boundary
points of a PINN, whose rows carry a larger weight, are drawn as surely as the many interior
ones.
"""

from __future__ import annotations

import math
from typing import Callable, List, Sequence

import torch
from torch import Tensor

from ..linearization import RowSample

__all__ = [
    "ITERATIONS", "POINTS", "ROWS_PER_PARAMETER", "RTOL", "SampledPreconditioner", "allocate",
    "draw",
]  # fmt: skip

#: The points of a sample (all rows of a point are taken): the first sample of the exact
#: sampled steps (:mod:`torch_sgn.route_plan` doubles it at each stall) and the sample of the
#: preconditioner. Its ``m x m`` matrix costs ``2 m^2`` products of a row with a row, and its
#: factorization ``m^3 / 3``; never more rows than ``SGN(direct_max_params)``.
POINTS = 1024
#: Rows per parameter from which a problem whose ``P x P`` matrix fits takes the stages too:
#: forming ``G`` from all ``R`` rows costs ``R P^2``, ``R / P`` times its factorization, for a
#: step that a sample of the rows estimates well (DeepXDE's Klein_Gordon example, 33,000 rows
#: for 1,801 parameters: 7 s a step on all rows; ``docs/PINN.md#many-points``).
ROWS_PER_PARAMETER = 16
#: Conjugate gradient's iterations on all the rows, at most, per solve.
ITERATIONS = 20
#: ... and its relative residual: ``||(G + rho I) d + g|| <= RTOL ||g||`` ends it.
RTOL = 1e-3


def allocate(counts: Sequence[int], total: int) -> List[int]:
    """How many of each block's ``counts`` points a sample of at most ``total`` points draws
    (at least one of each block): in proportion to the counts, but at least ``total / (2 B)``
    of each of the ``B`` blocks (all of a smaller one), so that a block of few points is not
    left to chance; the largest block gives up what that adds."""
    blocks = sum(1 for c in counts if c > 0)
    if blocks == 0:
        return [0 for _ in counts]
    total = max(total, blocks)
    everything = sum(counts)
    floor = math.ceil(total / (2 * blocks))
    out = [min(c, max(floor, round(total * c / everything))) for c in counts]
    while sum(out) > total:  # the floors pushed it over: the largest block gives way
        largest = max(range(len(out)), key=lambda b: out[b])
        out[largest] -= min(sum(out) - total, out[largest] - 1)
    return out


def draw(counts: Sequence[int], total: int, seed: int, device: torch.device) -> List[Tensor]:
    """The points of each block a step samples: :func:`allocate`'s numbers, drawn without
    replacement by a generator seeded with ``seed`` (the step), sorted."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for count, n in zip(counts, allocate(counts, total)):
        if n >= count:
            idx = torch.arange(count)
        else:
            idx = torch.randperm(count, generator=gen)[:n].sort().values
        out.append(idx.to(device))
    return out


class SampledPreconditioner:
    """``damping -> (v -> M^{-1} v)`` from a :class:`RowSample` (see the module's docstring):
    one eigendecomposition of the sample's ``m x m`` matrix, shared by a step's dampings."""

    def __init__(self, sample: RowSample):
        self.sample = sample
        lam, vec = torch.linalg.eigh(sample.kernel)
        lam = lam.clamp_min(0.0)
        top = float(lam[-1]) if lam.numel() else 0.0
        seen = lam[lam > sample.kernel.shape[0] * torch.finfo(lam.dtype).eps * top]
        #: tau: the least curvature the sample sees (0 where it sees none)
        self.shift = sample.hessian * float(seen[0]) if seen.numel() else 0.0
        self.eigenvalues, self.eigenvectors = lam, vec

    def preconditioner(self, damping: float) -> Callable[[Tensor], Tensor]:
        sample, vec = self.sample, self.eigenvectors
        mu = damping + self.shift
        if not mu > 0:  # no damping and a sample that sees nothing: no preconditioner
            return lambda v: v.clone()
        scale = 1.0 / (mu / sample.hessian + self.eigenvalues)

        def apply(v: Tensor) -> Tensor:
            w = vec @ (scale * (vec.T @ sample.jvp(v)))
            return (v - sample.vjp(w)).div_(mu)

        return apply
