r"""The step size and momentum chosen on the damped quadratic model (``step_rule="quadratic"``).

K-FAC's rule (Martens & Grosse, 2015, section 7): with the step's direction :math:`d` (CG's
solution) and the previous step's update :math:`\delta`, the step is :math:`s = \alpha d +
\beta \delta` with :math:`(\alpha, \beta)` the minimiser of the damped quadratic model

.. math::
    M(s) = g^\top s + \tfrac12 s^\top (G + \rho I) s

over :math:`\operatorname{span}\{d, \delta\}`, a 2x2 system:

.. math::
    \begin{pmatrix} d^\top A d & d^\top A \delta \\ \delta^\top A d & \delta^\top A \delta
    \end{pmatrix} \begin{pmatrix} \alpha \\ \beta \end{pmatrix}
    = -\begin{pmatrix} g^\top d \\ g^\top \delta \end{pmatrix},
    \qquad A = G + \rho I.

:math:`A d` comes free from CG's residual (:math:`A d = r + b`), so the rule costs one product,
:math:`G \delta`, per step (shared by the step's damping attempts). Without a previous update
(the first step, or after a step that did not move) the rule is one-dimensional:
:math:`\alpha = -g^\top d / d^\top A d`, :math:`\beta = 0`.

References:
    J. Martens, R. Grosse. Optimizing Neural Networks with Kronecker-factored Approximate
    Curvature. ICML 2015, section 7.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch import Tensor

from .descents import Descent, Result

__all__ = ["STEP_RULES", "QuadraticDescent", "step_coefficients"]

#: ``SGN(step_rule=...)``: ``"lr"``, the step ``lr d`` (the paper's); ``"quadratic"``, the step
#: and momentum chosen on the quadratic model.
STEP_RULES = ("lr", "quadratic")


def step_coefficients(
    grad: Tensor, d: Tensor, a_d: Tensor, prev: Optional[Tensor], a_prev: Optional[Tensor]
) -> tuple[float, float]:
    r"""The :math:`(\alpha, \beta)` minimising :math:`g^\top s + \frac12 s^\top A s` over
    :math:`s = \alpha d + \beta \delta`.

    Args:
        grad: :math:`g`, the model's linear term.
        d: the direction.
        a_d: :math:`A d`.
        prev: :math:`\delta`, the previous update, or ``None``.
        a_prev: :math:`A \delta` (``None`` with ``prev``).

    Returns:
        ``(alpha, beta)``: ``(1, 0)`` where ``d`` has no positive curvature (a zero direction);
        ``beta = 0`` without ``prev`` or where :math:`\delta` is (numerically) parallel to
        ``d``, where the 2x2 system is singular.
    """
    if prev is None:
        dad, gd = torch.stack([torch.dot(d, a_d), torch.dot(grad, d)]).double().tolist()
        return (-gd / dad, 0.0) if dad > 0 else (1.0, 0.0)
    products = [
        torch.dot(d, a_d), torch.dot(d, a_prev), torch.dot(prev, a_prev), torch.dot(grad, d),
        torch.dot(grad, prev),
    ]  # fmt: skip
    dad, dap, pap, gd, gp = torch.stack(products).double().tolist()
    if not dad > 0:
        return 1.0, 0.0
    det = dad * pap - dap * dap
    # Gram determinant of d and delta in the A inner product: near zero when they are parallel.
    if not (pap > 0 and det > 1e-10 * dad * pap):
        return -gd / dad, 0.0
    return (-gd * pap + gp * dap) / det, (-gp * dad + gd * dap) / det


@dataclass
class QuadraticDescent:
    r"""A descent whose solution :math:`d` is replaced by the step :math:`\alpha d + \beta
    \delta` of :func:`step_coefficients`, with the residual that step has (``A s + rhs``), so
    that the predicted change, the trust region and the line search see the step taken.

    Attributes:
        descent: the descent giving :math:`d`.
        operator: ``v -> G v`` (a fresh tensor per product).
        grad: :math:`g`, the model's linear term.
        rhs: the right-hand side the descent solved for (:math:`\hat m`).
        prev: :math:`\delta`, the previous update, or ``None``.
    """

    descent: Descent
    operator: Callable[[Tensor], Tensor]
    grad: Tensor
    rhs: Tensor
    prev: Optional[Tensor]
    _g_prev: Optional[Tensor] = field(default=None, init=False, repr=False)

    def __call__(self, damping: float) -> Result:
        result = self.descent(damping)
        if result.breakdown:
            return result
        d, prev = result.x, self.prev
        a_d = result.residual - self.rhs  # the residual is A d + rhs
        a_prev = None
        if prev is not None:
            if self._g_prev is None:
                self._g_prev = self.operator(prev)  # once per step, whatever the damping
            a_prev = self._g_prev + damping * prev
        alpha, beta = step_coefficients(self.grad, d, a_d, prev, a_prev)
        step, a_step = alpha * d, alpha * a_d
        if beta != 0.0:
            step, a_step = step.add_(prev, alpha=beta), a_step.add_(a_prev, alpha=beta)
        return replace(result, x=step, residual=a_step.add_(self.rhs))
