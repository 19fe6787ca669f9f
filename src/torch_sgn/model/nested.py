"""Whether a model's ``forward`` differentiates its own output by nested autograd, and the notice
SGN gives once where it does.

A physics-informed network written the usual way takes its input derivatives in ``forward`` by
``torch.autograd.grad(..., create_graph=True)``. No engine forms the Jacobian of such a forward
cheaply, so ``solver="auto"`` steps by conjugate gradient through the nested graph
(:func:`torch_sgn.solve.auto.cg_settings`); the same problem written with
:mod:`torch_sgn.pinn`'s operators takes exact steps at a fraction of the cost, which
:data:`NOTICE` says with the measured figures.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

import torch
from torch import Tensor

from ..diagnostics import warn

__all__ = ["NOTICE", "nested_autograd", "warn_if_nested"]

#: What SGN says once where a model's forward uses nested autograd (figures from
#: ``benchmarks/pinn_autograd.py``'s record, ``docs/PINN.md``).
NOTICE = (
    "this model's forward differentiates its output with respect to its input by nested "
    "autograd (torch.autograd.grad with create_graph=True): SGN steps by preconditioned "
    "conjugate gradient through the nested graph. Written with torch_sgn.pinn (Residuals and its "
    "operators: laplacian, gradient, hessian, derivative), the same problem takes exact "
    "Gauss-Newton steps: on a nonlinear Poisson problem (benchmarks/pinn_autograd.py, "
    "docs/PINN.md) {steps} as many steps in the same CPU time, and {error} lower error"
)


@contextmanager
def _counting_grad(calls: List[int]) -> Iterator[None]:
    original = torch.autograd.grad

    def grad(*args, **kwargs):
        if kwargs.get("create_graph"):
            calls.append(1)
        return original(*args, **kwargs)

    torch.autograd.grad = grad
    try:
        yield
    finally:
        torch.autograd.grad = original


def _double_backward_nodes(outputs: Tensor, limit: int = 100_000) -> bool:
    """Whether the outputs' graph holds a node of a backward formula's own derivative."""
    seen, stack = set(), [outputs.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "BackwardBackward" in type(node).__name__:
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def nested_autograd(fmodel, flat: Tensor, inputs) -> bool:
    """Whether the model's forward at ``flat`` on ``inputs`` calls ``torch.autograd.grad``
    with ``create_graph=True``, or its output's graph differentiates a backward formula."""
    calls: List[int] = []
    with torch.enable_grad(), _counting_grad(calls):
        outputs = fmodel(flat.detach().requires_grad_(True), inputs)
    return bool(calls) or (isinstance(outputs, Tensor) and _double_backward_nodes(outputs))


def warn_if_nested(fmodel, flat: Tensor, inputs, steps: str = "", error: str = "") -> None:
    """Warns once (:data:`NOTICE`) where the model's forward uses nested autograd."""
    try:
        nested = nested_autograd(fmodel, flat, inputs)
    except Exception:  # noqa: BLE001 - a notice, never a failure of the step
        return
    if nested:
        warn(NOTICE.format(steps=steps, error=error))
