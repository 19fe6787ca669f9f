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
* :func:`measure_costs` and :func:`choose_solver` are ``solver="auto"``'s cost model.
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
    """``G`` (``n x n``) from products with identity columns.

    Columns go through ``torch.func.vmap`` in chunks of ``chunk`` (one batched pass per chunk:
    on a small model, many products cost little more than one), or one product at a time where
    the product cannot be batched.

    Args:
        ggn_vp: ``v -> G v`` for a flat ``v``.
        n: the number of parameters.
        like: a tensor of the parameters' dtype and device.
        chunk: columns per batched pass; ``None`` picks all of them up to 256.
    """
    chunk = min(n, 256) if chunk is None else max(1, min(chunk, n))
    out = like.new_empty((n, n))
    batched = _batched(ggn_vp)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        out[start:stop] = batched(_identity_columns(n, start, stop, like))
    # Row i holds G e_i, column i of G; G is symmetric, so these rows are its columns too.
    return out


def _identity_columns(n: int, start: int, stop: int, like: Tensor) -> Tensor:
    """Rows ``start:stop`` of the identity: the unit vectors ``e_start ... e_{stop-1}``."""
    rows = like.new_zeros((stop - start, n))
    rows[:, start:stop].fill_diagonal_(1.0)
    return rows


def _loop(ggn_vp: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
    return torch.stack([ggn_vp(r) for r in rows.unbind(0)])


def _batched(ggn_vp: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """Products with the rows of a matrix, batched by ``vmap`` while that works."""
    vmapped = torch.func.vmap(ggn_vp)

    def run(rows: Tensor) -> Tensor:
        nonlocal use_vmap
        if use_vmap:
            try:
                return vmapped(rows)
            except Exception:  # an op without a batching rule (old torch, custom layers)
                use_vmap = False
        return _loop(ggn_vp, rows)

    use_vmap = True
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
    """Seconds measured once per model and batch shape, on this device.

    Attributes:
        product: one ``G v`` product.
        matrix: forming ``G`` (estimated from one chunk of columns).
        factor: a Cholesky factorization of ``G`` (estimated from a smaller one by ``P^3``).
    """

    product: float
    matrix: float
    factor: float

    @property
    def direct(self) -> float:
        return self.matrix + self.factor

    def cg(self, iterations: int) -> float:
        return iterations * self.product


def choose_solver(costs: SolverCosts, cg_iterations: int) -> str:
    """``"direct"`` when forming and factoring ``G`` costs at most CG's ``cg_iterations``
    products; else ``"cg"``. The direct step is exact, CG's is not: a tie goes to direct."""
    return "direct" if costs.direct <= costs.cg(cg_iterations) else "cg"


def measure_costs(
    ggn_vp: Callable[[Tensor], Tensor], n: int, like: Tensor, chunk: Optional[int] = None
) -> SolverCosts:
    """Times one product, one chunk of :func:`ggn_matrix` and a Cholesky factorization of at
    most ``256 x 256``, each after a warm-up call, and scales them to ``G`` of size ``n``.

    The chunk is at most 64 columns and the factorization at most 256: a few products' worth of
    work, spent once per model and batch shape.
    """
    chunk = min(n, 64) if chunk is None else max(1, min(chunk, n))
    v = like.new_ones(n)
    product = _timed(lambda: ggn_vp(v), like.device)
    batched = _batched(ggn_vp)
    columns = _identity_columns(n, 0, chunk, like)
    block = _timed(lambda: batched(columns), like.device)
    matrix = block * math.ceil(n / chunk)
    m = min(n, 256)
    spd = like.new_zeros((m, m))
    spd.diagonal().fill_(1.0)
    spd += 1.0 / m  # an SPD matrix of the dtype and device
    factor = _timed(lambda: torch.linalg.cholesky_ex(spd), like.device) * (n / m) ** 3
    return SolverCosts(product=product, matrix=matrix, factor=factor)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``fn()``, the faster of two calls after a warm-up, device synchronised."""
    fn()
    best = math.inf
    for _ in range(2):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
