r"""One damped step: the Levenberg-Marquardt attempts, the trust region and the line search;
the damping rules and the Armijo line search it applies.

Given a descent (:mod:`~torch_sgn.solve.descents`, ``damping -> d``) and the step's local
problem (gradient, right-hand side, loss at the point and at trial points),
:func:`damped_step` runs

1. the attempts: solve at the damping :math:`\rho`, evaluate the loss at the full step
   :math:`s = \alpha d` and test the Armijo condition there; a failed attempt is solved again
   with a larger damping (:meth:`DampingRule.rejected`), up to ``attempts`` solves (with
   :attr:`DampingRule.strict_acceleration`, so is one whose geodesic acceleration is too large
   against its step);
2. the trust region: the ratio of the actual to the predicted change at the last attempt's
   full step sets the next step's damping (:meth:`DampingRule.after`);
3. the line search: Armijo backtracking along the last attempt's step, its first trial the
   loss already known;
4. with ``reject_uphill`` (:attr:`DampingRule.uphill_resolves`), no uphill step: a step whose
   line search ends above the starting loss (or at a non-finite one) is solved again from 1.
   with a larger damping (:meth:`DampingRule.raised`), up to :data:`UPHILL_RESOLVES` times,
   and is rejected (:attr:`Outcome.rejected`) if it still ends above it. Downhill steps never
   reach this stage, so they cost and compute exactly what they did without it.

Nothing is written: the result (:class:`Outcome`) is the optimizer's to commit.

The damping rules (:func:`trust_region_update`, the paper's threshold rule; Nielsen's
:func:`nielsen_update` and :func:`rejected_update`; :func:`scheduled_damping` with the trust
region off) and the backtracking Armijo search (:func:`backtracking`) are pure functions of
numbers, written before the step that applies them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

from .descents import TOO_LARGE, Accelerate, Descent, Result
from .state import GROWTH_START, StepState

if TYPE_CHECKING:
    from ..options import Options

__all__ = [
    "CG_DAMPING_MIN", "DAMPING_MAX", "DIRECT_DAMPING_MIN", "UPHILL_RESOLVES", "DampingRule",
    "LineSearch", "LineSearchResult", "Outcome", "Problem", "Solution", "Trial", "backtracking",
    "damped_step", "damping_floor", "nielsen_update", "rejected_update", "rounding",
    "scheduled_damping", "trust_region_update",
]  # fmt: skip

logger = logging.getLogger("torch_sgn")

#: Re-solves of an uphill step (``reject_uphill=True``) before it is rejected. Each raises the
#: damping at least by the line search's whole range (512 with the default ``ls_shrink`` and
#: ``ls_max_evals``), so three reach a damping 1e8 times the first: a plain gradient step of
#: any length the problem needs.
UPHILL_RESOLVES = 3


# --- the damping rules --------------------------------------------------------------------
#: A damping grown past this is held there: it is already a plain gradient step of negligible
#: length, and growing further would overflow.
DAMPING_MAX = 1e16

#: The damping floor where ``SGN(damping_min=None)`` (the default) leaves it to the solver that
#: runs. CG: the paper's 1e-6; its inexact steps gain nothing from a smaller damping. An exact
#: solve: low enough that the damping never stops a fit to high precision (``docs/SOLVERS.md``);
#: growth after a failed step keeps it stable.
CG_DAMPING_MIN = 1e-6
DIRECT_DAMPING_MIN = 1e-15

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
        raise ValueError(
            f"unknown damping schedule {schedule!r}; use 'constant', 'linear' or 'cosine'"
        )
    return damping_min + (initial - damping_min) * decay


# --- the line search ----------------------------------------------------------------------
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


# --- the damped step ----------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    r"""The step's local problem at :math:`\theta`.

    Attributes:
        grad: the mini-batch gradient ``g`` (the predicted change's linear term).
        rhs: :math:`\hat m`, the right-hand side the descent solved for (``g`` without
            momentum); the line search's slope is :math:`\hat m^\top s`.
        loss0: the mini-batch loss at :math:`\theta`.
        loss_at: ``(displacement, a) -> loss`` at :math:`\theta` + displacement on the same batch
            (``a``, the line search's factor, for the log).
    """

    grad: Tensor
    rhs: Tensor
    loss0: float
    loss_at: Callable[..., float]

    @property
    def descends(self) -> bool:
        """Whether ``-rhs``, the direction a large damping turns the step to, descends on the
        batch: always without momentum (``rhs`` is ``grad``)."""
        return self.rhs is self.grad or float(torch.dot(self.grad, self.rhs)) > 0


def rounding(loss0: float, dtype: torch.dtype) -> float:
    """The loss's rounding: changes of ``loss0`` this small are noise (``100 eps |loss0|``)."""
    return 100 * torch.finfo(dtype).eps * max(abs(loss0), torch.finfo(dtype).tiny)


@dataclass(frozen=True)
class LineSearch:
    """The step length: ``lr`` times the backtracking factor (``line_search`` on) or 1.
    ``above_rounding``: backtracking stops where the predicted decrease falls to the loss's
    :func:`rounding` (the curve-fit driver's steps, :mod:`torch_sgn.curve_steps`)."""

    lr: float
    on: bool
    c: float
    shrink: float
    max_evals: int
    above_rounding: bool = False

    @classmethod
    def of(cls, options: Options) -> LineSearch:
        return cls(
            options.lr, options.line_search, options.ls_c, options.ls_shrink,
            options.ls_max_evals,
        )  # fmt: skip


def damping_floor(damping_min: Optional[float], exact: bool) -> float:
    """The damping floor of a step: ``damping_min``, or where it is ``None`` the floor of the
    solver that runs (:data:`CG_DAMPING_MIN`,
    :data:`DIRECT_DAMPING_MIN`)."""
    if damping_min is not None:
        return damping_min
    return DIRECT_DAMPING_MIN if exact else CG_DAMPING_MIN


@dataclass(frozen=True)
class DampingRule:
    """Which damping a step starts from, how a rejected attempt raises it, and which damping
    the next step carries (the trust region, or a fixed schedule without it).

    Attributes:
        trust_region: adapt the damping from the trust-region ratio.
        update: ``"threshold"`` (:func:`trust_region_update`) or ``"nielsen"``
            (:func:`nielsen_update`).
        floor: the step's floor (:func:`damping_floor`).
        attempts: most solves in one step's Levenberg-Marquardt attempts.
        schedule, initial, decay_steps: the schedule used with the trust region off.
        uphill_resolves: re-solves of a step that ends above its starting loss before it is
            rejected (``reject_uphill=True``: :data:`UPHILL_RESOLVES`); ``None``: such a step
            is taken, as in the paper.
        strict_acceleration: an attempt whose geodesic acceleration is too large against its
            step is rejected, within ``attempts`` (``geodesic_acceleration="strict"``), rather
            than taken without the acceleration.
    """

    trust_region: bool
    update: str
    floor: float
    attempts: int
    schedule: str
    initial: float
    decay_steps: int
    uphill_resolves: Optional[int] = None
    strict_acceleration: bool = False

    @classmethod
    def of(cls, options: Options, exact: bool) -> DampingRule:
        """The rule of a step by an exact route (``exact``) or by CG, from SGN's options."""
        return cls(
            options.trust_region, options.damping_update,
            damping_floor(options.damping_min, exact), options.attempts,
            options.damping_schedule, options.damping, options.damping_decay_steps,
            UPHILL_RESOLVES if options.reject_uphill else None,
            options.geodesic_acceleration == "strict",
        )  # fmt: skip

    def start(self, state: StepState) -> tuple[float, float]:
        """The first attempt's damping, and Nielsen's growth factor."""
        damping = state.damping
        growth = GROWTH_START if damping.growth is None else damping.growth
        if self.trust_region:
            return max(damping.value, self.floor), growth  # CG's floor after the direct solver's
        damping = scheduled_damping(
            self.schedule, self.initial, min(self.floor, self.initial), state.step,
            self.decay_steps,
        )  # fmt: skip
        return damping, growth

    def rejected(self, damping: float, growth: float, ratio: float) -> tuple[float, float]:
        """The damping of the next attempt at this step, and Nielsen's growth factor."""
        if self.update == "nielsen":
            return rejected_update(damping, growth)
        return trust_region_update(damping, ratio, self.floor), growth

    def raised(self, damping: float, growth: float, shortest: float) -> tuple[float, float]:
        """The damping of a re-solve after an uphill step, and Nielsen's growth factor: raised
        as after a rejected attempt, and at least ``1 / shortest`` times, ``shortest`` being
        the line search's last factor ``a``. The line search has already tried every step
        along this direction down to that fraction of it, and a damping ``k`` times larger
        shortens the step at most ``k`` times: a smaller increase would solve for a step it
        has in effect tried already."""
        raised, growth = self.rejected(damping, growth, math.nan)
        return min(max(raised, damping / shortest), DAMPING_MAX), growth

    def after(
        self, damping: float, growth: float, trial: Trial
    ) -> tuple[Optional[float], float, float]:
        """The trust-region ratio (``None`` with the trust region off), the next step's damping
        and growth factor.

        A predicted change within rounding of the loss (at a minimum, or with a vanishing
        gradient) says nothing about the model's quality: the damping is then kept, where the
        plain rule would read the rounding noise as a failed prediction and raise the damping
        step after step until it overflows.
        """
        if not self.trust_region:
            return None, damping, growth
        if trial.noise:
            return math.nan, damping, growth
        if self.update == "threshold":
            return trial.ratio, trust_region_update(damping, trial.ratio, self.floor), growth
        if trial.accepted:
            return trial.ratio, nielsen_update(damping, trial.ratio, self.floor), GROWTH_START
        return (trial.ratio, *rejected_update(damping, growth))


@dataclass(frozen=True)
class Solution:
    """What the step's decisions need from the solution ``d``, copied to the host at once."""

    predicted: float  # the damped quadratic model's change at ``s = lr d``
    slope: float  # ``m_hat^T s``, the line search's directional derivative
    residual_norm: float
    moved: bool  # ``d != 0``

    @staticmethod
    def of(grad: Tensor, rhs: Tensor, result: Result, lr: float) -> Solution:
        r"""The change :math:`g^\top s + \frac12 s^\top A s` uses the descent's residual, which
        gives :math:`A d = r - \hat m` without another product."""
        d = result.x
        g_d = torch.dot(grad, d)
        m_d = g_d if rhs is grad else torch.dot(rhs, d)  # (the same product, once)
        g_d, curv, m_d, res, d_max = torch.stack([
            g_d, torch.dot(d, result.residual - rhs), m_d,
            torch.linalg.vector_norm(result.residual), d.abs().max(),
        ]).tolist()  # fmt: skip
        return Solution(lr * g_d + 0.5 * lr * lr * curv, lr * m_d, res, d_max != 0)


@dataclass(frozen=True)
class Trial:
    """One attempt at a step: the solution at one damping and the loss at its full step."""

    result: Result  # the descent's result (CG's or a direct solve's)
    solution: Solution
    step: Tensor  # lr d
    curve: Optional[Tensor]  # lr^2 a / 2, the geodesic acceleration's term; None without
    loss: float  # at the full step (loss0 when d = 0)
    evals: int  # loss evaluations made (0 or 1)
    ratio: float  # actual over predicted change; NaN unless the prediction is a decrease
    accepted: bool  # the Armijo condition holds at the full step
    noise: bool  # the predicted change is within rounding of the loss

    @property
    def moved(self) -> bool:
        return self.solution.moved

    def displacement(self, a: float) -> Tensor:
        """The change of the parameters at the line search's factor ``a``: ``a lr d``, and
        with a geodesic acceleration the parabola ``a lr d + a^2 lr^2 a_geo / 2``."""
        if a == 1.0:  # (a product by 1 is exact)
            return self.step if self.curve is None else self.step + self.curve
        if self.curve is None:
            return a * self.step
        return torch.add(self.step, self.curve, alpha=a).mul_(a)

    @property
    def settled(self) -> bool:
        """Whether another attempt with a larger damping is pointless."""
        return self.accepted or self.noise or not self.moved

    @staticmethod
    def of(result: Result, curve: Optional[Tensor], problem: Problem, search: LineSearch) -> Trial:
        grad, loss0 = problem.grad, problem.loss0
        solution = Solution.of(grad, problem.rhs, result, search.lr)
        step = result.x if search.lr == 1.0 else search.lr * result.x  # (a product by 1 is exact)
        moved = solution.moved
        loss = problem.loss_at(step if curve is None else step + curve) if moved else loss0
        predicted = solution.predicted
        noise = rounding(loss0, grad.dtype)
        within_noise = abs(predicted) <= noise and not result.breakdown and math.isfinite(loss)
        ratio = (loss - loss0) / predicted if predicted < 0 else math.nan
        # The line search's first test, at a = 1.
        accepted = moved and math.isfinite(loss) and loss <= loss0 + search.c * solution.slope
        return Trial(result, solution, step, curve, loss, int(moved), ratio, accepted, within_noise)


@dataclass(frozen=True)
class Outcome:
    """A step's outcome by one descent: the last attempt's trial, its line search, the damping
    it was solved at, the solves made, the trust-region ratio, the next damping and growth
    factor, the loss evaluations made, the re-solves of an uphill step and whether the step was
    rejected as uphill."""

    trial: Trial
    search: LineSearchResult
    damping: float
    attempts: int
    ratio: Optional[float]
    next_damping: float
    growth: float
    evals: int
    resolves: int = 0
    rejected: bool = False

    @property
    def moved(self) -> bool:
        """Whether the step changes the parameters (a finite loss where it ends, and not
        rejected as uphill)."""
        return self.trial.moved and math.isfinite(self.search.loss) and not self.rejected

    @property
    def step_factor(self) -> float:
        """The line search's factor ``a`` of the step taken (0 where it does not move)."""
        return self.search.step if self.moved else 0.0


def damped_step(
    descent: Descent,
    problem: Problem,
    state: StepState,
    rule: DampingRule,
    search: LineSearch,
    accelerate: Optional[Accelerate] = None,
) -> Outcome:
    """One step's solution by one descent: its damping attempts and its line search, and with
    ``rule.uphill_resolves`` its re-solves while it ends uphill; nothing is written.

    Args:
        descent: ``damping -> result``.
        problem: the gradient, right-hand side and losses of the step.
        state: the state the step starts from (its damping, growth factor and count).
        rule: the damping rule.
        search: the step length and line search.
        accelerate: ``result -> lr^2 a / 2``, the geodesic acceleration's term of an exact
            step (``None`` where it does not apply to that result,
            :data:`~torch_sgn.solve.descents.TOO_LARGE` where it is too large against the step:
            the step goes without it, or with ``rule.strict_acceleration`` the attempt is
            rejected), or ``None``.
    """
    damping, growth = rule.start(state)
    evals = solves = 0
    resolves = 0 if rule.uphill_resolves is None else rule.uphill_resolves
    carried: Optional[tuple[float, float]] = None  # the next step's damping and growth
    for resolve in range(resolves + 1):
        trial, damping, growth, attempts, e = _attempts(
            descent, problem, rule, search, accelerate, damping, growth
        )
        ratio, next_damping, next_growth = rule.after(damping, growth, trial)
        if carried is None:
            carried = (next_damping, next_growth)
        found, e = _line_search(trial, problem, search, e)
        evals, solves = evals + e, solves + attempts
        uphill = not found.loss <= problem.loss0  # a NaN is above
        if not uphill or rule.uphill_resolves is None:
            # A re-solve's raised damping serves the step it found alone: the next step starts
            # from the damping the first solve's trust region set. (Carried on, a damping raised
            # by the line search's whole range takes the threshold rule dozens of steps to bring
            # down: examples/pinn_poisson.py's first 20 steps end at a relative error of 0.21
            # with it, 0.015 without.) A step rejected in the end carries its raised damping,
            # else the next step on the batch would repeat it.
            next_damping, next_growth = carried
            return Outcome(
                trial, found, damping, solves, ratio, next_damping, next_growth, evals, resolve
            )
        # Not solved again: a step within rounding of the loss (its damping says nothing), one
        # that did not move, and one whose right-hand side (a gradient average) is no descent
        # direction on this batch, which more damping only turns it towards.
        if trial.noise or not trial.moved or resolve == resolves or not problem.descends:
            break
        logger.debug(
            "  uphill: loss %.6g > %.6g at a=%.3g; solved again with more damping",
            found.loss, problem.loss0, found.step,
        )  # fmt: skip
        damping, growth = rule.raised(damping, growth, found.step)
        trial = None  # its factorization, freed before the next one
    return Outcome(
        trial, found, damping, solves, ratio, next_damping, next_growth, evals, resolve,
        rejected=trial.moved,
    )  # fmt: skip


def _attempts(
    descent: Descent,
    problem: Problem,
    rule: DampingRule,
    search: LineSearch,
    accelerate: Optional[Accelerate],
    damping: float,
    growth: float,
) -> tuple[Trial, float, float, int, int]:
    """The Levenberg-Marquardt attempts from ``damping``: the last attempt's trial, its damping
    and growth factor, the attempts made and the loss evaluations of the attempts before it."""
    # A step that fails the sufficient-decrease test is solved again on the same
    # linearization with a larger damping, up to `attempts` times.
    evals = 0
    for attempts in range(1, rule.attempts + 1):
        result = descent(damping)
        curve = None if accelerate is None else accelerate(result)
        if curve is TOO_LARGE:
            if rule.strict_acceleration and attempts < rule.attempts:
                # Transtrum and Sethna's rule: a step whose path bends this much leaves the
                # region where the linear model holds; solved again with more damping.
                logger.debug("  attempt %d rejected: damping %.3g, acceleration too large",
                             attempts, damping)  # fmt: skip
                damping, growth = rule.rejected(damping, growth, math.nan)
                result = curve = None
                continue
            curve = None
        trial = Trial.of(result, curve, problem, search)
        if trial.settled or attempts == rule.attempts:
            break
        evals += trial.evals
        logger.debug(
            "  attempt %d rejected: damping %.3g, loss %.6g", attempts, damping, trial.loss
        )
        damping, growth = rule.rejected(damping, growth, trial.ratio)
        result = curve = trial = None  # its factorization, freed before the next one
    return trial, damping, growth, attempts, evals


def _line_search(
    trial: Trial, problem: Problem, search: LineSearch, evals: int
) -> tuple[LineSearchResult, int]:
    """The line search along the trial's step (its loss at the full step the first value), and
    the loss evaluations counted so far."""
    found = LineSearchResult(1.0, trial.loss, 1, math.isfinite(trial.loss))
    if search.on and trial.moved:
        found = backtracking(
            lambda a: problem.loss_at(trial.displacement(a), a), problem.loss0,
            trial.solution.slope, c=search.c, shrink=search.shrink, max_evals=search.max_evals,
            first=trial.loss,
            floor=rounding(problem.loss0, problem.grad.dtype) if search.above_rounding else 0.0,
        )  # fmt: skip
        return found, evals + found.evaluations
    return found, evals + trial.evals
