"""Backtracking line search with the Armijo sufficient-decrease condition."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["LineSearchResult", "backtracking"]


@dataclass(frozen=True)
class LineSearchResult:
    """Outcome of :func:`backtracking`.

    Attributes:
        step: the accepted fraction ``a`` of the proposed step.
        loss: the loss at ``a``.
        evaluations: loss evaluations made (a value handed in through ``first`` counts too).
        success: whether the Armijo condition held at ``step``.
    """

    step: float
    loss: float
    evaluations: int
    success: bool


def backtracking(
    loss_at: Callable[[float], float],
    loss0: float,
    slope: float,
    *,
    c: float = 1e-4,
    shrink: float = 0.5,
    max_evals: int = 10,
    first: Optional[float] = None,
    floor: float = 0.0,
) -> LineSearchResult:
    r"""Shrinks ``a`` from 1 until the Armijo condition holds (Nocedal & Wright, Alg. 3.1).

    .. math::
        L(\theta + a\,s) \le L(\theta) + c\,a\,\nabla L^\top s,\qquad a \in \{1, \tfrac12,
        \tfrac14, \dots\}

    Args:
        loss_at: ``a -> L(theta + a s)`` on the step's mini-batch.
        loss0: ``L(theta)``.
        slope: the directional derivative ``m_hat . s`` along the step (negative for a
            descent direction; with gradient momentum the original uses ``m_hat``).
        c: sufficient-decrease constant (``C_LS``).
        shrink: factor applied to ``a`` after each rejection (``RHO_LS``).
        max_evals: at most this many loss evaluations (``MAX_LS_ITERS``).
        first: ``L(theta + s)`` if already known (the trust-region test computes it), which
            saves one evaluation.
        floor: the rounding of the loss: the search gives up (``success=False``) rather than
            try an ``a`` whose predicted decrease :math:`|a\, \nabla L^\top s|` is at most
            this, where a comparison of losses says nothing. 0: off.

    Returns:
        A :class:`LineSearchResult`. If no trial passes, the last (smallest) one is returned
        with ``success=False``, as the original keeps the last step size it tried.
    """
    a = 1.0
    loss = first if first is not None else loss_at(a)
    evaluations = 1
    while True:
        if math.isfinite(loss) and loss <= loss0 + c * a * slope:
            return LineSearchResult(a, loss, evaluations, True)
        if evaluations >= max_evals or -a * shrink * slope <= floor:
            return LineSearchResult(a, loss, evaluations, False)
        a *= shrink
        loss = loss_at(a)
        evaluations += 1
