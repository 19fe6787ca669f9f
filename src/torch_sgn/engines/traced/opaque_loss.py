"""A loss callable that a trace cannot follow, called as it is from inside the traced graphs.

A trace records the loss's operators with the model's. A loss callable that branches on the
values of its tensors (``F.gaussian_nll_loss`` checks ``torch.any(var < 0)``; a loss of one's
own may call ``.item()``) cannot be recorded at fixed shapes. :class:`OpaqueLoss` wraps such a
loss for the trace: the graph then calls two operators of this package,
``torch_sgn::loss_value_and_grad`` (the loss and its gradient in the outputs) and
``torch_sgn::loss_hvp`` (its output-space Hessian times a vector), which run the loss eagerly
each time the graph runs, its checks included. The model's part stays traced; the loss's part
costs what it costs eagerly, and the graphs are not captured as CUDA graphs (the loss's Python
runs at every call).

The operators find the loss by an integer key (an operator takes no Python object): a registry
of weak references, so a loss is not kept alive by it. Their namespace is the package's name
(``torch_sgn``; another copy of the package imported under another name registers its own).
"""

import itertools
import weakref
from typing import Callable, Tuple

import torch
from torch import Tensor, fx

from ...losses import OutputLoss

__all__ = ["OPERATORS", "OpaqueLoss", "calls_opaque_loss", "value_and_grad"]

# (No `from __future__ import annotations` here: torch.library.custom_op reads the operators'
# schemas from their annotations, kept as types rather than strings.)
_NAMESPACE = __name__.split(".")[0]
_LOSSES: weakref.WeakValueDictionary[int, OutputLoss] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


# An operator runs below autograd's dispatch key, where torch.autograd records nothing: its
# derivatives are torch.func's, which keep their own.
def _of(key: int, targets: Tensor) -> Callable[[Tensor], Tensor]:
    loss = _LOSSES[key]
    return lambda z: loss.value(z, targets)


@torch.library.custom_op(f"{_NAMESPACE}::loss_value_and_grad", mutates_args=())
def _value_and_grad(key: int, outputs: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
    dz, value = torch.func.grad_and_value(_of(key, targets))(outputs)
    return value.clone(), dz.clone()


@_value_and_grad.register_fake
def _(key: int, outputs: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
    return outputs.new_empty(()), torch.empty_like(outputs)


@torch.library.custom_op(f"{_NAMESPACE}::loss_hvp", mutates_args=())
def _hvp(key: int, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
    # reverse over reverse, as the loss's own products (H is symmetric: u^T H = (H u)^T)
    _, pullback = torch.func.vjp(torch.func.grad(_of(key, targets)), outputs)
    return pullback(u)[0].clone()


@_hvp.register_fake
def _(key: int, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
    return torch.empty_like(u)


_OPS = getattr(torch.ops, _NAMESPACE)
#: The operators an opaque loss puts in a graph.
OPERATORS = (_OPS.loss_value_and_grad.default, _OPS.loss_hvp.default)


class OpaqueLoss(OutputLoss):
    """``loss`` as the operators above, for a trace; its values are ``loss``'s."""

    def __init__(self, loss: OutputLoss):
        self.loss = loss
        self.key = next(_KEYS)
        _LOSSES[self.key] = loss
        for name in ("name", "reduction", "closed_form"):
            if hasattr(loss, name):
                setattr(self, name, getattr(loss, name))

    def value_and_grad(self, outputs: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
        return _OPS.loss_value_and_grad(self.key, outputs.detach(), targets)

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return self.value_and_grad(outputs, targets)[0]

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        return _OPS.loss_hvp(self.key, outputs.detach(), targets, u)

    def hessian(self, outputs: Tensor, targets: Tensor) -> Callable[[Tensor], Tensor]:
        return lambda u: self.hvp(outputs, targets, u)


def value_and_grad(loss: OutputLoss, z: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor]:
    """The loss at the outputs ``z`` (a leaf that requires grad) and its gradient in them:
    through the opaque operator, or through autograd (recorded by the trace)."""
    if isinstance(loss, OpaqueLoss):
        return loss.value_and_grad(z, targets)
    value = loss.value(z, targets)
    (dz,) = torch.autograd.grad(value, z)
    return value, dz


def calls_opaque_loss(graph: fx.GraphModule) -> bool:
    """Whether the graph calls an opaque loss's operators."""
    nodes = graph.graph.nodes
    return any(node.op == "call_function" and node.target in OPERATORS for node in nodes)
