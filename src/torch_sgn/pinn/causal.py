r"""Causal weighting of a residual block along time.

A time-dependent PINN trained on all times at once can settle where the equation holds at late
times that the initial condition does not lead to. Causal training splits the time range into
``M`` slabs, takes :math:`L_i`, the block's mean squared residual in slab ``i``, and weights
slab ``i`` by

.. math::
    w_i = \exp\Big(-\epsilon \sum_{k < i} L_k\Big), \qquad w_0 = 1,

so that a slab counts only once the slabs before it are fitted. The weights are held constant:
no gradient flows through them. A causal block's loss is then

.. math::
    \frac{w_b}{N_b} \sum_{n=1}^{N_b} w_{i(n)} \lVert r_b(\theta; x_n) \rVert^2
    = w_b \sum_i \frac{N_i}{N_b}\, w_i L_i,

``i(n)`` the slab of point ``n`` and ``N_i`` the points in slab ``i``.

:class:`Causal` is the setting (``Residual(..., causal=Causal(...))``); :func:`slab_weights` the
weights from the residuals, a pure function. :meth:`torch_sgn.pinn.Residuals.batch` computes
them once per step from the current parameters and hands them with the block's points, so the
step's linearization, trust-region ratio and line search all see one objective.

References:
    Wang, Sankaran and Perdikaris, "Respecting causality is all you need for training
    physics-informed neural networks", arXiv:2203.07404 (2022).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["ANNEAL_ABOVE", "Causal", "CausalWeights", "slab_weights"]

#: With a schedule of ``epsilon`` values, a block moves to the next one when every slab's
#: weight is above this (the paper's ``delta = 0.99``).
ANNEAL_ABOVE = 0.99


@dataclass(frozen=True)
class Causal:
    r"""Causal weighting of a residual block along time (see :mod:`torch_sgn.pinn.causal`).

    ::

        Residual(pde, points=xt, causal=Causal(time=-1, slabs=32, epsilon=1.0))

    Attributes:
        time: the column of the block's first point tensor (``N x d``) that is time; negative
            counts from the end (``-1``, the default: the last, as in DeepXDE's
            ``GeometryXTime``).
        slabs: ``M >= 1``, the number of slabs of equal width the time range is split into.
        epsilon: :math:`\epsilon \ge 0`, the causality parameter; ``0`` turns the weighting
            off (every weight 1). A sequence of values is the paper's schedule: the block starts
            at the first and moves to the next when every slab's weight is above
            :data:`ANNEAL_ABOVE` (checked at each :meth:`~torch_sgn.pinn.Residuals.batch`,
            as many values at once as pass), staying at the last. The place in the schedule is
            the problem's, not the optimizer's state: a fresh problem at fitted parameters
            finds it again at its first ``batch``.
        span: ``(t0, t1)``, the time range the slabs split (``None``: the smallest and largest
            time among the block's points at each step).
        schedule: the values of ``epsilon`` in order (one for a fixed ``epsilon``).

    Raises:
        ValueError: ``slabs`` not an integer ``>= 1``; an ``epsilon`` negative or not finite,
            or an empty schedule; a ``span`` with ``t1 <= t0``; ``time`` not an integer.

    References:
        Wang, Sankaran and Perdikaris, "Respecting causality is all you need for training
        physics-informed neural networks", arXiv:2203.07404 (2022).

    .. note::
        The paper weights slab means, :math:`\frac{1}{M}\sum_i w_i L_i`; here each point is
        weighted by its slab's weight and the block keeps its mean over points, which equals
        the paper's loss where the points are spread evenly over the slabs, and is what a
        subset of the points estimates without bias.
    """

    time: int = -1
    slabs: int = 32
    epsilon: Union[float, Tuple[float, ...]] = 1.0
    span: Optional[Tuple[float, float]] = None

    def __post_init__(self):
        if isinstance(self.time, bool) or not isinstance(self.time, int):
            raise ValueError(f"Causal: time={self.time!r} must be an integer column index")
        if isinstance(self.slabs, bool) or not isinstance(self.slabs, int) or self.slabs < 1:
            raise ValueError(f"Causal: slabs={self.slabs!r} must be an integer >= 1")
        schedule = self.schedule
        if not schedule:
            raise ValueError("Causal: epsilon is an empty schedule; give at least one value")
        for e in schedule:
            if isinstance(e, bool) or not isinstance(e, (int, float)):
                raise ValueError(f"Causal: epsilon={self.epsilon!r} must be numbers >= 0")
            if not (math.isfinite(e) and e >= 0):
                raise ValueError(
                    f"Causal: epsilon={self.epsilon!r} must be finite and >= 0 (0: no weighting)"
                )
        if not isinstance(self.epsilon, (int, float)):
            object.__setattr__(self, "epsilon", tuple(float(e) for e in schedule))
        if self.span is not None:
            t0, t1 = (float(t) for t in self.span)
            if not (math.isfinite(t0) and math.isfinite(t1) and t1 > t0):
                raise ValueError(f"Causal: span={self.span!r} must be (t0, t1) with t0 < t1")
            object.__setattr__(self, "span", (t0, t1))

    @property
    def schedule(self) -> Tuple[float, ...]:
        """The values of ``epsilon`` in order."""
        if isinstance(self.epsilon, (int, float)) and not isinstance(self.epsilon, bool):
            return (float(self.epsilon),)
        return tuple(self.epsilon) if isinstance(self.epsilon, Sequence) else ()


@dataclass(frozen=True)
class CausalWeights:
    """One causal block's weights at the last :meth:`~torch_sgn.pinn.Residuals.batch`.

    Attributes:
        epsilon: the causality parameter they were computed with.
        slabs: the slabs' weights :math:`w_i`, ``M`` of them, earliest first.
        losses: the slabs' mean squared residuals :math:`L_i` (0 for a slab without points).
    """

    epsilon: float
    slabs: Tensor
    losses: Tensor


def slab_weights(
    times: Tensor, squares: Tensor, slabs: int, epsilon: float, span: Optional[Sequence] = None
) -> Tuple[Tensor, Tensor, Tensor]:
    r"""The causal weights of the slabs and of each point.

    Args:
        times: each point's time, ``(N,)``.
        squares: each point's squared residual norm :math:`\lVert r_n \rVert^2`, ``(N,)``.
        slabs: ``M``.
        epsilon: :math:`\epsilon \ge 0`.
        span: ``(t0, t1)`` (``None``: the smallest and largest of ``times``); points outside it
            count in the first or the last slab.

    Returns:
        The slabs' weights :math:`w_i` (``M``), their mean squared residuals :math:`L_i`
        (``M``), and each point's weight :math:`w_{i(n)}` (``N``), all without gradient.
    """
    times, squares = times.detach(), squares.detach()
    t0, t1 = (times.min(), times.max()) if span is None else span
    width = float(t1 - t0)
    if width > 0:
        index = torch.floor((times - float(t0)) / width * slabs).long().clamp_(0, slabs - 1)
    else:
        index = torch.zeros_like(times, dtype=torch.long)
    sums = squares.new_zeros(slabs).index_add_(0, index, squares)
    counts = squares.new_zeros(slabs).index_add_(0, index, torch.ones_like(squares))
    losses = sums / counts.clamp(min=1)
    if epsilon == 0:  # exactly 1, whatever the residuals (NaN ones included)
        weights = torch.ones_like(losses)
    else:
        before = torch.cat([losses.new_zeros(1), torch.cumsum(losses, 0)[:-1]])
        weights = torch.exp(-epsilon * before)
    return weights, losses, weights[index]
