"""Conjugate gradient for the damped Gauss-Newton system (the paper's Algorithm 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch import Tensor

__all__ = ["CGResult", "conjugate_gradient"]

#: Why :func:`conjugate_gradient` stopped.
STOP_REASONS = ("converged", "stalled", "max_iters", "non_positive_curvature", "non_finite")

#: Martens (2010), Section 4.4: progress is measured over the last ``max(10, 0.1 i)`` iterations.
_PROGRESS_WINDOW_MIN, _PROGRESS_WINDOW_FRACTION = 10, 0.1


@dataclass(frozen=True)
class CGResult:
    """The outcome of :func:`conjugate_gradient`.

    Attributes:
        x: the last good iterate.
        residual: ``A x - b`` for that iterate, as updated by the recurrence.
        iterations: number of iterations (matrix-vector products after the initial residual).
        reason: one of ``"converged"`` (a residual tolerance was met), ``"stalled"`` (the
            relative-progress rule stopped it), ``"max_iters"``, ``"non_positive_curvature"``,
            ``"non_finite"``. The last two flag a breakdown; ``x`` is then the iterate before it.
        again: ``b -> -A^{-1} b``, the same system solved for another right-hand side, where
            the caller attached it (the geodesic acceleration's second solve,
            :class:`~torch_sgn.solve.core.SampledDescent`); ``None`` otherwise.
        breakdown: whether ``reason`` flags a breakdown (``"non_positive_curvature"`` or
            ``"non_finite"``).
    """

    x: Tensor
    residual: Tensor
    iterations: int
    reason: str
    again: Optional[Callable[[Tensor], Tensor]] = field(default=None, repr=False, compare=False)

    @property
    def breakdown(self) -> bool:
        return self.reason in ("non_positive_curvature", "non_finite")


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    *,
    max_iters: int,
    tol: float = 0.0,
    rtol: float = 0.0,
    progress_tol: float = 0.0,
    x0: Optional[Tensor] = None,
    preconditioner: Optional[Union[Tensor, Callable[[Tensor], Tensor]]] = None,
) -> CGResult:
    r"""Approximately solves ``A x = b`` for symmetric positive definite ``A``.

    Runs the (preconditioned) conjugate gradient method of Nocedal & Wright (Alg. 5.3) with
    ``A`` given only through ``matvec``:

    .. math::
        r_0 = A x_0 - b,\quad z_k = M r_k,\quad p_0 = -z_0,\quad
        \alpha_k = \frac{r_k^\top z_k}{p_k^\top A p_k},\quad
        x_{k+1} = x_k + \alpha_k p_k,\quad r_{k+1} = r_k + \alpha_k A p_k,\quad
        p_{k+1} = -z_{k+1} + \frac{r_{k+1}^\top z_{k+1}}{r_k^\top z_k} p_k.

    Three stopping rules besides ``max_iters``, each off at 0:

    * ``tol``: ``max_i |r_i| <= tol``, the original's absolute ``CG_TOL`` test (max-abs, not
      the 2-norm);
    * ``rtol``: ``||r||_2 <= rtol ||b||_2``, the usual relative residual, which does not
      depend on the scale of the loss;
    * ``progress_tol``: Martens's (2010) relative-progress rule on the quadratic
      :math:`\phi(x) = \tfrac12 x^\top A x - b^\top x`, the function CG minimises: after
      iteration :math:`i`, with :math:`k = \max(10, \lceil 0.1\,i \rceil)`, stop when
      :math:`i > k`, :math:`\phi_i < 0` and
      :math:`(\phi_i - \phi_{i-k}) / \phi_i < k \cdot \text{progress\_tol}` (Martens used
      ``5e-4``): the last ``k`` iterations improved the model by less than that fraction
      each, on average. It stops CG where more iterations no longer pay, on an
      ill-conditioned system long before the residual is small.

    Args:
        matvec: ``v -> A v``. For SGN, ``A = G + damping I``.
        b: right-hand side (``-g`` for SGN).
        max_iters: iteration budget (``k_max``; the original's ``MAX_CG_ITERS``).
        tol: absolute max-abs residual tolerance (see above). ``0`` runs all ``max_iters``
            unless the residual vanishes or another rule stops it.
        rtol: relative 2-norm residual tolerance (see above).
        progress_tol: the relative-progress rule's :math:`\epsilon` (see above).
        x0: starting point; zero when ``None`` (which saves one product).
        preconditioner: ``M``, an approximation of ``A^{-1}``, symmetric positive definite:
            a diagonal as a vector, applied elementwise, or a callable ``v -> M v`` (e.g.
            :meth:`NystromApproximation.preconditioner
            <torch_sgn.solve.nystrom.NystromApproximation.preconditioner>`).

    Returns:
        A :class:`CGResult`.

    Raises:
        ValueError: ``max_iters``, ``tol``, ``rtol`` or ``progress_tol`` is negative.

    .. note::
        Where the paper's Algorithm 2 applies ``H + rho I`` to a matrix that already holds
        ``rho``, damping is counted once here: ``matvec`` is the whole of ``A``. A curvature
        ``p^T A p <= 0`` (possible only if ``A`` is not positive definite, e.g. for a
        non-convex custom loss) or a non-finite value stops the iteration and returns the
        last good iterate, flagged in ``reason``, instead of raising as the original did.
        :math:`\phi` is computed as Martens does, :math:`\tfrac12 x^\top (r - b)` from the
        recurrence's residual: two dot products, no product with ``A``. (The cheaper
        recurrence :math:`\phi_{k+1} = \phi_k - \tfrac12 \alpha_k r_k^\top z_k` drifts from
        it on ill-conditioned systems, where the rule matters.)
    """
    if max_iters < 0:
        raise ValueError(f"max_iters must be >= 0, got {max_iters}")
    for name, value in (("tol", tol), ("rtol", rtol), ("progress_tol", progress_tol)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if x0 is None:
        x = torch.zeros_like(b)
        r = -b
    else:
        x = x0.clone()
        r = matvec(x) - b
        if not bool(torch.isfinite(r).all()):
            return CGResult(torch.zeros_like(b), -b, 0, "non_finite")
    precondition = _as_callable(preconditioner)
    z = r if precondition is None else precondition(r)
    p = -z
    # One host transfer: the tests' inputs, ||b||^2 and phi(x0) = x0^T (r0 - b) / 2.
    extra = [torch.dot(b, b)]
    if x0 is not None:
        extra.append(0.5 * (torch.dot(x, r) - torch.dot(x, b)))
    r_max, rz, *rest = _max_abs_and(r, torch.dot(r, z), *extra)
    rr = rz if preconditioner is None else None
    b_norm = math.sqrt(rest[0])
    if not _finite(b_norm):  # ||b||^2 overflowed: the norm in float64 then
        b_norm = torch.linalg.vector_norm(b, dtype=torch.float64).item()
    r_bound = rtol * b_norm  # ||r|| <= r_bound passes the relative test
    phi = [rest[1] if x0 is not None else 0.0]  # phi after each iteration, phi[0] at x0
    if r_max <= tol or (rtol > 0 and _norm(r, rr) <= r_bound):
        return CGResult(x, r, 0, "converged")
    # The step lengths are host floats (each is tested on the host anyway): one fused
    # ``add(..., alpha=)`` per update. ``x`` and ``p`` are this function's own and are updated
    # in place, and ``A p`` is dropped as soon as it is used: a step's peak memory is a few
    # vectors of the parameters' size, which matters on small models.
    for k in range(max_iters):
        if not _finite(rz):
            return CGResult(x, r, k, "non_finite")
        if rz == 0.0:  # the residual vanished to rounding (with cg_tol=0 no test caught it)
            return CGResult(x, r, k, "converged")
        ap = matvec(p)
        curvature = torch.dot(p, ap).item()  # host sync: the tests below decide the control flow
        if not _finite(curvature):
            return CGResult(x, r, k, "non_finite")
        if curvature <= 0.0:
            return CGResult(x, r, k, "non_positive_curvature")
        alpha = rz / curvature
        r_next = r.add(ap, alpha=alpha)
        del ap
        z = r_next if precondition is None else precondition(r_next)
        scalars = [torch.dot(r_next, z)]
        if rtol > 0 and preconditioner is not None:
            scalars.append(torch.dot(r_next, r_next))
        if progress_tol > 0:
            # phi(x_next) = x_next^T (r_next - b) / 2, as Martens computes it, from x before
            # its update (x_next = x + alpha p), so that x is still the last good iterate
            # if r_next is not finite.
            scalars.append(torch.stack([torch.dot(x, r_next), torch.dot(p, r_next)]))
            scalars.append(torch.stack([torch.dot(x, b), torch.dot(p, b)]))
        r_max, rz_next, *rest = _max_abs_and(r_next, *scalars)
        if not _finite(r_max):
            return CGResult(x, r, k, "non_finite")
        rr = rz_next if preconditioner is None else (rest.pop(0) if rtol > 0 else None)
        x.add_(p, alpha=alpha)
        r = r_next
        if progress_tol > 0:
            (xr, pr), (xb, pb) = rest
            phi.append(0.5 * ((xr + alpha * pr) - (xb + alpha * pb)))
        if r_max <= tol or (rtol > 0 and _norm(r, rr) <= r_bound):
            return CGResult(x, r, k + 1, "converged")
        if progress_tol > 0 and _stalled(phi, progress_tol):
            return CGResult(x, r, k + 1, "stalled")
        p.mul_(rz_next / rz).sub_(z)
        rz = rz_next
    return CGResult(x, r, max_iters, "max_iters")


def _as_callable(
    preconditioner: Optional[Union[Tensor, Callable[[Tensor], Tensor]]],
) -> Optional[Callable[[Tensor], Tensor]]:
    """``v -> M v`` for a diagonal ``M`` given as a vector, or the callable as given."""
    if preconditioner is None or not isinstance(preconditioner, Tensor):
        if preconditioner is not None and not callable(preconditioner):
            raise TypeError(
                f"preconditioner must be a tensor or a callable, got {type(preconditioner)}"
            )
        return preconditioner
    diagonal = preconditioner
    return lambda v: diagonal * v


def _stalled(phi: list, eps: float) -> bool:
    """Martens's (2010) relative-progress test after iteration ``i = len(phi) - 1``."""
    i = len(phi) - 1
    window = max(_PROGRESS_WINDOW_MIN, math.ceil(_PROGRESS_WINDOW_FRACTION * i))
    if i <= window or not phi[i] < 0:
        return False
    return (phi[i] - phi[i - window]) / phi[i] < window * eps


def _norm(r: Tensor, rr: Optional[float]) -> float:
    return math.sqrt(max(rr, 0.0)) if rr is not None else torch.linalg.vector_norm(r).item()


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def _max_abs_and(r: Tensor, *values: Tensor) -> list:
    """``max |r_i|`` and ``values`` (scalars, or short vectors returned as lists) on the
    host, in one transfer and without a temporary the size of ``r``."""
    if not r.numel():
        return [0.0, *_to_host(*values)]
    low, high, *rest = _to_host(*torch.aminmax(r), *values)
    return [max(-low, high), *rest]


def _to_host(*values: Tensor) -> list:
    """Copies scalars and short vectors to the host in one transfer."""
    flat = torch.cat([t.reshape(-1) for t in values]).tolist()
    out, i = [], 0
    for t in values:
        n = t.numel()
        out.append(flat[i] if t.dim() == 0 else flat[i : i + n])
        i += n
    return out
