"""Embedding lookups that SGN's passes can differentiate, where PyTorch's own cannot be.

PyTorch's embedding modules train by gradient, yet some of their options break a
Gauss-Newton product:

* ``padding_idx``: the padding row gets no gradient, but forward mode gives the lookup's full
  tangent, padding row included; ``J v`` and ``J^T u`` would then be of two different
  matrices, and ``G`` not symmetric.
* ``max_norm``: the module rescales the rows it looks up, in place and without autograd,
  inside its forward pass. That write cannot reach a weight that is a view of SGN's parameter
  vector (autograd refuses it), nor be traced as a function.
* ``nn.EmbeddingBag``: its kernel has no forward-mode rule and its backward no derivative, so
  neither forward mode nor double backward gives ``J v``.
* ``sparse``: the gradient of a weight that is a view of SGN's (dense) parameter vector cannot
  be a sparse tensor.
* ``scale_grad_by_freq``: the gradient of each row is divided by the row's count in the
  batch, the tangent is not; ``J v`` and ``J^T u`` would be of two different matrices.

Within :class:`torch_sgn.model.composites.Composites` every call of
:func:`torch.nn.functional.embedding` with one of these options and every call of
:func:`torch.nn.functional.embedding_bag` (from the modules, subclasses of them with a forward
of their own, or ``forward`` itself) run a composite of differentiable operators instead (a
plain lookup, then the bags' sums, means or maxima by ``index_add`` and ``scatter_reduce``):
the same values, and in both modes the derivatives autograd's reverse mode gives PyTorch's own
kernels, dense. Padding entries are cut from the derivatives (and from the bags). Rows beyond
``max_norm`` are renormalised out of place, with the derivative of a plain lookup; the weight
is not written (the model's own next forward pass renormalises its stored rows as before). With
``scale_grad_by_freq`` each row's derivative is divided by its count in both modes: ``J`` is
the lookup's times that scaling ``D``, and ``G`` the symmetric ``D J^T H J D`` whose gradient
``D J^T dz`` is PyTorch's own (as documented: ``nn.EmbeddingBag``'s CPU kernel of torch 2.13
divides some rows by another row's count, pytorch/pytorch#190063).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["bag_lookup", "lookup"]


def _padding_row(padding_idx: Optional[int], weight: Tensor) -> Optional[int]:
    """``padding_idx`` as a row of ``weight`` (counted from the end where negative), checked
    as PyTorch checks it."""
    if padding_idx is None:
        return None
    rows = weight.shape[0]
    if not -rows <= padding_idx < rows:
        raise ValueError(f"padding_idx {padding_idx} is outside the table's {rows} rows")
    return padding_idx % rows


def _weight(
    weight: Tensor,
    indices: Tensor,
    max_norm: Optional[float],
    norm_type: float,
    scale_grad_by_freq: bool,
) -> Tensor:
    """``weight`` with every row beyond ``max_norm`` renormalised, out of place, and with
    ``scale_grad_by_freq`` each row's derivative divided by its count in ``indices``.

    ``embedding_renorm_``'s rule: a row whose norm exceeds ``max_norm`` is scaled by
    ``max_norm / (norm + 1e-7)``. The scale is taken from the detached weight, so no derivative
    (reverse or forward mode) flows through it: as autograd's own, the derivative is a lookup's.
    Only looked-up rows reach the output, so renormalising all rows gives the same values.
    """
    if max_norm is not None:
        fixed = weight.detach()
        norms = torch.linalg.vector_norm(fixed, norm_type, dim=1, keepdim=True)
        scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)
        weight = weight + fixed * (scale - 1.0)
    if scale_grad_by_freq:
        flat = indices.reshape(-1)  # counted by index_add: a shape known without the data
        counts = weight.new_zeros(weight.shape[0]).index_add(0, flat, weight.new_ones(len(flat)))
        fixed = weight.detach()
        weight = fixed + (weight - fixed) / counts.clamp(min=1.0).unsqueeze(1)
    return weight


def lookup(
    input: Tensor,
    weight: Tensor,
    padding_idx: Optional[int],
    max_norm: Optional[float],
    norm_type: float,
    scale_grad_by_freq: bool,
    sparse: bool,
) -> Tensor:
    """:func:`torch.nn.functional.embedding` as a composite (``sparse`` is left out: the
    derivatives are dense)."""
    indices = input
    weight = _weight(weight, indices, max_norm, norm_type, scale_grad_by_freq)
    padding_idx = _padding_row(padding_idx, weight)
    if padding_idx is None:
        return F.embedding(indices, weight)
    # The padding entries' values, without derivatives in either mode: through the table's
    # padding row where the table is the smaller (the lookup then still feeds a matrix
    # product directly, which the traced engine reorders), else through the looked-up rows.
    if weight.shape[0] <= indices.numel():
        rows = torch.arange(weight.shape[0], device=weight.device) == padding_idx
        return F.embedding(indices, torch.where(rows.unsqueeze(1), weight.detach(), weight))
    out = F.embedding(indices, weight)
    return torch.where((indices == padding_idx).unsqueeze(-1), out.detach(), out)


def bag_lookup(
    input: Tensor,
    weight: Tensor,
    offsets: Optional[Tensor],
    max_norm: Optional[float],
    norm_type: float,
    scale_grad_by_freq: bool,
    mode: str,
    sparse: bool,
    per_sample_weights: Optional[Tensor],
    include_last_offset: bool,
    padding_idx: Optional[int],
) -> Tensor:
    """:func:`torch.nn.functional.embedding_bag` as a composite (``sparse`` is left out: the
    derivatives are dense)."""
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"embedding_bag: mode has to be 'sum', 'mean' or 'max', got {mode!r}")
    if mode == "max" and scale_grad_by_freq:
        raise ValueError("embedding_bag: mode='max' cannot scale its gradient by frequency")
    if per_sample_weights is not None and mode != "sum":
        raise ValueError(
            f"embedding_bag takes per_sample_weights with mode='sum' only, got mode={mode!r}"
        )
    if per_sample_weights is not None and per_sample_weights.shape != input.shape:
        raise ValueError(
            f"embedding_bag: per_sample_weights {tuple(per_sample_weights.shape)} must have "
            f"the input's shape {tuple(input.shape)}"
        )
    if weight.dim() != 2:
        raise ValueError(f"embedding_bag: the weight has to be 2D, got {weight.dim()}D")
    if mode == "max" and sparse:
        raise ValueError("embedding_bag: mode='max' does not support sparse weights")
    count = input.numel()
    if input.dim() == 2 and offsets is None:  # one bag per row, all of one size
        bags = input.shape[0]
        bag = torch.arange(bags, device=input.device).repeat_interleave(input.shape[1])
    elif input.dim() == 1 and offsets is not None and offsets.dim() == 1:
        # As PyTorch's kernels read them: the last bag runs to the input's end (a last offset,
        # documented as the input's length, is not read), and CUDA's first bag starts at 0
        # whatever the first offset (the CPU's refuses one that is not 0).
        starts = offsets[:-1] if include_last_offset else offsets
        bags = starts.numel()
        positions = torch.arange(count, device=input.device)
        bag = (torch.searchsorted(starts, positions, right=True) - 1).clamp(min=0)
    else:
        raise ValueError(
            "embedding_bag takes a 2D input (a bag per row) without offsets, or a 1D input "
            f"with 1D offsets; got a {input.dim()}D input and "
            f"{'no offsets' if offsets is None else f'{offsets.dim()}D offsets'}"
        )
    padding_idx = _padding_row(padding_idx, weight)
    indices = input.reshape(-1)
    rows = F.embedding(indices, _weight(weight, indices, max_norm, norm_type, scale_grad_by_freq))
    # entries at padding_idx are left out of their bags (and of a mean's count)
    keep = None if padding_idx is None else (indices != padding_idx).unsqueeze(1)
    width = rows.shape[1]
    if mode == "max":
        if keep is not None:
            rows = rows.masked_fill(~keep, float("-inf"))
        index = bag.unsqueeze(1).expand(count, width)
        out = rows.new_full((bags, width), float("-inf")).scatter_reduce(0, index, rows, "amax")
        return out.masked_fill(out == float("-inf"), 0.0)  # empty bags are zeros
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1, 1)
    if keep is not None:
        rows = rows * keep
    out = rows.new_zeros(bags, width).index_add(0, bag, rows)
    if mode == "mean":
        sizes = rows.new_ones(count, 1) if keep is None else keep.to(rows.dtype)
        sizes = rows.new_zeros(bags, 1).index_add(0, bag, sizes)
        out = out / sizes.clamp(min=1.0)  # empty bags are zeros
    return out
