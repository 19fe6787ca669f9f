"""DeepXDE's ``dde.grad.jacobian`` and ``dde.grad.hessian``, answered from a forward jet.

DeepXDE's PDE functions take derivatives of the network's output by nested autograd
(``torch.autograd.grad(..., create_graph=True)``). Inside a residual block of
:mod:`torch_sgn.deepxde.problem` they are answered instead from the network's jet at the block's
points: its value, input gradient and the second partials the PDE asks for, pushed forward
through the layers (:func:`torch_sgn.pinn.hessian_jet`). The residuals are then ordinary
functions of the parameters: the layers' factors (:mod:`torch_sgn.pinn.layer_kernel`) follow
them, and SGN's exact steps cost what they cost on a problem written with
:mod:`torch_sgn.pinn`.

* :func:`chain_of` (:mod:`.networks`): a DeepXDE ``FNN`` or ``PFNN``, with a feature transform
  or none, as an ``nn.Sequential`` over its own linear layers, which the forward jets take;
* :func:`network_jet`: the jet of the network (its output transform included) at points;
* :class:`Answers`: the derivatives a PDE asks for, from one jet; :func:`answering` puts them in
  place of ``dde.grad``'s for the length of a call.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..pinn.operators import HessianJet, hessian_jet, jet
from .networks import chain_of

__all__ = ["Answers", "answering", "chain_of", "network_jet"]

Pair = Tuple[int, int]


def network_jet(
    net: nn.Module, chain: Optional[nn.Sequential], x: Tensor, pairs: Sequence[Pair]
) -> HessianJet:
    """The value, input gradient and second partials ``pairs`` (both orders; the others are
    not computed and hold zeros) of ``net`` at ``x``: through ``chain`` by forward propagation
    where there is one, then through the output transform; by ``torch.func`` otherwise."""
    if chain is None:
        return hessian_jet(net, x, method="func")
    base = _chain_jet(chain, x, pairs)
    transform = getattr(net, "_output_transform", None)
    return base if transform is None else _transformed(transform, x, base, bool(pairs))


def _chain_jet(chain: nn.Sequential, x: Tensor, pairs: Sequence[Pair]) -> HessianJet:
    if not pairs:
        first = jet(chain, x, laplacian_dims=(), method="forward")
        n, m, d = first.value.shape[0], first.value.shape[1], x.shape[1]
        return HessianJet(first.value, first.gradient, first.value.new_zeros(n, m, d, d))
    return hessian_jet(chain, x, method="forward", pairs=pairs)


def _transformed(transform: Callable, x: Tensor, base: HessianJet, second: bool) -> HessianJet:
    """The jet of ``transform(x, net(x))`` from ``net``'s: the transform applied, per point, to
    the second-order Taylor polynomial of the network at that point, differentiated there."""

    def at(xp: Tensor, x0: Tensor, n0: Tensor, g0: Tensor, h0: Tensor) -> Tensor:
        dx = xp - x0
        taylor = n0 + g0 @ dx
        if second:
            taylor = taylor + 0.5 * torch.einsum("mkl,k,l->m", h0, dx, dx)
        return transform(xp[None], taylor[None])[0]

    args = (x, x, base.value, base.gradient, base.hessian)
    value = transform(x, base.value)
    grad = torch.func.vmap(torch.func.jacrev(at))(*args)
    if not second:
        n, m, d = value.shape[0], value.shape[1], x.shape[1]
        return HessianJet(value, grad, value.new_zeros(n, m, d, d))
    hess = torch.func.vmap(torch.func.jacfwd(torch.func.jacrev(at)))(*args)
    return HessianJet(value, grad, hess)


class Answers:
    """``dde.grad.jacobian(ys, xs, i, j)`` and ``dde.grad.hessian(ys, xs, component, i, j)``
    for ``xs`` the block's points and ``ys`` the network's output there, or a derivative these
    answers returned (a PDE that differentiates ``u_x`` again, the Euler beam's hessian of a
    hessian), from the jet ``jet_at(pairs)`` (:func:`network_jet`) and, past the second order,
    ``higher_at(dim, order)`` (derivatives of order 3 and 4 along one coordinate).

    The first call's jet has the second partials ``pairs`` (those the function asked for
    before: :attr:`asked` after a call); one it did not take costs another jet with all of them.

    A PDE may also differentiate what it computed from these tensors, to the first order: a
    component sliced from the output (``u, a = ua[:, 0:1], ua[:, 1:2]``, which then stands for
    that component), and sums, products, quotients, powers and ``sin``, ``cos``, ``exp``,
    ``tanh`` of the output, its first derivatives and the points (PINNacle's inverse problems:
    ``dde.grad.jacobian(a * u_x, x, i=0, j=0)``). While the PDE runs (:func:`answering`), each
    such tensor is recorded with how it was made (:meth:`record`); its gradient in the points
    is formed only when it is differentiated, by the chain rule from the jet's first and second
    partials. Tensors that do not come from the points (data, the network's parameters) are
    constants, as they are to DeepXDE's autograd.
    """

    def __init__(
        self,
        x: Tensor,
        jet_at: Callable[[Sequence[Pair]], HessianJet],
        pairs: Sequence[Pair],
        higher_at: Optional[Callable[[int, int], Tensor]] = None,
    ):
        self.x, self._jet_at, self._higher_at = x, jet_at, higher_at
        self._pairs = tuple(pairs)
        self.jet = jet_at(self._pairs)
        self._full: Optional[HessianJet] = None
        self.asked: Set[Pair] = set()
        # what each tensor handed out is: ("value",), ("row", c, dims): the (N, d) gradient of
        # the derivative of u_c along dims, ("deriv", c, dims): that derivative, (N, 1)
        self._kinds: Dict[int, tuple] = {id(self.jet.value): ("value",)}
        self._alive: List[Tensor] = [self.jet.value]
        # the tensors the PDE made from tracked ones: id -> () -> their gradient in the points,
        # shape (*tensor.shape, d) (raises where it cannot be formed)
        self._made: Dict[int, Callable[[], Tensor]] = {}

    @property
    def value(self) -> Tensor:
        """The network's output at the points, ``(N, m)``: the ``ys`` of later calls."""
        return self.jet.value

    def jacobian(self, ys: Tensor, xs: Tensor, i: Optional[int] = None, j: Optional[int] = None):
        if xs is self.x and id(ys) not in self._kinds and id(ys) in self._made:
            return self._made_jacobian(ys, i, j)
        kind = self._kind(ys, xs, "jacobian")
        if i is None:
            if ys.shape[1] > 1:
                raise NotImplementedError(
                    "dde.grad.jacobian(ys, xs, i=None) of a ys with several components: name "
                    "the component i (as DeepXDE's reverse mode requires)"
                )
            i = 0
        if kind[0] == "value":
            c, dims = i, ()
        elif kind[0] == "component":  # a column sliced from the output
            if i != 0:
                raise NotImplementedError("dde.grad.jacobian of a (N, 1) component takes i=0")
            c, dims = kind[1], ()
        elif kind[0] == "row":  # component i of a gradient: one more coordinate
            c, dims = kind[1], kind[2] + (i,)
        else:
            if i != 0:
                raise NotImplementedError("dde.grad.jacobian of a (N, 1) derivative takes i=0")
            c, dims = kind[1], kind[2]
        if j is None or self.x.shape[1] == 1:
            return self._row(c, dims)
        return self._derivative(c, dims + (j,))

    def hessian(self, ys: Tensor, xs: Tensor, component: int = 0, i: int = 0, j: int = 0):
        kind = self._kind(ys, xs, "hessian")
        if kind[0] == "value":
            return self._derivative(component, (i, j))
        if kind[0] == "component" and component == 0:
            return self._derivative(kind[1], (i, j))
        if kind[0] == "deriv" and component == 0:
            return self._derivative(kind[1], kind[2] + (i, j))
        raise NotImplementedError(
            "torch_sgn.deepxde answers dde.grad.hessian of the network's output or of a (N, 1) "
            "derivative of it (component=0)"
        )

    def _row(self, c: int, dims: tuple) -> Tensor:
        d = self.x.shape[1]
        if not dims:
            row = self.jet.gradient[:, c, :]
        else:
            row = torch.cat([self._derivative(c, dims + (k,), keep=False) for k in range(d)], 1)
        return self._keep(row, ("row", c, dims))

    def _derivative(self, c: int, dims: tuple, keep: bool = True) -> Tensor:
        """``d^n u_c / dx_dims`` at the points, ``(N, 1)``."""
        if len(dims) == 1:
            out = self.jet.gradient[:, c, dims[0] : dims[0] + 1]
        elif len(dims) == 2:
            out = self._second(c, dims[0], dims[1])
        elif len(set(dims)) == 1 and len(dims) <= 4 and self._higher_at is not None:
            out = self._higher_at(dims[0], len(dims))[:, c : c + 1]
        else:
            raise NotImplementedError(
                f"torch_sgn.deepxde answers derivatives to the second order, and of order 3 and "
                f"4 along one coordinate; this function asks for d/dx{list(dims)}"
            )
        return self._keep(out, ("deriv", c, tuple(dims))) if keep else out

    def _second(self, c: int, k: int, j: int) -> Tensor:
        pair = (min(k, j), max(k, j))
        self.asked.add(pair)
        source = self.jet
        if pair not in self._pairs:
            if self._full is None:
                d = self.x.shape[1]
                self._full = self._jet_at([(a, b) for a in range(d) for b in range(a, d)])
            source = self._full
        return source.hessian[:, c, k, j : j + 1]

    # --- tensors the PDE makes from the tracked ones (first order) ---------------------------
    def record(self, func: Callable, args: tuple, kwargs: dict, out: object) -> None:
        """Notes ``out = func(*args, **kwargs)`` where an argument is a tracked tensor (the
        points, the output, a derivative, or a tensor recorded before): a column sliced from
        the output becomes that component; anything else, a tensor whose gradient in the
        points :meth:`jacobian` forms when asked (:data:`_RULES`; another function's result
        cannot be differentiated, and says so then)."""
        if not isinstance(out, Tensor) or kwargs:
            return
        tracked = [a for a in args if isinstance(a, Tensor) and self._tracked(a)]
        if not tracked:
            return
        name = getattr(func, "__name__", "")
        if name == "__getitem__" and args[0] is self.jet.value:
            c = _column(args[1], out)
            if c is not None:
                self._keep(out, ("component", c))
                return
        rule = _RULES.get(name)

        def grad() -> Tensor:
            if rule is None:
                raise NotImplementedError(
                    f"torch_sgn.deepxde differentiates sums, products, quotients, powers, "
                    f"slices and sin, cos, exp, tanh of the network's output and its first "
                    f"derivatives; this PDE differentiates the result of {name or func}"
                )
            grads = [self._grad_of(a) if isinstance(a, Tensor) else None for a in args]
            return rule(args, grads, out)

        self._made[id(out)] = grad
        self._alive.append(out)

    def _tracked(self, t: Tensor) -> bool:
        return t is self.x or id(t) in self._kinds or id(t) in self._made

    def _grad_of(self, t: Tensor) -> Optional[Tensor]:
        """``t``'s gradient in the points, shape ``(*t.shape, d)``; ``None`` for a constant (a
        tensor that does not come from the points)."""
        d = self.x.shape[1]
        if t is self.x:
            eye = torch.eye(d, dtype=t.dtype, device=t.device)
            return eye.expand(t.shape[0], d, d)
        if id(t) in self._made:
            return self._made[id(t)]()
        kind = self._kinds.get(id(t))
        if kind is None:
            return None
        if kind[0] == "value":
            return self.jet.gradient
        if kind[0] == "component":
            return self.jet.gradient[:, kind[1] : kind[1] + 1, :]
        if kind[0] == "deriv" and len(kind[2]) == 1:  # d u_c / dx_k, (N, 1): its row of H
            c, (k,) = kind[1], kind[2]
            row = torch.cat([self._second(c, k, j) for j in range(d)], 1)
            return row[:, None, :]
        if kind[0] == "row" and not kind[2]:  # the gradient of u_c, (N, d): H
            c = kind[1]
            rows = [torch.cat([self._second(c, k, j) for j in range(d)], 1) for k in range(d)]
            return torch.stack(rows, 1)
        raise NotImplementedError(
            "torch_sgn.deepxde differentiates expressions of the network's output and its first "
            "derivatives; this PDE differentiates an expression of a derivative of order "
            f"{len(kind[2]) if len(kind) > 2 else 2} or more"
        )

    def _made_jacobian(self, ys: Tensor, i: Optional[int], j: Optional[int]) -> Tensor:
        """``dde.grad.jacobian`` of a tensor the PDE made (:meth:`record`)."""
        if ys.dim() != 2:
            raise NotImplementedError("dde.grad.jacobian of a tensor that is not (N, k)")
        if i is None:
            if ys.shape[1] > 1:
                raise NotImplementedError(
                    "dde.grad.jacobian(ys, xs, i=None) of a ys with several components: name "
                    "the component i"
                )
            i = 0
        grad = self._made[id(ys)]()[:, i, :]  # (N, d)
        out = grad if j is None or self.x.shape[1] == 1 else grad[:, j : j + 1]

        def again() -> Tensor:
            raise NotImplementedError(
                "torch_sgn.deepxde differentiates an expression of the network's output once; "
                "this PDE differentiates such a derivative again"
            )

        self._made[id(out)] = again
        self._alive.append(out)
        return out

    def _kind(self, ys: Tensor, xs: Tensor, what: str) -> tuple:
        if xs is not self.x:
            raise NotImplementedError(
                f"torch_sgn.deepxde answers dde.grad.{what}(ys, xs) with xs the points the PDE "
                "or condition was called with, not a tensor derived from them"
            )
        kind = self._kinds.get(id(ys))
        if kind is None:
            raise NotImplementedError(
                f"torch_sgn.deepxde answers dde.grad.{what}(ys, xs) for ys the network's output "
                "or a derivative of it that dde.grad returned; this function differentiates "
                "another tensor. Write that term from the output's derivatives (a product rule), "
                "or train this model with DeepXDE's optimizers"
            )
        return kind

    def _keep(self, t: Tensor, kind: tuple) -> Tensor:
        self._kinds[id(t)] = kind
        self._alive.append(t)
        return t


@contextmanager
def answering(answers: Answers) -> Iterator[Answers]:
    """``dde.grad.jacobian`` and ``dde.grad.hessian`` answered by ``answers`` inside."""
    import deepxde.gradients as grad

    saved = grad.jacobian, grad.hessian
    grad.jacobian, grad.hessian = answers.jacobian, answers.hessian
    try:
        with _Recording(answers):
            yield answers
    finally:
        grad.jacobian, grad.hessian = saved


class _Recording(TorchFunctionMode):
    """Hands every torch function's result to :meth:`Answers.record`."""

    def __init__(self, answers: Answers):
        super().__init__()
        self.answers = answers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.answers.record(func, args, kwargs, out)
        return out


def _column(index: object, out: Tensor) -> Optional[int]:
    """``c`` where ``index`` takes column ``c`` of a 2-D tensor as ``(N, 1)``
    (``[:, c : c + 1]``), else ``None``."""
    if not (isinstance(index, tuple) and len(index) == 2 and out.dim() == 2):
        return None
    rows, cols = index
    if rows != slice(None) or not isinstance(cols, slice) or cols.step not in (None, 1):
        return None
    if cols.start is None or out.shape[1] != 1:
        return None
    return int(cols.start)


def _unsqueezed(t: object) -> object:
    """An operand ready to multiply a gradient: a trailing axis for a tensor."""
    return t[..., None] if isinstance(t, Tensor) else t


def _product(args: tuple, grads: list, out: Tensor) -> Tensor:
    a, b = args[0], args[1]
    ga, gb = grads[0], grads[1] if len(grads) > 1 else None
    terms = []
    if ga is not None:
        terms.append(ga * _unsqueezed(b))
    if gb is not None:
        terms.append(_unsqueezed(a) * gb)
    return _broadcast(sum(terms), out)


def _sum(sign: float) -> Callable:
    def rule(args: tuple, grads: list, out: Tensor) -> Tensor:
        ga, gb = grads[0], grads[1] if len(grads) > 1 else None
        # (one operand at least is tracked: its gradient is not None)
        total = ga if gb is None else (gb * sign if ga is None else ga + sign * gb)
        return _broadcast(total, out)

    return rule


def _reversed_difference(args: tuple, grads: list, out: Tensor) -> Tensor:  # other - self
    return _broadcast(-grads[0], out)


def _quotient(args: tuple, grads: list, out: Tensor) -> Tensor:
    a, b = args[0], args[1]
    ga, gb = grads[0], grads[1] if len(grads) > 1 else None
    total = 0
    if ga is not None:
        total = ga / _unsqueezed(b)
    if gb is not None:
        total = total - _unsqueezed(a) * gb / _unsqueezed(b * b)
    return _broadcast(total, out)


def _reversed_quotient(args: tuple, grads: list, out: Tensor) -> Tensor:  # other / self
    t, other = args[0], args[1]
    return _broadcast(-_unsqueezed(other / (t * t)) * grads[0], out)


def _power(args: tuple, grads: list, out: Tensor) -> Tensor:
    t, p = args[0], args[1]
    if isinstance(p, Tensor) or len(grads) > 1 and grads[1] is not None:
        raise NotImplementedError("torch_sgn.deepxde differentiates powers by a constant number")
    return _broadcast(_unsqueezed(p * t ** (p - 1)) * grads[0], out)


def _chain(derivative: Callable[[Tensor, Tensor], Tensor]) -> Callable:
    def rule(args: tuple, grads: list, out: Tensor) -> Tensor:
        return _broadcast(_unsqueezed(derivative(args[0], out)) * grads[0], out)

    return rule


def _negated(args: tuple, grads: list, out: Tensor) -> Tensor:
    return -grads[0]


def _sliced(args: tuple, grads: list, out: Tensor) -> Tensor:
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return grads[0][index]


def _broadcast(g: Tensor, out: Tensor) -> Tensor:
    return g.expand(*out.shape, g.shape[-1])


#: How the gradient in the points of each function's result follows from its arguments' (the
#: chain rule), by the function's name.
_RULES: Dict[str, Callable[[tuple, list, Tensor], Tensor]] = {
    "__getitem__": _sliced,
    "__mul__": _product, "__rmul__": _product, "mul": _product, "multiply": _product,
    "__add__": _sum(1.0), "__radd__": _sum(1.0), "add": _sum(1.0),
    "__sub__": _sum(-1.0), "sub": _sum(-1.0), "subtract": _sum(-1.0),
    "__rsub__": _reversed_difference,
    "__truediv__": _quotient, "div": _quotient, "divide": _quotient, "true_divide": _quotient,
    "__rtruediv__": _reversed_quotient,
    "__pow__": _power, "pow": _power,
    "__neg__": _negated, "neg": _negated, "negative": _negated,
    "sin": _chain(lambda t, out: torch.cos(t)),
    "cos": _chain(lambda t, out: -torch.sin(t)),
    "exp": _chain(lambda t, out: out),
    "tanh": _chain(lambda t, out: 1 - out * out),
}  # fmt: skip
