"""What one step did: :class:`StepInfo`, the result of :meth:`torch_sgn.SGN.step`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .route_plan import Plan

__all__ = ["StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What one :meth:`SGN.step` did.

    Attributes:
        loss: mini-batch loss before the step; with ``SGN(weight_decay=lambda)``, the objective
            the step minimizes, the loss plus ``penalty`` (``loss - penalty`` is the loss
            alone).
        loss_after: mini-batch loss (objective) at the accepted point (same batch).
        grad_norm: 2-norm of the mini-batch gradient (of the objective).
        iterations: CG iterations run (``G v`` products after the first residual); 0 for a
            direct solve.
        residual: 2-norm of the final residual ``A d + m_hat`` of the system ``A d = -m_hat``
            the solve ran on: ``A = G + damping I`` for CG (the recurrence's residual), the
            matrix actually factored for a direct solve (see ``stop_reason``).
        stop_reason: why CG stopped: ``"converged"``, ``"stalled"``, ``"max_iters"``,
            ``"non_positive_curvature"``, ``"non_finite"`` (see
            :class:`~torch_sgn.solve.cg.CGResult`); how a direct solve solved:
            ``"cholesky"``; ``"eigh"`` where Cholesky failed in floating point (the
            eigenvalues of ``G`` clipped to ``>= 0``); ``"scaled_gradient"`` where that failed
            too; ``"lu"`` (or ``"pinv"`` where that failed) for the non-symmetric system
            through the batch's outputs of a loss whose output-space Hessian is not a multiple
            of the identity; ``"non_finite"`` (no step).
        damping: the damping ``rho`` used in this step.
        next_damping: the damping the next step will use.
        step_size: the step length taken along the solution, ``lr * a`` with ``a`` the
            line-search factor (0 when no step was taken).
        tr_ratio: actual over predicted reduction at the full step (``None`` when the trust
            region is off).
        predicted_change: the damped quadratic model's change at the full step.
        loss_evals: loss evaluations at trial points (trust-region test and line search).
        line_search_ok: whether the Armijo condition held (``True`` when line search is off).
        attempts: how many times the step's system was solved: a solution that fails the
            Armijo test at its full step is solved again with a larger damping, up to
            ``SGN(attempts=...)`` times (Levenberg-Marquardt), and a step that ends uphill
            again (``uphill_resolves``). ``damping``, ``iterations``, ``residual``,
            ``stop_reason``, ``tr_ratio`` and ``predicted_change`` describe the last attempt.
        solver: ``"cg"`` or ``"direct"``, the solver that ran (see ``SGN(solver=...)``).
        accelerated: whether the step carried a geodesic acceleration (see
            ``SGN(geodesic_acceleration=...)``); ``step_size`` is then the factor along the
            parabola ``s d + s^2 a / 2``.
        taken: whether the parameters changed: ``False`` where the solution was zero, where
            the loss at every trial point was non-finite, or where the step still ended above
            ``loss`` after its re-solves (``SGN(reject_uphill=True)``, the default): the
            parameters are then exactly as before the step, ``loss_after`` equals ``loss``
            and ``step_size`` is 0.
        uphill_resolves: how many times the step was solved again with a larger damping
            because its line search ended above ``loss`` (``SGN(reject_uphill=True)``); 0
            for a step that went downhill at once.
        penalty: the weight decay's term ``weight_decay / 2 * ||theta||^2`` of ``loss``,
            at the point the step started from (0 without weight decay).
        sample: on a residual problem too large for an exact step through one matrix
            (:func:`torch_sgn.route_plan.row_stage`), the points drawn from each residual block,
            in the blocks' order: the points the step was taken on (``solver`` ``"direct"``;
            ``loss``, ``loss_after`` and ``grad_norm`` are then the sample's, estimates of the
            whole problem's), or those whose rows preconditioned CG on every row (``"cg"``);
            ``None`` where the step used no sample.
        plan: the step's :class:`~torch_sgn.route_plan.Plan`: the rows it used, how its ``J``
            was formed, the exact route it could take and the route it took (with
            ``solver="auto"``'s probe and verdict). ``None`` for steps not taken by
            :meth:`SGN.step` (the curve-fit steps of :func:`torch_sgn.least_squares`).
    """

    loss: float
    loss_after: float
    grad_norm: float
    iterations: int
    residual: float
    stop_reason: str
    damping: float
    next_damping: float
    step_size: float
    tr_ratio: Optional[float]
    predicted_change: float
    loss_evals: int
    line_search_ok: bool
    attempts: int = 1
    solver: str = "cg"
    accelerated: bool = False
    taken: bool = True
    uphill_resolves: int = 0
    penalty: float = 0.0
    sample: Optional[tuple] = None
    plan: Optional[Plan] = None
