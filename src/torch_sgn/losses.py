"""Losses seen from the network's output space.

SGN needs three things from a loss ``ell(outputs, targets)``: its value, its gradient with
respect to ``outputs`` and products of its output-space Hessian ``H`` with a vector. ``H`` is
small (one block per sample) and, for the usual losses, known in closed form:

* mean squared error: ``H = 2 I / n`` (``n`` the number of elements; ``2 I`` for ``sum``),
* cross-entropy on logits: ``H_i = diag(p_i) - p_i p_i^T`` per sample, ``p_i = softmax(z_i)``,
  divided by the number of samples for ``mean`` (label smoothing leaves it unchanged since the
  smoothed target still sums to one); samples whose class index is ``-100`` (torch's
  ``ignore_index``) count for nothing, as in :func:`torch.nn.functional.cross_entropy`,
* binary cross-entropy on logits: ``H = diag(s (1 - s))`` with ``s = sigmoid(z)``, divided by
  the number of elements for ``mean``.

Any other callable is treated generically: its Hessian products come from forward-over-reverse
autograd in output space (never in parameter space).
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LossSpec = Union[str, nn.Module, Callable[[Tensor, Tensor], Tensor]]

__all__ = ["LossSpec", "OutputLoss", "resolve_loss"]


class OutputLoss:
    """A loss as a function of the network's output, with its output-space Hessian.

    Subclasses implement :meth:`value`, :meth:`hvp` and :meth:`check_targets`. Gradients with
    respect to the outputs come from autograd on :meth:`value`, so they are exactly the
    gradients of the loss as torch computes it.
    """

    name = "custom"

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        raise NotImplementedError

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        """Returns ``H u``, ``H`` the Hessian of :meth:`value` w.r.t. ``outputs`` at ``outputs``."""
        raise NotImplementedError

    def hessian(self, outputs: Tensor, targets: Tensor) -> Callable[[Tensor], Tensor]:
        """``u -> H u`` at fixed ``outputs`` and ``targets``, for many products in one step.

        Subclasses may compute what every product shares once here (the softmax of the
        logits, the count of kept samples); the default calls :meth:`hvp` each time.
        """
        return lambda u: self.hvp(outputs, targets, u)

    def check_targets(self, outputs: Tensor, targets: Tensor) -> None:
        """Raises ``ValueError`` if ``targets`` cannot be the targets of ``outputs``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _check_reduction(reduction: str) -> str:
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"SGN needs a scalar loss: reduction must be 'mean' or 'sum', got {reduction!r}"
        )
    return reduction


class _MSE(OutputLoss):
    name = "mse"

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check_reduction(reduction)

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.mse_loss(outputs, targets, reduction=self.reduction)

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        scale = 2.0 / outputs.numel() if self.reduction == "mean" else 2.0
        return u * scale

    def check_targets(self, outputs: Tensor, targets: Tensor) -> None:
        if not targets.is_floating_point():
            raise ValueError(
                f"mse expects floating-point targets, got dtype {targets.dtype}; "
                "convert them with targets.float()"
            )
        if targets.shape != outputs.shape:
            raise ValueError(
                f"mse expects targets of the outputs' shape {tuple(outputs.shape)}, got "
                f"{tuple(targets.shape)} (for a single-output regression use targets of shape "
                "(N, 1), e.g. targets.unsqueeze(1))"
            )


class _CrossEntropy(OutputLoss):
    name = "cross_entropy"
    ignore_index = -100  # torch's default: class-index targets equal to it are left out

    def __init__(self, reduction: str = "mean", label_smoothing: float = 0.0):
        self.reduction = _check_reduction(reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self.label_smoothing = label_smoothing

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(
            outputs, targets, reduction=self.reduction, label_smoothing=self.label_smoothing
        )

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        return self.hessian(outputs, targets)(u)

    def hessian(self, outputs: Tensor, targets: Tensor) -> Callable[[Tensor], Tensor]:
        # Per sample (and per extra position for (N, C, d1, ...) outputs), the Hessian of
        # -sum_c q_c log softmax(z)_c is diag(p) - p p^T whenever sum_c q_c = 1. The softmax,
        # the ignored samples' mask and the mean's 1 / count are folded into one factor once;
        # nothing here waits for the device.
        p = torch.softmax(outputs, dim=1)
        if targets.is_floating_point():
            count = outputs.numel() // outputs.shape[1]
            scaled = p / count if self.reduction == "mean" else p
        else:
            keep = (targets != self.ignore_index).unsqueeze(1).to(p.dtype)
            scaled = p * keep
            if self.reduction == "mean":
                scaled = scaled / keep.sum()

        def product(u: Tensor) -> Tensor:
            return scaled * (u - (p * u).sum(dim=1, keepdim=True))

        return product

    def check_targets(self, outputs: Tensor, targets: Tensor) -> None:
        if outputs.dim() < 2:
            raise ValueError(
                "cross_entropy expects logits of shape (N, C) or (N, C, d1, ...), got outputs of "
                f"shape {tuple(outputs.shape)}"
            )
        num_classes = outputs.shape[1]
        if targets.is_floating_point():
            if targets.shape != outputs.shape:
                raise ValueError(
                    "cross_entropy expects integer class indices of shape "
                    f"{(outputs.shape[0], *outputs.shape[2:])} (dtype torch.long), or class "
                    f"probabilities of the outputs' shape {tuple(outputs.shape)}; got "
                    f"{targets.dtype} targets of shape {tuple(targets.shape)}"
                )
            return
        if targets.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(f"cross_entropy expects torch.long class indices, got {targets.dtype}")
        expected = (outputs.shape[0], *outputs.shape[2:])
        if tuple(targets.shape) != expected:
            raise ValueError(
                f"cross_entropy expects class indices of shape {expected}, got "
                f"{tuple(targets.shape)}"
            )
        if targets.numel():  # one transfer from the device; ignored targets count as class 0
            kept = targets.masked_fill(targets == self.ignore_index, 0)
            lo, hi = torch.stack(torch.aminmax(kept)).tolist()
            if lo < 0 or hi >= num_classes:
                raise ValueError(
                    f"cross_entropy class index out of range: targets span [{lo}, {hi}] but the "
                    f"model has {num_classes} outputs (valid indices 0..{num_classes - 1}, or "
                    f"{self.ignore_index} to leave a sample out)"
                )


class _BCEWithLogits(OutputLoss):
    name = "bce_with_logits"

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check_reduction(reduction)

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(outputs, targets, reduction=self.reduction)

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        return self.hessian(outputs, targets)(u)

    def hessian(self, outputs: Tensor, targets: Tensor) -> Callable[[Tensor], Tensor]:
        s = torch.sigmoid(outputs)
        diagonal = s * (1 - s)  # once per step; a product is one multiplication
        if self.reduction == "mean":
            diagonal = diagonal / outputs.numel()
        return lambda u: diagonal * u

    def check_targets(self, outputs: Tensor, targets: Tensor) -> None:
        if not targets.is_floating_point():
            raise ValueError(
                f"bce_with_logits expects floating-point targets in [0, 1], got dtype "
                f"{targets.dtype}; convert them with targets.float()"
            )
        if targets.shape != outputs.shape:
            raise ValueError(
                f"bce_with_logits expects targets of the outputs' shape {tuple(outputs.shape)}, "
                f"got {tuple(targets.shape)}"
            )
        if targets.numel() and (targets.min() < 0 or targets.max() > 1):
            raise ValueError("bce_with_logits expects targets in [0, 1]")


class _Generic(OutputLoss):
    """Any callable ``loss(outputs, targets) -> scalar`` that is convex in ``outputs``."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor], name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        loss = self.fn(outputs, targets)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(
                f"the loss {self.name!r} must return a scalar tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, Tensor) else tuple(loss.shape)}"
            )
        return loss.reshape(())

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        # Forward-over-reverse in output space: d/de grad(outputs + e u) at e = 0.
        def grad_fn(z: Tensor) -> Tensor:
            return torch.func.grad(lambda z_: self.value(z_, targets))(z)

        with torch.enable_grad():
            return torch.func.jvp(grad_fn, (outputs.detach(),), (u,))[1]


_NAMED = {"mse": _MSE, "cross_entropy": _CrossEntropy, "bce_with_logits": _BCEWithLogits}


def resolve_loss(loss: LossSpec) -> OutputLoss:
    """Turns a loss given by name, ``torch.nn`` module or callable into an :class:`OutputLoss`.

    Module forms with options the closed-form Hessians do not cover (class ``weight``,
    ``pos_weight``, a non-default ``ignore_index``) are handled by the generic autograd path,
    which is exact for them too.
    """
    if isinstance(loss, OutputLoss):
        return loss
    if isinstance(loss, str):
        if loss not in _NAMED:
            raise ValueError(
                f"unknown loss {loss!r}: use one of {sorted(_NAMED)}, a torch.nn loss module or "
                "a callable loss(outputs, targets) -> scalar"
            )
        return _NAMED[loss]()
    if isinstance(loss, nn.MSELoss):
        return _MSE(loss.reduction)
    if isinstance(loss, nn.CrossEntropyLoss):
        if loss.weight is None and loss.ignore_index == -100:
            return _CrossEntropy(loss.reduction, loss.label_smoothing)
        _check_reduction(loss.reduction)
        return _Generic(loss, "cross_entropy")
    if isinstance(loss, nn.BCEWithLogitsLoss):
        if loss.weight is None and loss.pos_weight is None:
            return _BCEWithLogits(loss.reduction)
        _check_reduction(loss.reduction)
        return _Generic(loss, "bce_with_logits")
    if isinstance(loss, nn.modules.loss._Loss):
        _check_reduction(loss.reduction)
    if callable(loss):
        return _Generic(loss)
    raise TypeError(
        f"loss must be a name, a torch.nn loss module or a callable, got {type(loss).__name__}"
    )
