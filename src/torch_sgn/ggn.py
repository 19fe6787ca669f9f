r"""The generalized Gauss-Newton matrix as a matrix-free operator.

For a network ``f(x; theta)`` with outputs ``z = f(x; theta)`` and a loss ``ell(z, y)`` convex
in ``z``, the generalized Gauss-Newton (GGN) matrix of ``L(theta) = ell(f(x; theta), y)`` is

.. math::
    G = J^\top H J,\qquad J = \frac{\partial z}{\partial \theta},\qquad
    H = \frac{\partial^2 \ell}{\partial z^2},

which for a mean-reduced loss is the paper's ``(1/N) sum_i J_i^T H_i J_i``. ``G`` is never
formed: a product is ``v -> J v`` (forward mode) ``-> H J v`` (closed form in output space)
``-> J^T H J v`` (reverse mode, reusing the graph of the gradient's forward pass).

This module holds the narrow internal interface the optimizer uses (:func:`_linearize`,
returning a :class:`_Linearization`) and the public :class:`GGN` built on it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .losses import LossSpec, OutputLoss, resolve_loss

__all__ = ["GGN"]

Inputs = Union[Tensor, Tuple[Tensor, ...]]


class _FunctionalModel:
    """Evaluates ``model`` as a function of one flat parameter vector.

    The vector holds the trainable parameters (``requires_grad=True``) in ``model.parameters()``
    order, the layout of :func:`torch.nn.utils.parameters_to_vector`. Frozen parameters and
    buffers are passed as they are.

    Modules whose forward draws random numbers (dropout) or updates buffers (batch norm in
    training mode) are made consistent within a step: :meth:`consistent` replays the same
    random numbers for every forward pass, and only the forward pass that computes the
    gradient writes the buffers; all others work on copies.
    """

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (none has requires_grad)")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.numel = sum(self.numels)
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                "all trainable parameters must share one dtype and device, got "
                f"dtypes {sorted(map(str, dtypes))} and devices {sorted(map(str, devices))}"
            )
        self.dtype, self.device = dtypes.pop(), devices.pop()
        if not self.dtype.is_floating_point:
            raise ValueError(f"parameters must be floating point, got {self.dtype}")
        self._rng_state: dict | None = None
        self._after_first: dict | None = None

    # --- parameters as one vector -------------------------------------------------------------
    def flat(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        return {
            name: chunk.view(shape)
            for name, chunk, shape in zip(self.names, flat.split(self.numels), self.shapes)
        }

    @torch.no_grad()
    def write(self, flat: Tensor) -> None:
        """Copies ``flat`` into the model's parameters."""
        for p, chunk in zip(self.params, flat.split(self.numels)):
            p.copy_(chunk.view(p.shape))

    @torch.no_grad()
    def write_buffers(self, buffers: dict[str, Tensor]) -> None:
        """Copies buffers computed by a forward pass (see ``buffers_out``) into the model."""
        own = dict(self.model.named_buffers())
        for name, value in buffers.items():
            own[name].copy_(value)

    # --- forward passes -----------------------------------------------------------------------
    def __call__(self, flat: Tensor, inputs: Inputs, *, buffers_out: dict | None = None) -> Tensor:
        """The model's output at parameters ``flat``.

        A training-mode forward pass updates copies of the buffers, never the model's own; pass
        ``buffers_out`` to receive the updated copies (:meth:`write_buffers` commits them).
        Copies are made inside the call, which also keeps ``torch.func`` transforms from seeing
        captured tensors mutated.
        """
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        tensors = dict(self.model.named_buffers())
        if self.model.training:
            tensors = {k: b.clone() for k, b in tensors.items()}
            if buffers_out is not None:
                buffers_out.update(tensors)
        tensors.update(self.unflatten(flat))
        with self._replay_rng():
            out = functional_call(self.model, tensors, args)
        if not isinstance(out, Tensor):
            raise TypeError(
                "SGN needs a model whose forward returns one tensor, got "
                f"{type(out).__name__}; wrap the model to select the output the loss uses"
            )
        return out

    @contextmanager
    def consistent(self) -> Iterator[None]:
        """Within this block, every forward pass draws the same random numbers.

        On normal exit the global random state is where one forward pass would have left it;
        if the block raises, it is restored to where it was on entry.
        """
        if not self.model.training:
            yield
            return
        start = self.freeze_rng()
        try:
            yield
        except BaseException:
            _set_rng(self.device, start)
            raise
        else:
            if self._after_first is not None:
                _set_rng(self.device, self._after_first)
        finally:
            self._rng_state = self._after_first = None

    def freeze_rng(self) -> dict:
        """Makes every later forward pass replay the current random state; returns it."""
        self._rng_state = _get_rng(self.device)
        self._after_first = None
        return self._rng_state

    @contextmanager
    def _replay_rng(self) -> Iterator[None]:
        if self._rng_state is None:
            yield
            return
        outside = _get_rng(self.device)
        _set_rng(self.device, self._rng_state)
        try:
            yield
        finally:
            if self._after_first is None:
                self._after_first = _get_rng(self.device)
            _set_rng(self.device, outside)


def _get_rng(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng(device: torch.device, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass
class _Linearization:
    """The model and loss linearized at one point on one mini-batch.

    This is the interface between the optimizer and the curvature engine: everything SGN needs
    from the model during a step.

    Attributes:
        loss: the loss at the point (detached scalar tensor).
        grad: its gradient, flat.
        ggn_vp: ``v -> G v`` for flat ``v``.
        value_at: ``flat -> loss`` at other parameters on the same batch, with the same random
            numbers (the trust region's and line search's trial points); ``None`` lets the
            optimizer evaluate the model functionally.
        outputs: the network's outputs at the point, where the engine keeps them.
    """

    loss: Tensor
    grad: Tensor
    ggn_vp: Callable[[Tensor], Tensor]
    value_at: Optional[Callable[[Tensor], Tensor]] = None
    outputs: Optional[Tensor] = None


def _linearize(
    fmodel: _FunctionalModel,
    loss: OutputLoss,
    flat: Tensor,
    inputs: Inputs,
    targets: Tensor,
    buffers_out: dict | None = None,
) -> _Linearization:
    """Loss, gradient and a ``G v`` closure from one forward pass.

    The forward pass that gives the gradient is recorded once and its graph kept: ``J^T u``
    reuses it at every product. ``J v`` uses forward-mode AD (``torch.func.jvp``), which
    re-runs the forward pass with tangents. ``buffers_out`` receives the buffers as that one
    forward pass updated them (training mode).
    """
    leaf = flat.detach().requires_grad_(True)
    with torch.enable_grad():
        outputs = fmodel(leaf, inputs, buffers_out=buffers_out)
        value, dz = _output_loss(loss, outputs, targets)
        (grad,) = torch.autograd.grad(outputs, leaf, dz, retain_graph=True)
    z = outputs.detach()
    base = flat.detach()
    hessian = loss.hessian(z, targets)

    def jvp(v: Tensor) -> Tensor:
        return torch.func.jvp(lambda p: fmodel(p, inputs), (base,), (v,))[1]

    def ggn_vp(v: Tensor) -> Tensor:
        hjv = hessian(jvp(v))  # v -> J v -> H J v
        with torch.enable_grad():
            (jthjv,) = torch.autograd.grad(outputs, leaf, hjv, retain_graph=True)  # -> J^T H J v
        return jthjv

    return _Linearization(value, grad, ggn_vp)


def _output_loss(
    loss: OutputLoss, outputs: Tensor, targets: Tensor, check: bool = True
) -> Tuple[Tensor, Tensor]:
    """The loss and its gradient with respect to the outputs (autograd in output space)."""
    if check:
        loss.check_targets(outputs, targets)
    with torch.enable_grad():
        z = outputs.detach().requires_grad_(True)
        value = loss.value(z, targets)
        (dz,) = torch.autograd.grad(value, z)
    return value.detach(), dz


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
        engine: ``"auto"``, ``"fast"`` or ``"functional"``, as for :class:`~torch_sgn.SGN`.

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
        from .engine import _select_engine  # the engine module builds on this one

        self._fmodel = _FunctionalModel(model)
        linearize = _select_engine(self._fmodel, engine)
        if model.training:
            self._fmodel.freeze_rng()  # every product sees the same dropout masks
        self._loss = resolve_loss(loss)
        self._flat = self._fmodel.flat()
        self._lin = linearize(self._fmodel, self._loss, self._flat, inputs, targets)

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
        """The ``n x n`` matrix, one product per column (for small models and checks)."""
        return self @ torch.eye(self._fmodel.numel, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"GGN(n={self._fmodel.numel}, loss={self._loss.name!r}, dtype={self.dtype})"
