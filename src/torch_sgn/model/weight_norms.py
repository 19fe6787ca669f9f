"""Weight normalization that both of SGN's modes of differentiation take directly.

:func:`torch.nn.utils.parametrizations.weight_norm` (and the older
:func:`torch.nn.utils.weight_norm`) computes ``w = g v / ||v||`` by ``torch._weight_norm``,
whose fused kernel (``_weight_norm_interface``, taken where the norm runs over every dimension
but the first or the last: the default) has no forward-mode rule. SGN would then take ``J v``
by double backward (exact, about two backward passes a product, see
:mod:`torch_sgn.model.forward_mode`). Within :class:`torch_sgn.model.composites.Composites` every
call of
``torch._weight_norm`` (from either module, a subclass of them or ``forward`` itself) computes
``w`` as PyTorch's unfused kernel does, ``v * (g / norm_except_dim(v, 2, dim))``: the same
values, from operators with forward-mode rules and differentiable backward passes (a norm of
the whole weight, ``dim=None``, by :func:`torch.linalg.vector_norm`: PyTorch's forward-mode rule
for it fails on either kernel). The model's own forward passes are not changed.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["normalized"]


def normalized(v: Tensor, g: Tensor, dim: int) -> Tensor:
    # dim=-1 is one norm of the whole tensor, where norm_except_dim's forward-mode rule gives a
    # tangent of the wrong shape (torch 2.13: "Trying to set a forward gradient that has a
    # different size"), with PyTorch's kernel as well: vector_norm gives the same value
    norm = torch.linalg.vector_norm(v) if dim == -1 else torch.norm_except_dim(v, 2, dim)
    return v * (g / norm)
