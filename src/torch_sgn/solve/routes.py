"""Which descent (:mod:`~torch_sgn.solve.descents`) a step takes: the route rule of
``SGN(solver=...)``.

A rule on sizes and on what the engine offers, never a timing, so that a run takes the same
steps on every machine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linearization import Linearization
from . import direct
from .descents import CG, MATRIX, SAMPLED, SAMPLES

__all__ = ["choose_route", "fits", "matrix_fits", "samples_fit"]


def choose_route(
    solver: str,
    lin: Linearization,
    rhs: Tensor,
    numel: int,
    device: torch.device,
    cg_iters: int,
    max_params: int,
) -> str:
    """How this step solves: ``"cg"``, ``"matrix"`` directly through the ``P x P`` matrix ``G``,
    ``"samples"`` directly through the batch's outputs
    (:func:`~torch_sgn.solve.direct.solve_in_sample_space`), ``"sampled"`` by CG on every row
    preconditioned by a sample of them, where the linearization offers that sample (a residual
    problem too large for either matrix, :mod:`torch_sgn.many_rows`).

    ``solver="auto"``: the direct solver wherever its matrix has at most ``max_params`` rows,
    through the outputs where they are fewer than the parameters, and through ``G`` only where
    the engine forms it from the per-sample Jacobian (or ``P <= cg_iters``): from products with
    the identity's columns ``G`` costs ``P`` products, which on a model of thousands of
    parameters is hundreds of times CG's ``k``. Else CG.

    Raises:
        ValueError: ``solver="direct"`` on a step whose ``P x P`` matrices do not fit in the
            device's free memory and that cannot go through the outputs.
    """
    if solver == "cg":
        return CG
    if lin.rows is not None and rhs is lin.grad:  # too many rows for either matrix
        return SAMPLED
    if samples_fit(solver, lin, rhs, numel, device, max_params):
        return SAMPLES
    if solver == "direct":
        try:  # raised here, before the step changes anything
            direct.check_direct_fits(numel, torch.float64, device)
        except ValueError as e:
            raise ValueError(
                f"{e}. This step could not go through the batch's outputs either (that "
                "route needs fewer outputs than parameters, no momentum, one process and "
                "a chain of linear layers and activations); the step was not taken"
            ) from None
        return MATRIX
    cheap = lin.dense_ggn is not None or numel <= cg_iters
    return MATRIX if cheap and matrix_fits(numel, device, max_params) else CG


def samples_fit(
    solver: str,
    lin: Linearization,
    rhs: Tensor,
    numel: int,
    device: torch.device,
    max_params: int,
) -> bool:
    """Whether the step can be solved through the batch's outputs, more cheaply than through
    ``G`` (fewer outputs than parameters, the plain gradient as right-hand side), within
    ``max_params`` for ``"auto"`` and in the free memory."""
    space = lin.sample_space
    if space is None or rhs is not lin.grad or space.size >= numel:
        return False
    if solver == "auto" and space.size > max_params:
        return False
    return fits(space.size, device)


def matrix_fits(numel: int, device: torch.device, max_params: int) -> bool:
    """Whether ``solver="auto"`` may form the ``P x P`` matrix: at most ``max_params`` rows, in
    the free memory."""
    return numel <= max_params and fits(numel, device)


def fits(n: int, device: torch.device) -> bool:
    """Whether the direct solver's ``n x n`` float64 matrices fit in the device's free memory."""
    try:
        direct.check_direct_fits(n, torch.float64, device)
    except ValueError:
        return False
    return True
