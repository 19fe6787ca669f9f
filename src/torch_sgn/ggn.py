r"""The generalized Gauss-Newton matrix as a matrix-free operator.

For a network ``f(x; theta)`` with outputs ``z = f(x; theta)`` and a loss ``ell(z, y)`` convex
in ``z``, the generalized Gauss-Newton (GGN) matrix of ``L(theta) = ell(f(x; theta), y)`` is

.. math::
    G = J^\top H J,\qquad J = \frac{\partial z}{\partial \theta},\qquad
    H = \frac{\partial^2 \ell}{\partial z^2},

which for a mean-reduced loss is the paper's ``(1/N) sum_i J_i^T H_i J_i``. ``G`` is never
formed: a product is ``v -> J v`` (forward mode) ``-> H J v`` (closed form in output space)
``-> J^T H J v`` (reverse mode, reusing the graph of the gradient's forward pass).

The engines that compute the products are chosen in :mod:`torch_sgn.engines.selection`; this module
holds the public operator built on them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .engines.selection import select_engine
from .linearization import Batch, check_loss_parameters
from .losses import LossSpec, resolve_loss
from .model.flat_model import FunctionalModel, Inputs

__all__ = ["GGN"]


class GGN:
    r"""The generalized Gauss-Newton matrix of a loss on one mini-batch, matrix-free.

    .. math::
        G = J^\top H J = \sum_i J_i^\top H_i J_i

    with the scaling of the loss's reduction (``mean`` gives the paper's
    :math:`\frac1N\sum_i J_i^\top H_i J_i`). Vectors are flat, ordered as
    :func:`torch.nn.utils.parameters_to_vector` over the model's trainable parameters.

    Args:
        model: any ``nn.Module`` whose forward returns one tensor; evaluated functionally with
            its buffers at its current parameters.
        loss: ``"mse"``, ``"cross_entropy"``, ``"bce_with_logits"``, the matching ``torch.nn``
            module, or a callable ``loss(outputs, targets) -> scalar`` convex in ``outputs``.
        inputs: a tensor, or a tuple of tensors passed positionally.
        targets: the loss's targets.
        engine: ``"auto"``, ``"layerwise"``, ``"traced"`` or ``"functional"``, as for
            :class:`~torch_sgn.SGN`.

    Example:
        >>> G = GGN(model, "mse", x, y)
        >>> Gv = G @ v                 # one product
        >>> G.loss, G.gradient         # computed on the way

    A training-mode model's buffers are not modified.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: LossSpec,
        inputs: Inputs,
        targets: Tensor,
        *,
        engine: str = "auto",
    ):
        self._fmodel = FunctionalModel(model)
        self._loss = resolve_loss(loss)
        linearize = select_engine(self._fmodel, self._loss, engine)
        if model.training:
            self._fmodel.freeze_rng()  # every product sees the same dropout masks
        self._flat = self._fmodel.flat()
        batch = Batch(inputs, targets)
        self._lin = linearize(self._flat, batch)
        check_loss_parameters(self._loss, self._fmodel, self._lin, self._flat, batch)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._fmodel.numel, self._fmodel.numel))

    @property
    def dtype(self) -> torch.dtype:
        return self._fmodel.dtype

    @property
    def device(self) -> torch.device:
        return self._fmodel.device

    @property
    def loss(self) -> Tensor:
        """The loss at the model's parameters on this mini-batch."""
        return self._lin.loss

    @property
    def gradient(self) -> Tensor:
        """The gradient of the loss, flat."""
        return self._lin.grad

    def __matmul__(self, v: Tensor) -> Tensor:
        """``G @ v`` for a vector ``v`` of length ``n``, or ``G @ V`` column by column."""
        n = self._fmodel.numel
        if v.dim() == 1 and v.shape[0] == n:
            return self._lin.ggn_vp(v.to(self.dtype))
        if v.dim() == 2 and v.shape[0] == n:
            return torch.stack([self._lin.ggn_vp(c.to(self.dtype)) for c in v.unbind(1)], 1)
        raise ValueError(
            f"GGN of shape {tuple(self.shape)} cannot multiply a tensor of shape {tuple(v.shape)}"
        )

    def to_dense(self) -> Tensor:
        """The ``n x n`` matrix, one product per column (for small models and checks).

        Returns:
            ``G`` as a dense ``n x n`` tensor in the operator's dtype and device.
        """
        return self @ torch.eye(self._fmodel.numel, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"GGN(n={self._fmodel.numel}, loss={self._loss.name!r}, dtype={self.dtype})"
