"""The functional engine: linearizes any model.

:class:`FunctionalEngine` takes ``J v`` by forward-mode AD, which re-runs the forward pass at
every product (or, where an operator has no forward-mode rule, as
:mod:`torch_sgn.model.forward_mode` finds), and ``J^T u`` through the autograd graph of the
gradient's forward pass.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from ..batch import Batch
from ..diagnostics import warn
from ..linearization import Linearization, loss_and_output_gradient
from ..losses import OutputLoss
from ..model.flat_model import FunctionalModel, check_depends
from ..model.forward_mode import (
    SWITCHES,
    gradient_stop_notice,
    jvp_by_double_backward,
    missing_rule,
    switch_for,
)

__all__ = ["FunctionalEngine"]


class FunctionalEngine:
    """Loss, gradient and a ``G v`` closure from one forward pass, for any model.

    The forward pass that gives the gradient is recorded once and its graph kept: ``J^T u``
    reuses it at every product. ``J v`` uses forward-mode AD (``torch.func.jvp``), which
    re-runs the forward pass with tangents. Where an operator has no forward-mode rule, the
    first product finds out and the engine adapts for good (:mod:`torch_sgn.model.forward_mode`):
    ``J v`` by double backward, on kernels whose backward is differentiable; it warns once,
    and the step records its forward pass again under the change.
    """

    def __init__(self, fmodel: FunctionalModel, loss: OutputLoss):
        self.fmodel, self.loss = fmodel, loss
        #: ``J v`` by double backward instead of forward mode (decided by the first product)
        self.double_backward = False

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        if not self.double_backward:
            stop = self.fmodel.gradient_stop(flat, batch.inputs)
            if stop is not None:
                self.double_backward = True
                warn(gradient_stop_notice(stop))
        point = self._record(flat, batch, buffers_out, check=True)
        value, grad = point.value, point.grad

        def ggn_vp(v: Tensor) -> Tensor:
            nonlocal point
            changes = []
            while True:
                try:
                    jv = point.jvp(v)  # v -> J v
                    break
                except _NotReplayed:
                    self.double_backward = True
                    changes.append(
                        "forward-mode AD did not replay the recorded forward pass (its outputs "
                        "differ: dropout drawn differently inside some operator): J v is taken "
                        "by double backward from now on, through the recorded pass itself"
                    )
                    point = self._record(flat, batch, None, check=False)
                except (NotImplementedError, RuntimeError) as error:
                    changes.append(self._adapt(error))  # re-raises what it cannot get around
                    # The products of one step share one recorded forward pass, on the new
                    # route and kernels (attention dropout draws differently in each kernel).
                    point = self._record(flat, batch, None, check=False)
            if changes:
                warn(
                    "; ".join(changes)
                    + ". Products stay exact; this is decided once for this model"
                )
            return vjp(point.hessian(jv))  # -> H J v -> J^T H J v

        def vjp(u: Tensor) -> Tensor:  # J^T u through the recorded pass of this step
            with torch.enable_grad():
                (jtu,) = torch.autograd.grad(point.outputs, point.leaf, u, retain_graph=True)
            return jtu

        return Linearization(value, grad, ggn_vp, outputs=point.outputs.detach(), vjp=vjp)

    def _record(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict], check: bool
    ) -> _Point:
        fmodel, loss, inputs, targets = self.fmodel, self.loss, batch.inputs, batch.targets
        leaf = flat.detach().requires_grad_(True)
        with torch.enable_grad():
            outputs = fmodel(leaf, inputs, buffers_out=buffers_out)
            check_depends(outputs)
            value, dz = loss_and_output_gradient(loss, outputs, targets, check=check)
            if self.double_backward:  # the gradient's backward pass also records J v's graph
                grad, jvp = jvp_by_double_backward(outputs, leaf, dz)
            else:
                (grad,) = torch.autograd.grad(
                    outputs, leaf, dz, retain_graph=True, allow_unused=True
                )
                check_depends(outputs, grad)
                base = flat.detach()
                # torch.func.jvp refuses the requires_grad_() of a forward that calls
                # autograd itself; forward_ad's dual tensors nest in it
                forward_mode = _dual_jvp if fmodel.calls_autograd else _func_jvp
                unchecked = [fmodel.model.training]

                def jvp(v: Tensor) -> Tensor:
                    primal, tangent = forward_mode(lambda p: fmodel(p, inputs), base, v)
                    if unchecked:  # once per step: does forward mode replay the recorded pass?
                        unchecked.clear()
                        if not _same(primal, outputs.detach()):
                            raise _NotReplayed()
                    return tangent

        hessian = loss.hessian(outputs.detach(), targets)
        return _Point(value, grad, leaf, outputs, hessian, jvp)

    def _adapt(self, error: BaseException) -> str:
        """Gets around the operator ``error`` names (or re-raises); returns the operator and
        what changed, for the warning.

        A missing forward-mode rule turns on double backward (before any switch to a kernel
        that has a rule; its cost is in ``docs/PERFORMANCE.md``). An operator whose backward is
        not differentiable in turn (the fused attention kernels) is switched to a kernel whose
        backward is.
        """
        op = missing_rule(error)
        if op is None:
            raise error
        if not self.double_backward:
            self.double_backward = True
            return (
                f"forward-mode AD has no rule for {op}: J v is taken by double backward from "
                "now on, J v = d/du [(J^T u) . v]; a product then costs about two backward "
                "passes, and the graph of u -> J^T u (recorded with the gradient) is kept "
                "through the step"
            )
        switch = switch_for(op)
        if switch is not None and switch not in self.fmodel.switches:
            self.fmodel.switches = self.fmodel.switches | {switch}
            return f"{op} is not differentiable: the model runs with {SWITCHES[switch]}"
        hint = ""
        if "embedding_bag" in op:
            hint = (
                " (call F.embedding_bag or nn.EmbeddingBag, which SGN runs as differentiable "
                "operators)"
            )
        raise RuntimeError(
            "cannot take Gauss-Newton products: an operator has no forward-mode rule and its "
            f"backward is not differentiable either ({op}: {error}); replace that operation "
            f"by differentiable ones{hint} or give it a jvp"
        ) from error


def _func_jvp(f: Callable[[Tensor], Tensor], x: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """``f(x)`` and ``J_f(x) v`` by ``torch.func.jvp``."""
    return torch.func.jvp(f, (x,), (v,))


def _dual_jvp(f: Callable[[Tensor], Tensor], x: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """``f(x)`` and ``J_f(x) v`` by the dual tensors of ``torch.autograd.forward_ad``, for an
    ``f`` that calls ``torch.autograd.grad`` itself (a residual model's ``u_xx``): autograd's
    backward passes inside ``f`` carry the tangents, while ``torch.func.jvp`` refuses the
    ``requires_grad_()`` they start from. (Its own forward mode cannot nest inside:
    :data:`~torch_sgn.model.forward_mode.NESTED_FORWARD`.)"""
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(f(fwAD.make_dual(x, v)))
    # the derivatives inside f recorded a graph from the inputs; the products need none
    return primal.detach(), tangent.detach()


class _NotReplayed(Exception):
    """The forward-mode pass computed other outputs than the recorded pass."""


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal up to rounding (kernels that are not bitwise reproducible), not up to a mask."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool((a - b).abs().max() <= 1e-4 * scale + 1e-30) if b.numel() else True


class _Point:
    """What the products of one step share: the recorded forward pass and ``v -> J v``."""

    def __init__(self, value, grad, leaf, outputs, hessian, jvp):
        self.value, self.grad, self.leaf, self.outputs = value, grad, leaf, outputs
        self.hessian, self.jvp = hessian, jvp
