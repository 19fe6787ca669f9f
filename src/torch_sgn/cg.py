"""Conjugate gradient for the damped Gauss-Newton system (the paper's Algorithm 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["CGResult", "conjugate_gradient"]

#: Why :func:`conjugate_gradient` stopped.
STOP_REASONS = ("converged", "max_iters", "non_positive_curvature", "non_finite")


@dataclass(frozen=True)
class CGResult:
    """The outcome of :func:`conjugate_gradient`.

    Attributes:
        x: the last good iterate.
        residual: ``A x - b`` for that iterate, as updated by the recurrence.
        iterations: number of iterations (matrix-vector products after the initial residual).
        reason: one of ``"converged"``, ``"max_iters"``, ``"non_positive_curvature"``,
            ``"non_finite"``. The last two flag a breakdown; ``x`` is then the iterate before it.
    """

    x: Tensor
    residual: Tensor
    iterations: int
    reason: str

    @property
    def breakdown(self) -> bool:
        return self.reason in ("non_positive_curvature", "non_finite")


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    *,
    max_iters: int,
    tol: float = 0.0,
    x0: Optional[Tensor] = None,
    preconditioner: Optional[Tensor] = None,
) -> CGResult:
    r"""Approximately solves ``A x = b`` for symmetric positive definite ``A``.

    Runs the (preconditioned) conjugate gradient method of Nocedal & Wright (Alg. 5.3) with
    ``A`` given only through ``matvec``:

    .. math::
        r_0 = A x_0 - b,\quad z_k = M r_k,\quad p_0 = -z_0,\quad
        \alpha_k = \frac{r_k^\top z_k}{p_k^\top A p_k},\quad
        x_{k+1} = x_k + \alpha_k p_k,\quad r_{k+1} = r_k + \alpha_k A p_k,\quad
        p_{k+1} = -z_{k+1} + \frac{r_{k+1}^\top z_{k+1}}{r_k^\top z_k} p_k.

    Args:
        matvec: ``v -> A v``. For SGN, ``A = G + damping I``.
        b: right-hand side (``-g`` for SGN).
        max_iters: iteration budget (``k_max``; the original's ``MAX_CG_ITERS``).
        tol: stop once ``max_i |r_i| <= tol``, the original's ``CG_TOL`` test (max-abs, not
            the 2-norm). ``0`` runs all ``max_iters`` unless the residual vanishes.
        x0: starting point; zero when ``None`` (which saves one product).
        preconditioner: diagonal ``M`` (an approximation of ``A^{-1}``) as a vector, applied
            elementwise.

    Returns:
        A :class:`CGResult`.

    .. note::
        Where the paper's Algorithm 2 applies ``H + rho I`` to a matrix that already holds
        ``rho``, damping is counted once here: ``matvec`` is the whole of ``A``. A curvature
        ``p^T A p <= 0`` (possible only if ``A`` is not positive definite, e.g. for a
        non-convex custom loss) or a non-finite value stops the iteration and returns the
        last good iterate, flagged in ``reason``, instead of raising as the original did.
    """
    if max_iters < 0:
        raise ValueError(f"max_iters must be >= 0, got {max_iters}")
    if x0 is None:
        x = torch.zeros_like(b)
        r = -b
    else:
        x = x0.clone()
        r = matvec(x) - b
        if not bool(torch.isfinite(r).all()):
            return CGResult(torch.zeros_like(b), -b, 0, "non_finite")
    z = r if preconditioner is None else preconditioner * r
    p = -z
    r_max, rz = _max_abs_and(r, torch.dot(r, z))
    if r_max <= tol:
        return CGResult(x, r, 0, "converged")
    # The step lengths are host floats (each is tested on the host anyway): one fused
    # ``add(..., alpha=)`` per update. ``x`` and ``p`` are this function's own and are updated
    # in place, and ``A p`` is dropped as soon as it is used: a step's peak memory is a few
    # vectors of the parameters' size, which matters on small models.
    for k in range(max_iters):
        if not _finite(rz):
            return CGResult(x, r, k, "non_finite")
        ap = matvec(p)
        curvature = torch.dot(p, ap).item()  # host sync: the tests below decide the control flow
        if not _finite(curvature):
            return CGResult(x, r, k, "non_finite")
        if curvature <= 0.0:
            return CGResult(x, r, k, "non_positive_curvature")
        alpha = rz / curvature
        r_next = r.add(ap, alpha=alpha)
        del ap
        z = r_next if preconditioner is None else preconditioner * r_next
        r_max, rz_next = _max_abs_and(r_next, torch.dot(r_next, z))
        if not _finite(r_max):
            return CGResult(x, r, k, "non_finite")
        x.add_(p, alpha=alpha)
        r = r_next
        if r_max <= tol:
            return CGResult(x, r, k + 1, "converged")
        p.mul_(rz_next / rz).sub_(z)
        rz = rz_next
    return CGResult(x, r, max_iters, "max_iters")


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def _max_abs_and(r: Tensor, scalar: Tensor) -> tuple[float, float]:
    """``max |r_i|`` and ``scalar`` on the host, in one transfer and without a temporary."""
    if not r.numel():
        return 0.0, scalar.item()
    low, high, value = _to_floats(*torch.aminmax(r), scalar)
    return max(-low, high), value


def _to_floats(*scalars: Tensor) -> list:
    """Copies scalars to the host in one transfer."""
    return torch.stack([t.reshape(()) for t in scalars]).tolist()
