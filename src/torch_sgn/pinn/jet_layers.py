r"""Layers beside ``nn.Linear`` and elementwise activations that the forward jets take.

The forward-propagated derivatives of :mod:`torch_sgn.pinn.operators` go through an
``nn.Sequential`` layer by layer. Two kinds of layer are here, each with its rule:

* :class:`ParallelLinear`: linear layers side by side, each reading its own columns of the
  input (a parallel network's branches: DeepXDE's ``PFNN``). Like ``nn.Linear`` it maps every
  channel of the jet (the value with the biases, each derivative without) by the same linear
  map, and it reports each branch to :mod:`torch_sgn.pinn.layer_kernel`, so the layers'
  factors follow a network built of it as they follow one of ``nn.Linear``.
* :class:`InputMap`: a smooth map of each point alone (an input feature transform: periodic
  ``[cos x, sin x]``, Fourier features ``[cos Bx, sin Bx]``, polar coordinates, a scaling),
  the first layer of a chain. Its own value and derivatives at the points (few: they are taken
  with respect to the ``d`` coordinates of a point) come from ``torch.func``; the network after
  it takes them forward as it takes the identity's.

A layer of any other kind joins them by the same protocol: :class:`JetLinear`
(``propagate(channels)``, a linear map) or :class:`JetInput` (``input_jet`` and
``input_taylor``, a first layer).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layer_kernel import record

__all__ = ["InputMap", "JetInput", "JetLinear", "ParallelLinear"]


@runtime_checkable
class JetLinear(Protocol):
    """A layer that maps every channel of a jet by one linear map (:class:`ParallelLinear`;
    ``nn.Linear`` itself is taken as it is)."""

    def propagate(self, channels: Sequence[Tensor]) -> List[Tensor]:
        """The layer applied to each channel (each ``(..., N, in)``): ``channels[0]`` the
        value, which takes the biases, the others derivatives, which do not; each linear layer
        it applies reported by :func:`~torch_sgn.pinn.layer_kernel.record`."""
        ...


@runtime_checkable
class JetInput(Protocol):
    """A first layer that maps the points themselves and gives its own jet there
    (:class:`InputMap`), which the layers after it propagate."""

    def input_jet(
        self, x: Tensor, pairs: Sequence[Tuple[int, int]]
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """Value ``(N, k)``, gradient directions ``(d, N, k)``, second partials ``pairs``
        ``(P, N, k)`` at the points ``x``."""
        ...

    def input_taylor(self, x: Tensor, dim: int, order: int) -> Tuple[Tensor, List[Tensor]]:
        """Value ``(N, k)`` and derivatives of orders ``1..order`` along ``dim``, each
        ``(N, k)``."""
        ...


class ParallelLinear(nn.Module):
    r"""Linear layers side by side: branch ``j`` maps columns ``inputs[j]`` of the input (a
    ``(start, stop)`` range, times ``scales[j]`` where given) by ``linears[j]``; the branches'
    outputs are concatenated in order.

    .. math::
        y = [\,W_1 (s_1 \odot x_{I_1}) + b_1,\ \dots,\ W_B (s_B \odot x_{I_B}) + b_B\,]

    It is DeepXDE's ``PFNN`` in one layer: branches that all read the whole input where a shared
    layer splits into sub-networks, each its own branch's columns after that. The weights are
    block diagonal, and the layers' factors (:mod:`torch_sgn.pinn.layer_kernel`) see each branch
    as the ``nn.Linear`` it is, at the cost of its own size.

    Args:
        linears: the branches' ``nn.Linear`` modules (their parameters are the ones trained).
        inputs: per branch, the ``(start, stop)`` columns of the input it reads.
        scales: per branch, ``None`` or a constant tensor multiplying its input columns (a
            mask), broadcast against ``(N, stop - start)``.

    Raises:
        ValueError: as many input ranges as branches not given, or a branch that is not an
            ``nn.Linear`` reading its range's number of columns.
    """

    def __init__(
        self,
        linears: Sequence[nn.Linear],
        inputs: Sequence[Tuple[int, int]],
        scales: Optional[Sequence[Optional[Tensor]]] = None,
    ):
        super().__init__()
        if len(inputs) != len(linears):
            raise ValueError(f"{len(linears)} branches but {len(inputs)} input ranges")
        for linear, (start, stop) in zip(linears, inputs):
            if type(linear) is not nn.Linear or stop - start != linear.in_features:
                raise ValueError(
                    f"each branch must be an nn.Linear reading in_features columns; got "
                    f"{type(linear).__name__} for columns {start}:{stop}"
                )
        self.linears = nn.ModuleList(linears)
        self.inputs = [(int(a), int(b)) for a, b in inputs]
        self.scales = list(scales) if scales is not None else [None] * len(linears)

    def forward(self, x: Tensor) -> Tensor:
        """The layer at the points ``x`` (``(N, in)``).

        Args:
            x: the layer's input.

        Returns:
            The branches' outputs, concatenated.
        """
        return self.propagate([x])[0]

    def propagate(self, channels: Sequence[Tensor]) -> List[Tensor]:
        """The layer applied to each channel of a jet.

        Args:
            channels: each ``(..., N, in)``: ``channels[0]`` the value, which takes the biases,
                the others derivatives, which do not.

        Returns:
            The channels after the layer, in the same order.
        """
        outs: List[List[Tensor]] = [[] for _ in channels]
        for linear, (start, stop), scale in zip(self.linears, self.inputs, self.scales):
            taken = [c[..., start:stop] for c in channels]
            if scale is not None:
                taken = [c * scale.to(c) for c in taken]
            made = [F.linear(taken[0], linear.weight, linear.bias)]
            made += [c @ linear.weight.T for c in taken[1:]]
            record(linear, taken, made, (True,) + (False,) * (len(taken) - 1))
            for out, m in zip(outs, made):
                out.append(m)
        return [torch.cat(out, -1) for out in outs]


class InputMap(nn.Module):
    r"""A smooth map ``fn`` of the points, ``(N, d) -> (N, k)``, each output row a function of
    the same input row alone, as the first layer of a chain the forward jets take.

    Its value, gradient :math:`\partial \phi / \partial x_k` and second partials at each point
    come from ``torch.func`` applied to ``fn`` alone (``d`` directions per point, whatever the
    network after it); the layers after it propagate them as they would the identity's.

    Args:
        fn: the map; DeepXDE's feature transforms (``net.apply_feature_transform``) are such
            maps. A map with trained parameters of its own is differentiated correctly, but the
            layers' factors do not follow those parameters (exact steps then form ``J`` by
            rows).
    """

    def __init__(self, fn: Callable[[Tensor], Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        """The map at the points ``x``.

        Args:
            x: the points, ``(N, d)``.

        Returns:
            ``fn(x)``, ``(N, k)``.
        """
        return self.fn(x)

    def _one(self, xi: Tensor) -> Tensor:
        return self.fn(xi[None])[0]

    def input_jet(
        self, x: Tensor, pairs: Sequence[Tuple[int, int]]
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """The map's jet at the points, in the layouts of the forward jets.

        Args:
            x: the points, ``(N, d)``.
            pairs: the second partials ``(i, j)`` to form.

        Returns:
            The value ``(N, k)``, the gradient directions ``(d, N, k)`` and the second partials
            ``(P, N, k)``, one per pair.
        """
        value = self.fn(x)
        n, k = value.shape
        if not pairs:
            grad = torch.func.vmap(torch.func.jacfwd(self._one))(x)  # N x k x d
            return value, grad.permute(2, 0, 1), value.new_zeros(0, n, k)

        def jacobian(xi: Tensor) -> Tuple[Tensor, Tensor]:
            jac = torch.func.jacfwd(self._one)(xi)
            return jac, jac

        hess, grad = torch.func.vmap(torch.func.jacfwd(jacobian, has_aux=True))(x)
        first = torch.tensor([a for a, _ in pairs], device=x.device)
        second = torch.tensor([b for _, b in pairs], device=x.device)
        second_partials = hess[:, :, first, second].permute(2, 0, 1)  # P x N x k
        return value, grad.permute(2, 0, 1), second_partials

    def input_taylor(self, x: Tensor, dim: int, order: int) -> Tuple[Tensor, List[Tensor]]:
        """The map's derivatives along one coordinate at the points.

        Args:
            x: the points, ``(N, d)``.
            dim: the coordinate.
            order: the highest order.

        Returns:
            The value ``(N, k)`` and the derivatives of orders ``1`` to ``order``, each
            ``(N, k)``.
        """
        e = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
        e[dim] = 1

        def along(t: Tensor, xi: Tensor) -> Tensor:
            return self._one(xi + t * e)

        out = []
        f: Callable = along
        t0 = x.new_zeros(())
        for _ in range(order):
            f = torch.func.jacfwd(f)
            out.append(torch.func.vmap(f, in_dims=(None, 0))(t0, x))
        return self.fn(x), out
