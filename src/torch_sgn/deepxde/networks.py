"""DeepXDE's networks as chains of layers the forward jets take.

:func:`chain_of` writes a DeepXDE network as an ``nn.Sequential`` over its own ``nn.Linear``
modules (so that ``torch.func.functional_call`` on the model reaches them, and the layers'
factors of :mod:`torch_sgn.pinn.layer_kernel` follow them), activation modules and the layers
of :mod:`torch_sgn.pinn.jet_layers`. Each network kind maps to those building blocks:

* ``FNN``: ``nn.Linear`` and activation, layer after layer;
* ``PFNN`` (DeepXDE's, and PINNacle's with its ``split_mask``): each layer of sub-networks is
  one :class:`~torch_sgn.pinn.ParallelLinear` (every branch reading the whole input after a
  shared layer, each its own branch's columns after a parallel one, times the branch's mask),
  a shared layer after parallel ones an ``nn.Linear`` of their concatenation;
* a feature transform (``net.apply_feature_transform``) of either: an
  :class:`~torch_sgn.pinn.InputMap` first.

Networks not on this path (their jets come from ``torch.func``, exact but slower, and exact
steps form ``J`` row by row): an activation whose derivatives the jets do not know (DeepXDE's
``"LAAF-..."`` adaptive activations, with a trained slope; ``relu``, ``elu``, ``selu``),
DeepONet and MIONet (not a PDE's network of one point), and any other class. A feature
transform with trained parameters of its own takes the forward jets, but the layers' factors
do not follow those parameters (``J`` by rows). DeepXDE 1.15's PyTorch backend
has no ``MsFFN``, ``STMsFFN`` or ``ResNet`` (they are in its TensorFlow 1 and Paddle backends
only), so there are none of those to take.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..pinn.jet_layers import InputMap, ParallelLinear
from ..pinn.operators import Sin

__all__ = ["chain_of"]


def chain_of(net: nn.Module) -> Optional[nn.Sequential]:
    """``net`` as an ``nn.Sequential`` of its own ``nn.Linear`` modules, activation modules and
    :mod:`torch_sgn.pinn.jet_layers` layers, equal to ``net`` before its output transform, for
    a DeepXDE ``FNN`` or ``PFNN`` (or PINNacle's, by the same class names: :data:`BUILDERS`)
    with a smooth activation and a feature transform or none; ``None`` for any other network
    (its jets then come from ``torch.func``)."""
    build = BUILDERS.get(type(net).__name__)
    if build is None:
        return None
    layers = build(net)
    if layers is None:
        return None
    transform = getattr(net, "_input_transform", None)
    if transform is not None:
        layers.insert(0, InputMap(transform))
    return nn.Sequential(*layers)


def _smooth() -> Dict[Callable, Callable[[], nn.Module]]:
    """DeepXDE's activation functions (and the torch functions PINNacle's networks take) whose
    derivatives the forward jets know, as modules."""
    from deepxde import backend as bkd

    return {
        bkd.tanh: nn.Tanh, bkd.sin: Sin, bkd.sigmoid: nn.Sigmoid, bkd.silu: nn.SiLU,
        bkd.gelu: nn.GELU, torch.tanh: nn.Tanh, torch.sin: Sin, torch.sigmoid: nn.Sigmoid,
        F.sigmoid: nn.Sigmoid, F.silu: nn.SiLU,
    }  # fmt: skip


def _activation(f: Callable, smooth: Dict[Callable, Callable[[], nn.Module]]):
    try:
        return smooth.get(f)
    except TypeError:  # an unhashable callable: not one of them
        return None


def _fnn(net: nn.Module) -> Optional[List[nn.Module]]:
    """A fully connected network's layers: ``linears`` with ``activation`` (one, or one per
    layer) between them."""
    linears = getattr(net, "linears", None)
    if not isinstance(linears, nn.ModuleList) or not all(type(m) is nn.Linear for m in linears):
        return None
    smooth = _smooth()
    count = len(linears) - 1
    acts = net.activation if isinstance(net.activation, list) else [net.activation] * count
    modules = [_activation(a, smooth) for a in acts[:count]]
    if any(m is None for m in modules):
        return None
    layers: List[nn.Module] = []
    for linear, make in zip(linears[:-1], modules):
        layers += [linear, make()]
    layers.append(linears[-1])
    return layers


def _pfnn(net: nn.Module) -> Optional[List[nn.Module]]:
    """A parallel network's layers. Its ``layers`` hold ``nn.Linear`` (one layer shared by the
    outputs) and ``nn.ModuleList`` of ``nn.Linear`` (one sub-layer per sub-network); the values
    between them are kept concatenated, so a sub-network's columns are its branch's outputs."""
    modules = getattr(net, "layers", None)
    make = _activation(getattr(net, "activation", None), _smooth())
    if not isinstance(modules, nn.ModuleList) or make is None or not len(modules):
        return None
    masks = _masks(net)
    widths: Optional[Sequence[int]] = None  # the branches' widths after a parallel layer
    layers: List[nn.Module] = []
    for i, module in enumerate(modules):
        if i:
            layers.append(make())
        if type(module) is nn.Linear:
            layers.append(module)  # after a parallel layer: reads the concatenation
            widths = None
            continue
        if not isinstance(module, nn.ModuleList) or not all(type(m) is nn.Linear for m in module):
            return None
        if widths is None:  # from one input: every branch reads it all, times its mask
            width = module[0].in_features
            ranges = [(0, width)] * len(module)
            scales = masks if masks is not None and len(masks) == len(module) else None
            if masks is not None and scales is None:
                return None
        else:
            if len(widths) != len(module):
                return None
            ranges = _side_by_side(widths)
            scales = None
        layers.append(ParallelLinear(list(module), ranges, scales))
        widths = [m.out_features for m in module]
    return layers


def _side_by_side(widths: Sequence[int]) -> List[Tuple[int, int]]:
    """The ``(start, stop)`` columns of branches of ``widths`` laid side by side."""
    starts = [sum(widths[:j]) for j in range(len(widths))]
    return [(s, s + w) for s, w in zip(starts, widths)]


def _masks(net: nn.Module) -> Optional[List[Tensor]]:
    """PINNacle's ``PFNN`` ``split_mask``: the branches' masks of the input, or ``None``."""
    mask = getattr(net, "split_mask", None)
    if not isinstance(mask, Tensor) or mask.dim() == 0:
        return None
    return [m for m in mask]


#: Network class name -> its layers as building blocks (``None`` where it cannot be written so).
BUILDERS: Dict[str, Callable[[nn.Module], Optional[List[nn.Module]]]] = {
    "FNN": _fnn,
    "PFNN": _pfnn,
}
