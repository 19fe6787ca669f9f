"""Rules that set the Levenberg-Marquardt damping ``rho`` from one step to the next."""

from __future__ import annotations

import math

__all__ = [
    "CG_DAMPING_MIN",
    "DAMPING_SCHEDULES",
    "DIRECT_DAMPING_MIN",
    "DAMPING_UPDATES",
    "nielsen_update",
    "rejected_update",
    "scheduled_damping",
    "trust_region_update",
]

DAMPING_SCHEDULES = ("constant", "linear", "cosine")

#: The rules that adapt the damping from the trust-region ratio: ``"nielsen"``
#: (:func:`nielsen_update`) and ``"threshold"`` (:func:`trust_region_update`, the paper's).
DAMPING_UPDATES = ("nielsen", "threshold")

#: A damping grown past this is held there: it is already a plain gradient step of negligible
#: length, and growing further would overflow.
DAMPING_MAX = 1e16

#: The damping floor where ``SGN(damping_min=None)`` (the default) leaves it to the solver that
#: runs. CG: the paper's 1e-6; its inexact steps gain nothing from a smaller damping. An exact
#: solve: low enough that the damping never stops a fit to high precision (``docs/SOLVERS.md``);
#: growth after a failed step keeps it stable.
CG_DAMPING_MIN = 1e-6
DIRECT_DAMPING_MIN = 1e-15

#: The first growth factor of a run of rejected steps (Nielsen, 1999), doubled at each.
GROWTH_START = 2.0

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


def nielsen_update(damping: float, ratio: float, damping_min: float) -> float:
    r"""The damping after an accepted step, by Nielsen's (1999) smooth rule.

    .. math::
        \rho \leftarrow \max\Bigl(\rho \cdot \max\bigl(\tfrac13,\ 1 - (2r - 1)^3\bigr),\
            \rho_{\min}\Bigr)

    A ratio ``r`` near 1 (the quadratic model predicted the loss well) divides the damping by
    3; ``r = 1/2`` keeps it; a small positive ``r`` raises it, at most twofold. Unlike the
    threshold rule there is no band in which the damping is stuck, so it can fall by many
    orders of magnitude within a few dozen good steps, which a high-precision fit needs.
    A rejected step is handled by :func:`rejected_update`.

    References:
        H. B. Nielsen. Damping parameter in Marquardt's method. IMM-REP-1999-05, Technical
        University of Denmark, 1999. K. Madsen, H. B. Nielsen, O. Tingleff. Methods for
        non-linear least squares problems, 2nd ed., 2004, eq. (3.16).
    """
    factor = max(1.0 / 3.0, 1.0 - (2.0 * ratio - 1.0) ** 3) if math.isfinite(ratio) else 2.0
    return min(max(damping * factor, damping_min), DAMPING_MAX)


def rejected_update(damping: float, growth: float) -> tuple[float, float]:
    r"""The damping after a rejected step and the next growth factor (Nielsen, 1999).

    .. math::
        \rho \leftarrow \nu \rho,\qquad \nu \leftarrow 2 \nu,

    with :math:`\nu` reset to 2 by the next accepted step: successive failures raise the
    damping by 2, 4, 8, ... (a factor 1024 after four), so a damping that fell too far
    recovers within a few re-solves. Capped at :data:`DAMPING_MAX`.
    """
    return min(damping * growth, DAMPING_MAX), min(2.0 * growth, DAMPING_MAX)


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
