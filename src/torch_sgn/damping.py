"""Rules that set the Levenberg-Marquardt damping ``rho`` from one step to the next."""

from __future__ import annotations

import math

__all__ = ["DAMPING_SCHEDULES", "scheduled_damping", "trust_region_update"]

DAMPING_SCHEDULES = ("constant", "linear", "cosine")

#: Trust-region thresholds and factors (Nocedal & Wright, Alg. 4.1; as the original).
_SHRINK_BELOW, _EXPAND_ABOVE = 0.25, 0.75
_INCREASE, _DECREASE = 1.5, 2.0 / 3.0


def trust_region_update(damping: float, ratio: float, damping_min: float) -> float:
    r"""Adapts the damping from the ratio of actual to predicted reduction.

    .. math::
        \rho \leftarrow \begin{cases}
            \tfrac32\,\rho & \text{if } r < \tfrac14 \text{ (or } r \text{ is not finite)},\\
            \max(\tfrac23\,\rho,\ \rho_{\min}) & \text{if } r > \tfrac34,\\
            \rho & \text{otherwise.}
        \end{cases}

    A larger damping shortens the next step and bends it towards the gradient; a smaller one
    trusts the Gauss-Newton model more.

    .. note::
        A non-finite ratio (the loss at the trial point overflowed) counts as a failed
        prediction, so the damping grows; the original would have propagated the NaN.
    """
    if not math.isfinite(ratio) or ratio < _SHRINK_BELOW:
        return damping * _INCREASE
    if ratio > _EXPAND_ABOVE:
        return max(damping * _DECREASE, damping_min)
    return damping


def scheduled_damping(
    schedule: str, initial: float, damping_min: float, step: int, steps: int
) -> float:
    r"""The damping at ``step`` (0-based) of a fixed schedule, used when the trust region is off.

    * ``"constant"``: :math:`\rho_0`.
    * ``"linear"``: :math:`\rho_{\min} + (\rho_0 - \rho_{\min})(1 - t/K)` for :math:`t < K`,
      then :math:`\rho_{\min}`.
    * ``"cosine"``: :math:`\rho_{\min} + (\rho_0 - \rho_{\min})\cos(\tfrac{\pi}{2}\,t/K)` for
      :math:`t < K`, then :math:`\rho_{\min}`.

    .. note::
        The original's cosine rule is :math:`\rho_0 \cos(\tfrac{\pi}{2} t/K)` switched to
        :math:`\rho_{\min}` after :math:`K` steps; the form here reaches :math:`\rho_{\min}`
        continuously at :math:`t = K` and is identical when :math:`\rho_{\min} = 0`.
    """
    if schedule == "constant":
        return initial
    if step >= steps:
        return damping_min
    frac = step / steps
    if schedule == "linear":
        decay = 1.0 - frac
    elif schedule == "cosine":
        decay = math.cos(0.5 * math.pi * frac)
    else:
        raise ValueError(f"unknown damping schedule {schedule!r}; use one of {DAMPING_SCHEDULES}")
    return damping_min + (initial - damping_min) * decay
