r"""The direct solver: exact Levenberg-Marquardt steps for small models and small batches.

For a model with ``P`` parameters, the damped Gauss-Newton system

.. math::
    (G + \rho I)\, d = -\hat m

can be solved exactly once ``G`` is formed: ``P`` products ``G e_i`` (batched, so they cost
far less than ``P`` separate products on a small model) and a Cholesky factorization,
:math:`P^3/3` flops. Conjugate gradient costs ``k`` products and is inexact. On models of a
few thousand parameters the exact solve is cheap and lets the damping fall as low as the fit
needs (the high-precision regime where dense Levenberg-Marquardt shines); on large models it is
out of reach (:math:`P^2` memory). There, when the batch has fewer outputs ``R`` than the
model has parameters, the same exact step is solved through the ``R x R`` matrix ``J J^T``
(:func:`solve_in_sample_space`): a 133k-parameter MLP on batches of 1000 takes exact
Levenberg-Marquardt steps. Elsewhere CG is the method.

* :func:`solve_damped` solves the damped system robustly, in float64 whatever the model's
  dtype (as :func:`solve_in_sample_space` does): Cholesky, and where that fails in floating
  point (an indefinite ``G`` from a non-convex custom loss, or rounding) an eigendecomposition
  with the eigenvalues of ``G`` clipped to ``>= 0``, so the solve never returns NaN from a
  finite matrix. In float32 the factorization of ``G + rho I`` fails once the damping falls
  below about 1e-7 of ``G``'s scale, which would hold a float32 fit near an MSE of 1e-8 (the
  sinc benchmark of ``docs/SOLVERS.md``); in float64 the damping can fall as far as the fit
  needs.
* :func:`check_direct_fits` refuses, before anything is allocated, a model whose matrix does
  not fit in the device's memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..linearization import SampleSpace

__all__ = ["DirectResult", "solve_damped", "solve_in_sample_space"]

SOLVERS = ("auto", "cg", "direct")

#: How ``solver="auto"`` picks at most this many parameters by default: ``G``, its symmetric
#: copy and its factor take ``3 P^2`` float64 numbers (about 384 MB at 4000).
DEFAULT_DIRECT_MAX_PARAMS = 4000


@dataclass(frozen=True)
class DirectResult:
    """The outcome of :func:`solve_damped`, shaped like :class:`~torch_sgn.solve.cg.CGResult`.

    Attributes:
        x: the solution ``d``.
        residual: ``A d - b`` with ``A`` the matrix actually solved (see ``reason``) and
            ``b = -rhs``, so that ``d^T A d = d^T (residual + b)`` as for CG.
        iterations: always 0 (no CG iterations).
        reason: ``"cholesky"``: ``A = G + rho I`` was factored. ``"eigh"``: Cholesky failed,
            ``A = V (max(Lambda, 0) + rho) V^T`` from ``G = V Lambda V^T``. ``"scaled_gradient"``:
            the eigendecomposition did not converge either, ``A = (rho + ||G||_F) I``, which
            bounds ``G + rho I`` from above. ``"lu"``, ``"pinv"``: the sample space's
            non-symmetric system (:func:`solve_in_sample_space`) by an LU factorization, or by
            the pseudo-inverse where that failed. ``"non_finite"``: ``G`` or the solution has
            non-finite entries; ``x`` is zero (a breakdown).
        again: ``b -> -A^{-1} b``, the same system solved for another right-hand side with
            the factorization already made (the geodesic acceleration's second solve). For
            :func:`solve_in_sample_space` ``b`` is given in output space, as ``e`` with
            right-hand side ``J^T e``. ``None`` after a breakdown.
    """

    x: Tensor
    residual: Tensor
    iterations: int
    reason: str
    again: Optional[Callable[[Tensor], Tensor]] = field(default=None, repr=False, compare=False)

    @property
    def breakdown(self) -> bool:
        return self.reason == "non_finite"


def solve_damped(
    matrix: Tensor, rhs: Tensor, damping: float, symmetric: bool = False
) -> DirectResult:
    r"""Solves :math:`(G + \rho I)\, d = -\mathrm{rhs}` exactly, in float64.

    Args:
        matrix: ``G`` (``P x P``), symmetric positive semi-definite up to rounding; only its
            symmetric part is used.
        rhs: the right-hand side's negative (the gradient, or ``m_hat``), length ``P``.
        damping: :math:`\rho > 0`.
        symmetric: ``matrix`` is exactly symmetric (checked by the caller): its symmetric
            part is itself, and is not formed again.

    Returns:
        A :class:`DirectResult` in ``rhs``'s dtype (``again`` takes and returns that dtype
        too). Its ``x`` is finite whenever ``matrix`` and ``rhs`` are.

    .. note::
        ``G`` formed in floating point may be slightly indefinite (rounding in ``J^T H J``
        with a tiny damping), or truly so (a custom loss not convex in the outputs). Cholesky
        then fails; the fallback solves with the eigenvalues of ``G`` clipped to ``>= 0``,
        which is the Levenberg-Marquardt step of the nearest positive semi-definite matrix,
        so the step is always a descent direction for ``rhs``.
    """
    n = rhs.shape[0]
    if matrix.shape != (n, n):
        raise ValueError(f"matrix of shape {tuple(matrix.shape)} does not match rhs of length {n}")
    if rhs.dtype != torch.float64 or matrix.dtype != torch.float64:
        return _in_dtype(solve_damped(matrix.double(), rhs.double(), damping, symmetric), rhs.dtype)
    # G's symmetric part (in the layout torch.add gives it: matrix's)
    damped = matrix.clone() if symmetric else torch.add(matrix, matrix.mT).mul_(0.5)
    damped.diagonal().add_(damping)
    factor, info = torch.linalg.cholesky_ex(damped)
    if int(info) == 0:

        def by_cholesky(b: Tensor) -> Tensor:
            # L^-T L^-1 b by two triangular solves: torch.cholesky_solve's result to the bit
            # (LAPACK's potrs is these two solves), at less overhead for a small matrix
            y = torch.linalg.solve_triangular(factor, b.unsqueeze(1), upper=False)
            return torch.linalg.solve_triangular(factor.mT, y, upper=True).squeeze(1).neg_()

        x = by_cholesky(rhs)
        residual = torch.addmv(rhs, damped, x)
        # rhs + A x is finite only where rhs and x are (A's diagonal is positive); where the
        # test fails (a non-finite entry, or an overflow), the terms are tested themselves.
        if _all_finite(matrix, residual) or _all_finite(matrix, rhs, x):
            return DirectResult(x, residual, 0, "cholesky", by_cholesky)
    factor = damped = None  # freed before the fallback's own matrices
    if not _all_finite(matrix, rhs):
        zero = torch.zeros_like(rhs)
        return DirectResult(zero, rhs.clone(), 0, "non_finite")
    sym = (matrix + matrix.mT) * 0.5
    try:
        values, vectors = torch.linalg.eigh(sym)
    except RuntimeError:  # torch.linalg.LinAlgError: the iteration did not converge
        scale = damping + float(torch.linalg.matrix_norm(sym))
        return DirectResult(
            rhs / -scale, torch.zeros_like(rhs), 0, "scaled_gradient", lambda b: b / -scale
        )
    values = values.clamp_min(0.0).add_(damping)

    def by_eigh(b: Tensor) -> Tensor:
        return vectors @ ((vectors.mT @ b) / values).neg_()

    x = by_eigh(rhs)
    if not _all_finite(x):
        return DirectResult(torch.zeros_like(rhs), rhs.clone(), 0, "non_finite")
    residual = vectors @ (values * (vectors.mT @ x)) + rhs  # A d + rhs for the clipped A
    return DirectResult(x, residual, 0, "eigh", by_eigh)


def _in_dtype(result: DirectResult, dtype: torch.dtype) -> DirectResult:
    """``result`` (float64) with its vectors, and the results of its ``again``, in ``dtype``."""
    again = result.again
    if again is not None:
        again = lambda b, solve=again: solve(b.double()).to(dtype)  # noqa: E731
    return DirectResult(
        result.x.to(dtype), result.residual.to(dtype), result.iterations, result.reason, again
    )


def _all_finite(*tensors: Tensor) -> bool:
    # The sum of every entry (one copy to the host) is finite exactly when no entry is NaN or
    # infinite, unless finite entries overflow it; the exact test settles that case.
    total = tensors[0].sum()
    for t in tensors[1:]:
        total = total + t.sum()
    return math.isfinite(float(total)) or all(bool(torch.isfinite(t).all()) for t in tensors)


# --- the sample space ---------------------------------------------------------------------------
def solve_in_sample_space(
    space: SampleSpace, grad: Tensor, damping: float, ggn_vp: Callable[[Tensor], Tensor]
) -> DirectResult:
    r"""Solves :math:`(G + \rho I)\, d = -g` exactly through the batch's ``R`` outputs.

    With :math:`G = J^\top H J`, :math:`g = J^\top e` (``e`` the loss's gradient with respect to
    the outputs) and :math:`K = J J^\top`, the identity
    :math:`(J^\top H J + \rho I) J^\top = J^\top (H K + \rho I)` gives

    .. math::
        d = -J^\top w, \qquad (H K + \rho I)\, w = e,

    an ``R x R`` system in place of a ``P x P`` one: on a model with more parameters than the
    batch has outputs (a 133k-parameter MLP on 1000 samples) the exact Levenberg-Marquardt step
    costs about as much as a few products. The system is solved in float64, by
    :func:`solve_damped` (Cholesky, its fallbacks) where :math:`HK` is symmetric (``H`` a
    multiple of the identity, as for the squared error), else by an LU factorization (the
    pseudo-inverse where that fails). Only for the gradient itself: a gradient average is not
    of the form :math:`J^\top e`.

    With a weight decay :math:`\lambda` (``space.weight_decay``, at ``space.point``
    :math:`\theta`) the system is :math:`(G + \mu I)\, d = -(J^\top e + \lambda\theta)`,
    :math:`\mu = \rho + \lambda`. Its part in :math:`J^\top e` is solved as above with
    :math:`\mu`; the part in :math:`\theta`, which need not lie in the row space of ``J``, by
    the push-through identity
    :math:`(G + \mu I)^{-1} = \mu^{-1} (I - J^\top (H K + \mu I)^{-1} H J)`:

    .. math::
        d = -J^\top w - \frac{\lambda}{\mu}\bigl(\theta - J^\top u\bigr), \qquad
        (H K + \mu I)\, u = H J \theta,

    one more product ``J theta`` and one more solve with the same factorization.

    Args:
        space: the batch's outputs, ``J J^T`` and the loss's output-space Hessian.
        grad: :math:`g` (with a weight decay, :math:`J^\top e + \lambda\theta`), flat, of the
            parameters' dtype.
        damping: :math:`\rho \ge 0`.
        ggn_vp: ``v -> G v`` (with a weight decay, ``G v + lambda v``), for the residual of the
            solution (one product).

    Returns:
        A :class:`DirectResult` whose ``residual`` is :math:`(G + \rho I) d + g` (with a weight
        decay, :math:`(G + \mu I) d + J^\top e + \lambda\theta`) measured with one product.
    """
    outputs = space.outputs
    weight_decay = space.weight_decay
    mu = damping + weight_decay  # G + lambda I + rho I: the penalty's curvature is lambda I
    kernel = space.kernel_matrix()
    e = space.output_grad.reshape(-1).double()
    hk = _hessian_rows(space.hessian, kernel, outputs)  # row j: H K e_j, so H K = hk^T
    matrix = hk.mT
    if torch.equal(matrix, hk):
        system = solve_damped(matrix, -e, mu, symmetric=True)  # x solves (H K + mu I) w = e
        w, reason = system.x, system.reason
        minus = system.again

        def solve_outputs(b: Tensor) -> Tensor:
            return minus(b).neg_()

    else:
        damped = matrix.clone()
        damped.diagonal().add_(mu)
        factor, pivots, info = torch.linalg.lu_factor_ex(damped)
        reason = "lu"
        if int(info) == 0:

            def solve_outputs(b: Tensor) -> Tensor:
                return torch.linalg.lu_solve(factor, pivots, b.unsqueeze(1)).squeeze(1)

            w = solve_outputs(e)
        if int(info) != 0 or not _all_finite(w):
            inverse = torch.linalg.pinv(damped)

            def solve_outputs(b: Tensor) -> Tensor:
                return inverse @ b

            w, reason = solve_outputs(e), "pinv"
    if reason == "non_finite" or not _all_finite(w):
        return DirectResult(torch.zeros_like(grad), grad.clone(), 0, "non_finite")

    def to_parameters(w: Tensor) -> Tensor:  # d = -J^T w
        return space.vjp(w.to(outputs.dtype).view(outputs.shape)).neg_()

    def again(b: Tensor) -> Tensor:  # (G + mu I) x = -J^T b
        return to_parameters(solve_outputs(b.reshape(-1).double()))

    d = to_parameters(w)
    if weight_decay:  # the penalty's term: d -= (lambda / mu) (theta - J^T u)
        theta = space.point
        u = solve_outputs(space.hessian(space.jvp(theta)).reshape(-1).double())
        d.sub_(to_parameters(u).add_(theta), alpha=weight_decay / mu)
    if not _all_finite(d):
        return DirectResult(torch.zeros_like(grad), grad.clone(), 0, "non_finite")
    residual = ggn_vp(d).add_(d, alpha=damping).add_(grad)
    return DirectResult(d, residual, 0, reason, again)


def _hessian_rows(hessian: Callable[[Tensor], Tensor], kernel: Tensor, outputs: Tensor) -> Tensor:
    """``H`` applied to each row of the symmetric ``kernel`` (rows shaped as the outputs): in
    float64 where the loss's Hessian takes it, else in the outputs' dtype; batched by ``vmap``
    where the Hessian allows it (one by one for a loss whose Hessian product runs autograd)."""
    rows = kernel.view(kernel.shape[0], *outputs.shape)
    for dtype in (torch.float64, outputs.dtype):
        try:
            out = torch.func.vmap(hessian)(rows.to(dtype))
        except Exception:  # mixed dtypes, or an autograd product vmap cannot batch
            continue
        if out.dtype == dtype:
            return out.reshape(kernel.shape).double()
    return torch.stack([hessian(r.to(outputs.dtype)) for r in rows]).reshape(kernel.shape).double()


# --- forming G ---------------------------------------------------------------------------------
# --- memory ------------------------------------------------------------------------------------
def direct_memory_bytes(n: int, dtype: torch.dtype) -> int:
    """Bytes the direct solve holds at once: ``G``, its damped copy and the Cholesky factor
    (or the eigenvectors of the fallback), ``3 n^2`` numbers."""
    return 3 * n * n * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes free on ``device`` now (``None`` where it cannot be told)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_direct_fits(n: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raises ``ValueError`` (before anything is allocated) if the direct solve's matrices for
    ``n`` parameters do not fit in ``device``'s free memory."""
    need = direct_memory_bytes(n, dtype)
    free = available_memory(device)
    if free is not None and need > free:
        raise ValueError(
            f"solver='direct' cannot run on this model: it has {n:,} parameters, and the "
            f"dense Gauss-Newton matrix with its factor needs {_human(need)} ({need:,} bytes, "
            f"3 x {n:,}^2 x {_itemsize(dtype)} bytes in {dtype}) where {device.type} has "
            f"{_human(free)} free. Use solver='cg', or the default 'auto' (exact steps through "
            "the batch's outputs where they are few enough, else CG)"
        )


def _human(count: int) -> str:
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.3g} {unit}" if unit != "bytes" else f"{count} bytes"
        value /= 1024
    raise AssertionError  # pragma: no cover
