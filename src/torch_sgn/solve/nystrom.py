r"""A randomized Nystrom preconditioner for conjugate gradient on ``(G + rho I) d = -g``.

For a symmetric positive semi-definite ``A`` (``P x P``, here the Gauss-Newton matrix ``G``)
known only through products, a test matrix :math:`\Omega` (``P x s``, Gaussian, orthonormalized)
and the ``s`` products :math:`Y = A\Omega` give the Nystrom approximation

.. math::
    \hat A = Y (\Omega^\top Y)^{+} Y^\top = U \hat\Lambda U^\top,

rank ``s``, :math:`U^\top U = I`, :math:`\hat\Lambda = \operatorname{diag}(\hat\lambda_1 \ge
\dots \ge \hat\lambda_s \ge 0)`. It captures the top of the spectrum, which is what makes
``A + rho I`` ill-conditioned; the preconditioner flattens it and leaves the rest alone:

.. math::
    P^{-1} = (\hat\lambda_s + \rho)\, U (\hat\Lambda + \rho I)^{-1} U^\top + (I - U U^\top).

When ``s`` exceeds the effective dimension :math:`d_\text{eff}(\rho) = \sum_i \lambda_i /
(\lambda_i + \rho)` (about ``2 d_eff + 1`` suffices), the preconditioned matrix
:math:`P^{-1/2} (A + \rho I) P^{-1/2}` has a condition number of order 1 in expectation,
whatever the condition of ``A + rho I`` (the paper's Theorem 5.1 and Proposition 5.3), and CG
converges in a few tens of iterations.

One approximation serves every damping and, while ``A`` changes slowly, several steps: the
caller rebuilds it every few steps.

References:
    Z. Frangella, J. A. Tropp, M. Udell, "Randomized Nystrom Preconditioning", SIAM J. Matrix
    Anal. Appl. 44(2), 2023 (Algorithm 2.1, the approximation; Eq. (5.3), the preconditioner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["NystromApproximation", "NystromCache", "nystrom"]

#: Tries of the stabilizing shift, each ten times the last, before the Cholesky factor is given up.
_SHIFT_TRIES = 6


@dataclass(frozen=True)
class NystromApproximation:
    r"""A low-rank approximation :math:`\hat A = U \operatorname{diag}(\hat\lambda) U^\top`.

    Attributes:
        eigenvectors: ``U``, ``(P, s)`` with orthonormal columns, float64.
        eigenvalues: :math:`\hat\lambda`, ``(s,)``, non-increasing and ``>= 0``, float64.
        dtype: the dtype of the vectors the preconditioner is applied to (the products').
        rank: ``s``, the number of eigenpairs kept.
    """

    eigenvectors: Tensor
    eigenvalues: Tensor
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return self.eigenvalues.shape[0]

    def __matmul__(self, v: Tensor) -> Tensor:
        """:math:`\\hat A v`, in float64 (for checks)."""
        u = self.eigenvectors
        return u @ (self.eigenvalues[:, None] * (u.T @ v.to(u.dtype).reshape(u.shape[0], -1)))

    def preconditioner(self, damping: float) -> Callable[[Tensor], Tensor]:
        r"""``v -> P^{-1} v`` for ``A + damping I``, for :func:`conjugate_gradient`.

        .. math::
            P^{-1} v = v + U \Big(\frac{\hat\lambda_s + \rho}{\hat\lambda + \rho} - 1\Big)
            \odot (U^\top v),

        two products with the ``P x s`` matrix ``U`` (``4 P s`` flops). :math:`P^{-1}` is
        symmetric positive definite for ``damping > 0``, with eigenvalues in
        :math:`[(\hat\lambda_s + \rho) / (\hat\lambda_1 + \rho), 1]`.

        Args:
            damping: :math:`\rho > 0`, the damping of the system CG solves.

        Returns:
            The function ``v -> P^{-1} v`` (``v`` of length ``P``, in :attr:`dtype`).

        Raises:
            ValueError: ``damping`` is not positive.

        .. note::
            The paper's Eq. (5.3) uses :math:`\hat\lambda_s`, the smallest eigenvalue kept.
            A zero :math:`\hat\lambda_s` (a matrix of rank below ``s``) is allowed: the
            preconditioner then also scales down the directions the approximation holds.
        """
        if not damping > 0:
            raise ValueError(f"damping must be > 0, got {damping}")
        lam = self.eigenvalues
        scale = ((lam[-1] + damping) / (lam + damping) - 1.0).to(self.dtype)
        u = self.eigenvectors.to(self.dtype)

        def apply(v: Tensor) -> Tensor:
            return v + u @ (scale * (u.T @ v))

        return apply


def nystrom(
    matvec: Callable[[Tensor], Tensor],
    n: int,
    rank: int,
    like: Tensor,
    *,
    generator: Optional[torch.Generator] = None,
    vmap: bool = True,
    chunk_size: Optional[int] = None,
) -> NystromApproximation:
    r"""The randomized Nystrom approximation of a PSD matrix from ``rank`` products.

    The numerically stable form of the paper's Algorithm 2.1, in float64 whatever ``like``'s
    dtype:

    .. math::
        \Omega = \operatorname{qr}(\text{randn}(n, s)),\quad Y = A\Omega,\quad
        \nu = \sqrt{n}\,\epsilon(\|Y\|_2),\quad Y_\nu = Y + \nu\Omega,\quad
        C = \operatorname{chol}(\Omega^\top Y_\nu),\quad B = Y_\nu C^{-1},

    then :math:`B = U \Sigma V^\top` (thin SVD) and :math:`\hat\Lambda = \max(0, \Sigma^2 - \nu
    I)`: the approximation of the shifted matrix :math:`A + \nu I`, whose Gram matrix is
    positive definite in floating point, shifted back.

    Args:
        matvec: ``v -> A v`` for ``A`` symmetric positive semi-definite, ``n x n``.
        n: the size of ``A``.
        rank: ``s``, the number of products (and the rank of the approximation), ``1 <= s <=
            n``.
        like: a tensor with the dtype and device of ``matvec``'s vectors.
        generator: draws :math:`\Omega` (on ``like``'s device); the global one when ``None``.
        vmap: compute the ``s`` products as one :func:`torch.func.vmap` of ``matvec``; where
            ``matvec`` cannot be vmapped (it calls ``autograd.grad`` or ``.item()``, say), one
            product at a time. ``False`` always loops: faster where vmap falls back to a slow
            batching rule (GGN products of a forward-Laplacian PINN, ``addmm_``: 5.2 s batched
            against 3.6 s looped for 100 products, ``benchmarks/pinns/nystrom_pinn.py``).
        chunk_size: products per vmapped call (all ``s`` at once when ``None``): bounds the
            memory of the batched product.

    Returns:
        A :class:`NystromApproximation`; :meth:`NystromApproximation.preconditioner` gives
        ``P^{-1}`` for any damping.

    Raises:
        ValueError: ``rank`` is outside ``[1, n]``, ``matvec`` returns vectors of another
            length, or the Gram matrix stays indefinite after the shifts (``matvec`` is not
            symmetric positive semi-definite).

    References:
        Frangella, Tropp, Udell, "Randomized Nystrom Preconditioning", SIAM J. Matrix Anal.
        Appl. 2023, Algorithm 2.1 (after Tropp, Yurtsever, Udell, Cevher 2017, Algorithm 3).

    .. note::
        Where the Cholesky factorization of :math:`\Omega^\top Y_\nu` still fails (``matvec``
        slightly indefinite, or inexact in float32), the shift is raised tenfold and the
        factorization retried, a few times, before giving up; the paper stops there.
    """
    if not 1 <= rank <= n:
        raise ValueError(f"rank must be in [1, n={n}], got {rank}")
    f64 = torch.float64
    omega = torch.randn(n, rank, generator=generator, dtype=f64, device=like.device)
    omega, _ = torch.linalg.qr(omega)
    y = _products(matvec, omega.to(like.dtype), vmap, chunk_size).to(f64)
    if y.shape != (n, rank):
        raise ValueError(f"matvec returned {tuple(y.shape[:1])} for vectors of length {n}")
    norm = torch.linalg.matrix_norm(y, ord=2).item()
    eps = torch.finfo(f64).eps
    nu = math.sqrt(n) * eps * max(norm, torch.finfo(f64).tiny)
    for _ in range(_SHIFT_TRIES):
        y_nu = y + nu * omega
        gram = omega.T @ y_nu
        chol, info = torch.linalg.cholesky_ex(0.5 * (gram + gram.T))
        if info.item() == 0:
            break
        nu *= 10.0
    else:
        raise ValueError(
            "the Nystrom Gram matrix is not positive definite: is matvec symmetric positive "
            "semi-definite?"
        )
    # B = Y_nu C^{-T} with C lower triangular (C C^T = Omega^T Y_nu): B B^T = Y_nu (.)^{-1} Y_nu^T
    b = torch.linalg.solve_triangular(chol, y_nu.T, upper=False).T
    u, sigma, _ = torch.linalg.svd(b, full_matrices=False)
    lam = torch.clamp(sigma.square() - nu, min=0.0)
    return NystromApproximation(u, lam, like.dtype)


class NystromCache:
    """The approximation CG steps share (``SGN(preconditioner="nystrom")``): the one built at
    most ``every`` steps ago, else a new one of rank ``min(rank, P)`` from ``G v`` products at
    the step's point and batch, its draws seeded with the step. Not saved: a loaded or copied
    optimizer builds its own at its next step."""

    def __init__(self) -> None:
        self._built: Optional[tuple] = None  # (step built, approximation)

    def reset(self) -> None:
        self._built = None

    def at(
        self, matvec: Callable[[Tensor], Tensor], rhs: Tensor, t: int, rank: int, every: int
    ) -> NystromApproximation:
        built = self._built
        if (
            built is None
            or not 0 <= t - built[0] < every
            or built[1].eigenvectors.shape[0] != rhs.numel()  # the trainable set changed
        ):
            self._built = None  # its memory free before the new one is built
            n = rhs.numel()
            gen = torch.Generator(device=rhs.device).manual_seed(t)
            # One product at a time: the engines' products are not all batchable by vmap,
            # and a batch of ``rank`` products would hold ``rank`` times their memory.
            built = self._built = (
                t,
                nystrom(matvec, n, min(rank, n), rhs, generator=gen, vmap=False),
            )
        return built[1]


def _products(
    matvec: Callable[[Tensor], Tensor], omega: Tensor, vmap: bool, chunk_size: Optional[int]
) -> Tensor:
    """``A Omega`` column by column: batched by vmap where ``matvec`` allows it."""
    if vmap:
        try:
            return torch.func.vmap(matvec, in_dims=1, out_dims=1, chunk_size=chunk_size)(omega)
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            pass  # not vmappable: the loop below raises whatever error is the matvec's own
    return torch.stack([matvec(c) for c in omega.unbind(1)], 1)
