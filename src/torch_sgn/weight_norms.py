"""Weight normalization that both of SGN's modes of differentiation take directly.

:func:`torch.nn.utils.parametrizations.weight_norm` (and the older
:func:`torch.nn.utils.weight_norm`) computes ``w = g v / ||v||`` by ``torch._weight_norm``,
whose fused kernel (``_weight_norm_interface``, taken where the norm runs over every dimension
but the first or the last: the default) has no forward-mode rule. SGN would then take ``J v``
by double backward (exact, about two backward passes a product, see
:mod:`torch_sgn.forward_mode`). Within :func:`composite_weight_norms` such modules compute
``w`` as PyTorch's unfused kernel does, ``v * (g / norm_except_dim(v, 2, dim))``: the same
values, from operators with forward-mode rules and differentiable backward passes (a norm of
the whole weight, ``dim=None``, by :func:`torch.linalg.vector_norm`: PyTorch's forward-mode rule
for it fails on either kernel). The model's own forward passes are not changed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

import torch
from torch import Tensor, nn

from .replaced_methods import replaced_methods

__all__ = ["composite_weight_norms", "weight_norm_modules"]


def _kinds() -> tuple:
    """PyTorch's two weight-norm classes, the parametrization and the older forward pre-hook;
    ``None`` for one this torch does not have."""
    try:
        from torch.nn.utils.parametrizations import _WeightNorm
    except ImportError:
        _WeightNorm = None
    try:
        from torch.nn.utils.weight_norm import WeightNorm
    except ImportError:
        WeightNorm = None
    return _WeightNorm, WeightNorm


def weight_norm_modules(model: nn.Module) -> List[object]:
    """The weight-norm parametrizations and pre-hooks in ``model`` that
    :func:`composite_weight_norms` replaces (not subclasses that compute the weight their own
    way)."""
    parametrization, hook_kind = _kinds()
    found: List[object] = []
    for module in model.modules():
        if parametrization is not None and type(module).forward is parametrization.forward:
            found.append(module)  # held by the parametrized module's `parametrizations`
        if hook_kind is None:
            continue
        for hook in module._forward_pre_hooks.values():
            if (
                isinstance(hook, hook_kind)
                and type(hook).compute_weight is hook_kind.compute_weight
            ):
                found.append(hook)
    return found


def _normalized(v: Tensor, g: Tensor, dim: int) -> Tensor:
    # dim=-1 is one norm of the whole tensor, where norm_except_dim's forward-mode rule gives a
    # tangent of the wrong shape (torch 2.13: "Trying to set a forward gradient that has a
    # different size"), with PyTorch's kernel as well: vector_norm gives the same value
    norm = torch.linalg.vector_norm(v) if dim == -1 else torch.norm_except_dim(v, 2, dim)
    return v * (g / norm)


def _parametrization(self, weight_g: Tensor, weight_v: Tensor) -> Tensor:
    return _normalized(weight_v, weight_g, self.dim)


def _compute_weight(self, module: nn.Module) -> Tensor:
    return _normalized(
        getattr(module, self.name + "_v"), getattr(module, self.name + "_g"), self.dim
    )


@contextmanager
def composite_weight_norms(norms: List[object]) -> Iterator[None]:
    """Within this block, each of ``norms`` (from :func:`weight_norm_modules`) computes its
    weight by differentiable operators; their own computation is back on exit."""
    methods = [
        (n, "compute_weight", _compute_weight)  # the older pre-hook
        if hasattr(n, "compute_weight")
        else (n, "forward", _parametrization)
        for n in norms
    ]
    with replaced_methods(methods):
        yield
