r"""The direct solver for small models, and the choice between it and conjugate gradient.

For a model with ``P`` parameters, the damped Gauss-Newton system

.. math::
    (G + \rho I)\, d = -\hat m

can be solved exactly once ``G`` is formed: ``P`` products ``G e_i`` (batched, so they cost
far less than ``P`` separate products on a small model) and a Cholesky factorization,
:math:`P^3/3` flops. Conjugate gradient costs ``k`` products and is inexact. On models of a
few thousand parameters the exact solve is cheap and lets the damping fall as low as the fit
needs (the high-precision regime where dense Levenberg-Marquardt shines); on large models it is
out of reach (:math:`P^2` memory), and CG is the method.

* :func:`ggn_matrix` forms ``G`` from products with identity columns, in chunks.
* :func:`solve_damped` solves the damped system robustly: Cholesky, and where that fails in
  floating point (an indefinite ``G`` from a non-convex custom loss, or rounding) an
  eigendecomposition with the eigenvalues of ``G`` clipped to ``>= 0``, so the solve never
  returns NaN from a finite matrix.
* :func:`check_direct_fits` refuses, before anything is allocated, a model whose matrix does
  not fit in the device's memory.
* :func:`measure_costs` is ``solver="auto"``'s cost model (:class:`SolverCosts`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["DirectResult", "solve_damped"]

SOLVERS = ("auto", "cg", "direct")

#: How ``solver="auto"`` picks at most this many parameters by default: ``G``, its symmetric
#: copy and its factor take ``3 P^2`` numbers (about 190 MB at 4000 in float32).
DEFAULT_DIRECT_MAX_PARAMS = 4000

#: Why :func:`solve_damped` returned what it returned.
DIRECT_METHODS = ("cholesky", "eigh", "scaled_gradient", "non_finite")


@dataclass(frozen=True)
class DirectResult:
    """The outcome of :func:`solve_damped`, shaped like :class:`~torch_sgn.cg.CGResult`.

    Attributes:
        x: the solution ``d``.
        residual: ``A d - b`` with ``A`` the matrix actually solved (see ``reason``) and
            ``b = -rhs``, so that ``d^T A d = d^T (residual + b)`` as for CG.
        iterations: always 0 (no CG iterations).
        reason: ``"cholesky"``: ``A = G + rho I`` was factored. ``"eigh"``: Cholesky failed,
            ``A = V (max(Lambda, 0) + rho) V^T`` from ``G = V Lambda V^T``. ``"scaled_gradient"``:
            the eigendecomposition did not converge either, ``A = (rho + ||G||_F) I``, which
            bounds ``G + rho I`` from above. ``"non_finite"``: ``G`` or the solution has
            non-finite entries; ``x`` is zero (a breakdown).
    """

    x: Tensor
    residual: Tensor
    iterations: int
    reason: str

    @property
    def breakdown(self) -> bool:
        return self.reason == "non_finite"


def solve_damped(matrix: Tensor, rhs: Tensor, damping: float) -> DirectResult:
    r"""Solves :math:`(G + \rho I)\, d = -\mathrm{rhs}` exactly.

    Args:
        matrix: ``G`` (``P x P``), symmetric positive semi-definite up to rounding; only its
            symmetric part is used.
        rhs: the right-hand side's negative (the gradient, or ``m_hat``), length ``P``.
        damping: :math:`\rho > 0`.

    Returns:
        A :class:`DirectResult`. Its ``x`` is finite whenever ``matrix`` and ``rhs`` are.

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
    if not _all_finite(matrix, rhs):
        zero = torch.zeros_like(rhs)
        return DirectResult(zero, rhs.clone(), 0, "non_finite")
    sym = (matrix + matrix.mT) * 0.5
    damped = sym.clone()
    damped.diagonal().add_(damping)
    factor, info = torch.linalg.cholesky_ex(damped)
    if int(info) == 0:
        x = torch.cholesky_solve(rhs.unsqueeze(1), factor).squeeze(1).neg_()
        del factor
        if _all_finite(x):
            return DirectResult(x, torch.addmv(rhs, damped, x), 0, "cholesky")
    del factor, damped
    try:
        values, vectors = torch.linalg.eigh(sym)
    except RuntimeError:  # torch.linalg.LinAlgError: the iteration did not converge
        scale = damping + float(torch.linalg.matrix_norm(sym))
        x = rhs / -scale
        return DirectResult(x, torch.zeros_like(rhs), 0, "scaled_gradient")
    values = values.clamp_min(0.0).add_(damping)
    x = vectors @ ((vectors.mT @ rhs) / values).neg_()
    if not _all_finite(x):
        return DirectResult(torch.zeros_like(rhs), rhs.clone(), 0, "non_finite")
    residual = vectors @ (values * (vectors.mT @ x)) + rhs  # A d + rhs for the clipped A
    return DirectResult(x, residual, 0, "eigh")


def _all_finite(*tensors: Tensor) -> bool:
    # One sum per tensor is finite exactly when no entry is NaN or infinite, unless finite
    # entries overflow it; the exact test settles that case.
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in tensors)


# --- forming G ---------------------------------------------------------------------------------
def ggn_matrix(
    ggn_vp: Callable[[Tensor], Tensor],
    n: int,
    like: Tensor,
    chunk: Optional[int] = None,
) -> Tensor:
    """``G`` (``n x n``) from products with the identity's columns.

    On a CPU one product per column: batching them with ``torch.func.vmap`` was 3 to 5 times
    slower there (``benchmarks/direct_cost.py``). On other devices the columns go through
    ``vmap`` in chunks of ``chunk``, one batched pass per chunk in place of many small kernel
    launches, and one by one where a product cannot be batched.

    Args:
        ggn_vp: ``v -> G v`` for a flat ``v``.
        n: the number of parameters.
        like: a tensor of the parameters' dtype and device.
        chunk: columns per batched pass; ``None`` picks 64.
    """
    chunk = min(n, 64) if chunk is None else max(1, min(chunk, n))
    out = like.new_empty((n, n))
    products = _products(ggn_vp, like.device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        out[start:stop] = products(_identity_columns(n, start, stop, like))
    # Row i holds G e_i, column i of G; G is symmetric, so these rows are its columns too.
    return out


def _identity_columns(n: int, start: int, stop: int, like: Tensor) -> Tensor:
    """Rows ``start:stop`` of the identity: the unit vectors ``e_start ... e_{stop-1}``."""
    rows = like.new_zeros((stop - start, n))
    rows[:, start:stop].fill_diagonal_(1.0)
    return rows


def _loop(ggn_vp: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
    return torch.stack([ggn_vp(r) for r in rows.unbind(0)])


def _products(
    ggn_vp: Callable[[Tensor], Tensor], device: torch.device
) -> Callable[[Tensor], Tensor]:
    """Products with the rows of a matrix: batched by ``vmap`` off the CPU while that works."""
    use_vmap = device.type != "cpu"
    vmapped = torch.func.vmap(ggn_vp)

    def run(rows: Tensor) -> Tensor:
        nonlocal use_vmap
        if use_vmap:
            try:
                return vmapped(rows)
            except Exception:  # an op without a batching rule (older torch, custom layers)
                use_vmap = False
        return _loop(ggn_vp, rows)

    return run


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
            f"{_human(free)} free. Use solver='cg' (or 'auto', which picks CG above "
            "direct_max_params parameters)"
        )


def _human(count: int) -> str:
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.3g} {unit}" if unit != "bytes" else f"{count} bytes"
        value /= 1024
    raise AssertionError  # pragma: no cover


# --- solver="auto": the cost model -------------------------------------------------------------
@dataclass(frozen=True)
class SolverCosts:
    """Seconds, measured once on this device, of what one step's solve costs each way.

    Attributes:
        product: one ``G v`` product.
        factor: a Cholesky factorization of ``P x P`` (timed at most ``256 x 256`` and scaled
            by ``P^3``).
        matrix: forming ``G`` (``nan`` when not measured: the factorization alone already
            cost more than CG).
        cg_iterations: CG's iteration budget ``k``.
    """

    product: float
    factor: float
    matrix: float
    cg_iterations: int

    @property
    def direct(self) -> float:
        return self.matrix + self.factor

    @property
    def cg(self) -> float:
        return self.cg_iterations * self.product

    @property
    def choice(self) -> str:
        """``"direct"`` when forming and factoring ``G`` costs at most CG's ``k`` products (a
        tie goes to the exact solve), else ``"cg"``."""
        return "direct" if self.direct <= self.cg else "cg"


def measure_costs(
    ggn_vp: Callable[[Tensor], Tensor],
    dense_ggn: Optional[Callable[[], Tensor]],
    n: int,
    like: Tensor,
    cg_iterations: int,
    agree: Callable[[list], list] = lambda values: values,
) -> tuple[SolverCosts, Optional[Tensor]]:
    """``solver="auto"``'s measurement: times one product and a Cholesky factorization; only if
    the factorization is cheaper than CG, also forms ``G`` (returned, so that a step that goes
    on with the direct solve uses it) or, where it comes from products, times one chunk of 64.

    Args:
        ggn_vp: ``v -> G v``.
        dense_ggn: the engine's own route to ``G`` (see
            :meth:`~torch_sgn.linearization.Linearization.ggn_matrix`), or ``None``.
        n: the number of parameters.
        like: a tensor of the parameters' dtype and device.
        cg_iterations: CG's iteration budget.
        agree: maps the measured seconds to the ones every process decides by (the sums over
            a data-parallel group, so that all take the same decision).

    Returns:
        The costs and ``G`` when it was formed, else ``None``.
    """
    v = like.new_ones(n)
    product = _timed(lambda: ggn_vp(v), like.device)
    m = min(n, 256)
    spd = like.new_full((m, m), 1.0 / m)
    spd.diagonal().add_(1.0)
    factor = _timed(lambda: torch.linalg.cholesky_ex(spd), like.device) * (n / m) ** 3
    product, factor = agree([product, factor])
    if factor > cg_iterations * product:
        return SolverCosts(product, factor, math.nan, cg_iterations), None
    matrix = None
    if dense_ggn is not None:
        _sync(like.device)
        start = time.perf_counter()
        matrix = dense_ggn()
        _sync(like.device)
        seconds = time.perf_counter() - start
    else:
        chunk = min(n, 64)
        products = _products(ggn_vp, like.device)
        columns = _identity_columns(n, 0, chunk, like)
        seconds = _timed(lambda: products(columns), like.device) * math.ceil(n / chunk)
    (seconds,) = agree([seconds])
    return SolverCosts(product, factor, seconds, cg_iterations), matrix


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``fn()``, the faster of two calls after a warm-up, device synchronised."""
    fn()
    best = math.inf
    for _ in range(2):  # the faster of two: noise only ever adds time
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
