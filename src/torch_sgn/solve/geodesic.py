r"""Geodesic acceleration of exact Levenberg-Marquardt steps (Transtrum and Sethna, 2012).

A Gauss-Newton step ``v`` solves the damped system of the linearized model, so it misses
the curvature of the model's outputs along ``v``. Where the fit to a smooth target winds
along a narrow curved valley (a small network fitted to high precision), the linear model's
steps shrink to a crawl. Geodesic acceleration adds the second-order term of the path that
keeps the outputs' velocity ``J v``: the step becomes

.. math::
    \delta = v + \tfrac12 a, \qquad (G + \rho I)\, a = -J^\top H f_{vv},

with :math:`f_{vv}` the second directional derivative of the outputs along ``v``, taken here by
a central difference, :math:`(f(\theta + h v) - 2 f(\theta) + f(\theta - h v)) / h^2`, two
forward passes beside the step's own; where ``J v`` is at hand (a curve fit's ``J`` formed
whole), by the one-sided difference :math:`2 (f(\theta + h v) - f(\theta) - h J v) / h^2`, one
pass (Transtrum and Sethna's choice; its error is :math:`O(h)` against the central one's
:math:`O(h^2)`). The system is the step's own, so its factorization serves again: one more
solve. The term is kept only while it is small against the step,
:math:`2\lVert a \rVert \le \alpha \lVert v \rVert` (their :math:`\alpha = 0.75`), and only
where the difference stands above the rounding of the outputs (in float32 near a precise fit
it would be noise). Then ``v`` alone is the step, or with ``geodesic_acceleration="strict"``
(:attr:`~torch_sgn.solve.step.DampingRule.strict_acceleration`) an ``a`` too large rejects the
attempt, as in Transtrum and Sethna's algorithm: it is solved again with more damping.

The trust-region ratio and the line search's slope are those of ``v``; the line search
backtracks along the parabola :math:`s v + \tfrac{s^2}{2} a`, whose slope at 0 is ``v``'s.

Reference:
    M. K. Transtrum and J. P. Sethna. Improvements to the Levenberg-Marquardt algorithm for
    nonlinear least-squares minimization. arXiv:1201.5885, 2012.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

from .direct import DirectResult

__all__ = [
    "NOISE",
    "RATIO",
    "STEP",
    "TOO_LARGE",
    "TooLarge",
    "above_rounding",
    "accelerator",
    "accepted",
    "second_difference",
    "wanted",
]

#: The largest ``2 |a| / |v|`` for which the acceleration is used (Transtrum and Sethna's
#: :math:`\alpha`).
RATIO = 0.75


class TooLarge:
    """What :func:`accelerator` gives for an ``a`` above :data:`RATIO` against the step (where
    the caller may reject the attempt, Transtrum and Sethna's rule) rather than ``None``."""

    def __repr__(self) -> str:
        return "TOO_LARGE"


#: The one :class:`TooLarge`.
TOO_LARGE = TooLarge()

#: The central difference's step along ``v`` (theirs: 0.1).
STEP = 0.1

#: The second difference is used only where it exceeds this many units of rounding of the
#: outputs (``eps`` times their size).
NOISE = 100.0


def wanted(option: Union[None, bool, str], dtype: torch.dtype) -> bool:
    """Whether exact steps take the acceleration under SGN's ``geodesic_acceleration`` option:
    ``None`` (the default) for float64 parameters only, otherwise as set (``"strict"``: on)."""
    return dtype == torch.float64 if option is None else bool(option)


def second_difference(
    outputs_at: Callable[[Tensor], Tensor],
    theta: Tensor,
    v: Tensor,
    centre: Tensor,
    h: float = STEP,
    jvp: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Tensor, Tensor]:
    r""":math:`f_{vv} \approx (f(\theta + h v) - 2 f(\theta) + f(\theta - h v)) / h^2`, or with
    ``jvp`` :math:`2 (f(\theta + h v) - f(\theta) - h J v) / h^2`, and what
    :func:`above_rounding` judges it by.

    Args:
        outputs_at: ``flat -> f(flat)``, the outputs on the step's batch.
        theta: the point.
        v: the direction.
        centre: ``outputs_at(theta)``, computed by the same function (so that the difference
            cancels exactly where ``f`` is linear along ``v``).
        h: the step of the difference.
        jvp: ``v -> J v`` at ``theta`` (outputs-shaped), for the one-sided difference; ``None``:
            the central one.

    Returns:
        ``f_vv`` and the squared norms of the difference and of the three terms it sums (in
        float64; a sum over the samples, so shards of a batch add theirs up).
    """
    plus = outputs_at(theta + h * v)
    if jvp is None:
        other = outputs_at(theta - h * v)
        difference = plus - 2 * centre + other
    else:  # half the difference, whose terms' rounding above_rounding weighs alike
        other = h * jvp(v)
        difference = plus - centre - other
    terms = torch.stack([difference, plus, centre, other]).double()
    norms = terms.square().reshape(4, -1).sum(dim=1)
    if jvp is None:
        return difference / (h * h), norms
    return difference * (2.0 / (h * h)), norms


def above_rounding(norms: Tensor, dtype: torch.dtype) -> bool:
    """Whether the second difference (squared norms from :func:`second_difference`) is finite
    and above :data:`NOISE` units of the outputs' rounding in ``dtype``: else it says nothing
    about the curvature (outputs linear along the step, or float32 near a precise fit)."""
    size, plus, centre, other = norms.sqrt().tolist()
    scale = plus + 2 * centre + other
    if not (size == size and scale < float("inf")):  # NaN or overflow
        return False
    return size > NOISE * torch.finfo(dtype).eps * scale


def accepted(v: Tensor, a: Tensor) -> Optional[Tensor]:
    r"""``a`` where it is finite and :math:`2\lVert a \rVert \le` :data:`RATIO`
    :math:`\lVert v \rVert`, else ``None``."""
    size, step = torch.stack([torch.linalg.vector_norm(a), torch.linalg.vector_norm(v)]).tolist()
    if not size == size or not 2 * size <= RATIO * step:  # NaN fails both
        return None
    return a


def accelerator(
    theta: Tensor,
    outputs_at: Callable[[Tensor], Tensor],
    hessian_at: Callable[[Tensor], Callable[[Tensor], Tensor]],
    vjp: Optional[Callable[[Tensor], Tensor]],
    share: Callable[..., tuple[Tensor, Tensor]],
    size: int,
    scale: float,
    mask: Optional[Tensor] = None,
    centre: Optional[Tensor] = None,
    jvp: Optional[Callable[[Tensor], Tensor]] = None,
) -> Callable[[DirectResult], Union[Tensor, TooLarge, None]]:
    r"""``result -> scale * a``, the acceleration's term of one exact solve of the step at
    ``theta`` (``None`` where it is not used: no factorization to solve again, a breakdown or a
    difference within rounding; :data:`TOO_LARGE` where ``a`` fails :func:`accepted`).

    Args:
        theta: the point.
        outputs_at: ``flat -> outputs`` on the step's batch, with the step's random numbers.
        hessian_at: ``outputs -> (t -> H t)``, the loss's Hessian in output space.
        vjp: output-shaped ``u -> J^T u`` at ``theta``; ``None`` where the solve takes its
            right-hand side in output space (through the batch's outputs).
        share: ``(compute, sizes, what) -> (mean, sum)``, the data-parallel communicator's
            reduction of each rank's ``J^T H f_vv`` and norms
            (:meth:`~torch_sgn.distributed.SingleProcess.shares`).
        size: the length of the right-hand side (``P``, or the batch's outputs ``R``).
        scale: ``lr^2 / 2``: the term enters the step as ``s d + s^2 scale a``.
        mask: 1 at the parameters still trainable (``None``: all are).
        centre: ``outputs_at(theta)`` where the caller has it (equal to it bit for bit), else
            ``None``: computed at the first use, and shared by the step's attempts.
        jvp: ``v -> J v`` at ``theta``, where the caller has ``J``: the one-sided difference
            (one evaluation instead of two).
    """

    def curve(result: DirectResult) -> Union[Tensor, TooLarge, None]:
        if result.again is None or result.breakdown:
            return None
        v = result.x

        def local() -> tuple[Tensor, Tensor]:  # (J^T) H f_vv and the rounding's norms
            nonlocal centre
            if centre is None:
                centre = outputs_at(theta)
            fvv, norms = second_difference(outputs_at, theta, v, centre, jvp=jvp)
            hf = hessian_at(centre)(fvv)
            if vjp is None:
                return hf, norms
            b = vjp(hf)
            return (b if mask is None else b * mask), norms

        b, norms = share(local, (size, 4), "the geodesic acceleration")
        if not above_rounding(norms, theta.dtype):
            return None
        a = accepted(v, result.again(b))
        return TOO_LARGE if a is None else a.mul_(scale)

    return curve
