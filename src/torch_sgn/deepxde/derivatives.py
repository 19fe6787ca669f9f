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

    @property
    def value(self) -> Tensor:
        """The network's output at the points, ``(N, m)``: the ``ys`` of later calls."""
        return self.jet.value

    def jacobian(self, ys: Tensor, xs: Tensor, i: Optional[int] = None, j: Optional[int] = None):
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
        yield answers
    finally:
        grad.jacobian, grad.hessian = saved
