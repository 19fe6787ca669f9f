"""Losses seen from the network's output space.

SGN needs three things from a loss ``ell(outputs, targets)``: its value, its gradient with
respect to ``outputs`` and products of its output-space Hessian ``H`` with a vector. ``H`` is
small (one block per sample) and, for the usual losses, known in closed form:

* mean squared error: ``H = 2 I / n`` (``n`` the number of elements; ``2 I`` for ``sum``),
* cross-entropy on logits: ``H_i = s_i (diag(p_i) - p_i p_i^T)`` per sample,
  ``p_i = softmax(z_i)``, ``s_i`` the sum of the sample's target row (1 for class indices and
  for probability targets, with or without label smoothing; any value ``>= 0`` for multi-hot
  targets), divided by the number of samples for ``mean``; samples whose class index is
  ``ignore_index`` count for nothing, as in :func:`torch.nn.functional.cross_entropy`,
* binary cross-entropy on logits: ``H = diag(s (1 - s))`` with ``s = sigmoid(z)``, divided by
  the number of elements for ``mean``.

Any other callable is treated generically: its Hessian products come from reverse-over-reverse
autograd in output space (never in parameter space), exact for any loss PyTorch differentiates
twice. A callable must depend on the parameters through the outputs alone: one that reads the
model's parameters (a penalty inside the loss) is refused, once per model, by
:meth:`OutputLoss.check_parameters`, since no engine would differentiate that term.

An :class:`OutputLoss` is the one place that knows what its loss is: besides the value and the
Hessian, its :attr:`~OutputLoss.reduction`, the :meth:`~OutputLoss.normalizer` of a batch (what
the mean divides by) and whether its Hessian has a closed form. The curvature subset, the
data-parallel weighting and CUDA graphs ask it.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .diagnostics import warn
from .model.forward_mode import missing_rule

LossSpec = Union[str, nn.Module, Callable[[Tensor, Tensor], Tensor]]

__all__ = ["LossSpec", "OutputLoss", "resolve_loss"]


class OutputLoss:
    """A loss as a function of the network's output, with its output-space Hessian.

    Subclasses implement :meth:`value`, :meth:`hvp` and :meth:`check_targets`. Gradients with
    respect to the outputs come from autograd on :meth:`value`, so they are exactly the
    gradients of the loss as torch computes it.

    Attributes:
        name: the loss's name in messages.
        reduction: ``"mean"`` (the per-sample terms are divided by :meth:`normalizer`) or
            ``"sum"``.
        closed_form: whether :meth:`hessian` is a closed form (no autograd), which CUDA graphs
            can capture.
    """

    name = "custom"
    reduction = "mean"
    closed_form = False

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

    def check_parameters(
        self, parameters: Sequence[Tensor], outputs: Callable[[], Tensor], targets: Tensor
    ) -> None:
        """Raises ``ValueError`` where the loss reads the model's ``parameters`` (only a
        callable can); ``outputs()`` gives the outputs where a check needs them."""

    def normalizer(self, targets: Tensor) -> float:
        """What a ``mean`` over this batch divides by, whatever :attr:`reduction` is.

        It weighs the batch in a mean over several batches (data-parallel shards): the number
        of elements for squared error and binary cross-entropy, the number of kept targets (or
        the sum of their class weights) for cross-entropy; for a callable, the number of
        samples (it is assumed to be a mean over samples). Zero for an empty batch. May wait
        for the device (class-index targets).
        """
        return float(targets.shape[0]) if targets.dim() else 1.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _check_reduction(reduction: str, allowed: tuple = ("mean", "sum")) -> str:
    if reduction not in allowed:
        raise ValueError(
            "SGN needs a scalar loss: reduction must be "
            f"{' or '.join(map(repr, allowed))}, got {reduction!r}"
        )
    return reduction


class _MSE(OutputLoss):
    name = "mse"
    closed_form = True

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check_reduction(reduction)

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.mse_loss(outputs, targets, reduction=self.reduction)

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        scale = 2.0 / outputs.numel() if self.reduction == "mean" else 2.0
        return u * scale

    def normalizer(self, targets: Tensor) -> float:
        return float(targets.numel())

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
    closed_form = True

    def __init__(
        self, reduction: str = "mean", label_smoothing: float = 0.0, ignore_index: int = -100
    ):
        self.reduction = _check_reduction(reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self.label_smoothing = label_smoothing
        self.ignore_index = ignore_index  # class-index targets equal to it are left out

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(
            outputs,
            targets,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            ignore_index=self.ignore_index,
        )

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        return self.hessian(outputs, targets)(u)

    def hessian(self, outputs: Tensor, targets: Tensor) -> Callable[[Tensor], Tensor]:
        # Per sample (and per extra position for (N, C, d1, ...) outputs), the loss is
        # -sum_c q_c log softmax(z)_c = -q^T z + s logsumexp(z), s = sum_c q_c, whose Hessian is
        # s (diag(p) - p p^T). Class indices and probability rows have s = 1, smoothed or not;
        # multi-hot rows have their own s. The softmax, the row sums, the ignored samples' mask
        # and the mean's 1 / count are folded into one factor once; nothing here waits for the
        # device.
        p = torch.softmax(outputs, dim=1)
        if targets.is_floating_point():
            eps = self.label_smoothing  # torch smooths probabilities to (1 - eps) q + eps / C
            rows = targets.sum(dim=1, keepdim=True).to(p.dtype) * (1 - eps) + eps
            scaled = p * rows
            if self.reduction == "mean":
                scaled = scaled / (outputs.numel() // outputs.shape[1])
        else:
            keep = (targets != self.ignore_index).unsqueeze(1).to(p.dtype)
            scaled = p * keep
            if self.reduction == "mean":
                scaled = scaled / keep.sum()

        def product(u: Tensor) -> Tensor:
            return scaled * (u - (p * u).sum(dim=1, keepdim=True))

        return product

    def normalizer(self, targets: Tensor) -> float:
        return _cross_entropy_normalizer(targets, self.ignore_index, None)

    def check_targets(self, outputs: Tensor, targets: Tensor) -> None:
        _check_class_targets(self.name, outputs, targets, self.ignore_index)


def _cross_entropy_normalizer(targets: Tensor, ignore_index: int, weight: Tensor | None) -> float:
    """What torch's mean cross-entropy (or NLL) divides by: the positions for probability
    targets; the kept class indices, or the sum of their class weights."""
    if targets.is_floating_point():  # a mean over every position, weighted or not
        return float(targets.numel() // targets.shape[1]) if targets.dim() > 1 else 1.0
    keep = targets != ignore_index
    if weight is None:
        return float(keep.sum())
    return float(weight[targets[keep]].sum())


def _check_class_targets(
    name: str, outputs: Tensor, targets: Tensor, ignore_index: int, probabilities: bool = True
) -> None:
    """Raises ``ValueError`` unless ``targets`` fit the logits (or log-probabilities)
    ``outputs`` of a cross-entropy (``probabilities``) or negative log-likelihood loss."""
    if outputs.dim() < 2:
        raise ValueError(
            f"{name} expects logits of shape (N, C) or (N, C, d1, ...), got outputs of "
            f"shape {tuple(outputs.shape)}"
        )
    num_classes = outputs.shape[1]
    if num_classes == 1:
        raise ValueError(
            f"{name} over the model's single output is always 0 (a softmax over one class is "
            "1), so training would do nothing: for two classes give the model 2 outputs, or "
            "use loss='bce_with_logits' with float targets of shape (N, 1)"
        )
    if targets.is_floating_point() and probabilities:
        if targets.shape != outputs.shape:
            raise ValueError(
                f"{name} expects integer class indices of shape "
                f"{(outputs.shape[0], *outputs.shape[2:])} (dtype torch.long), or class "
                f"probabilities of the outputs' shape {tuple(outputs.shape)}; got "
                f"{targets.dtype} targets of shape {tuple(targets.shape)}"
            )
        # A row's sum scales its Hessian (see _CrossEntropy.hessian): a negative one makes
        # the loss concave in the logits there, and G indefinite.
        if targets.numel() and bool((targets.sum(dim=1) < 0).any()):
            raise ValueError(
                f"{name} with class-probability targets needs rows that sum to >= 0 (the loss "
                "is concave in the logits where a row sums to less); got a negative row sum"
            )
        return
    if targets.is_floating_point() or targets.dtype in (
        torch.bool,
        torch.complex64,
        torch.complex128,
    ):
        raise ValueError(
            f"{name} expects torch.long class indices, got {targets.dtype}; convert them "
            "with targets.long()"
        )
    expected = (outputs.shape[0], *outputs.shape[2:])
    if tuple(targets.shape) != expected:
        hint = ""
        if outputs.dim() > 2 and tuple(targets.shape) == tuple(outputs.shape[:-1]):
            hint = (
                ": the classes are along dimension 1 of the outputs (as in F.cross_entropy), "
                "not the last; for outputs of shape (N, ..., C) return logits.movedim(-1, 1) "
                "from the model, or flatten them to (N * L, C) and the targets to (N * L,)"
            )
        raise ValueError(
            f"{name} expects class indices of shape {expected}, got {tuple(targets.shape)}" + hint
        )
    if targets.numel():  # one transfer from the device; ignored targets count as class 0
        kept = targets.masked_fill(targets == ignore_index, 0)
        lo, hi = torch.stack(torch.aminmax(kept)).tolist()
        if lo < 0 or hi >= num_classes:
            raise ValueError(
                f"{name} class index out of range: targets span [{lo}, {hi}] but the "
                f"model has {num_classes} outputs (valid indices 0..{num_classes - 1}, or "
                f"{ignore_index} to leave a sample out)"
            )


class _BCEWithLogits(OutputLoss):
    name = "bce_with_logits"
    closed_form = True

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

    def normalizer(self, targets: Tensor) -> float:
        return float(targets.numel())

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
    """Any callable ``loss(outputs, targets) -> scalar`` that is convex in ``outputs``.

    A ``torch.nn`` loss module's ``reduction`` is read from it (``"batchmean"`` is a mean over
    samples); a plain callable is taken to be a mean over samples.
    """

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor], name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        reduction = getattr(fn, "reduction", "mean")
        self._per_element = isinstance(fn, nn.modules.loss._Loss) and reduction != "batchmean"
        self.reduction = "sum" if reduction == "sum" else "mean"

    def value(self, outputs: Tensor, targets: Tensor) -> Tensor:
        loss = self.fn(outputs, targets)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(
                f"the loss {self.name!r} must return a scalar tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, Tensor) else tuple(loss.shape)}"
            )
        return loss.reshape(())

    def hvp(self, outputs: Tensor, targets: Tensor, u: Tensor) -> Tensor:
        return self.hessian(outputs, targets)(u)

    def hessian(self, outputs: Tensor, targets: Tensor) -> Callable[[Tensor], Tensor]:
        # Reverse-over-reverse in output space: the graph of z -> grad(z) is recorded once (one
        # forward and one backward pass of the loss, with create_graph) and a product H u is
        # one backward pass through it, d/dz [grad(z) . u]. Forward-over-reverse
        # (jvp of grad) gives the same H but fails on some of torch's losses: the forward-mode
        # formula of mse_loss_backward divides the targets' zero tangent in place ("ZeroTensors
        # are immutable"), huber_loss_backward has none; and it cost 6 to 100 times more per
        # product on every loss measured (benchmarks/cost/loss_hessian_cost.py). Values the loss
        # computes under torch.no_grad are constants here, as in its gradient.
        z = outputs.detach()
        graph: list = []

        def product(u: Tensor) -> Tensor:
            with torch.enable_grad():
                if not graph:
                    w = z.clone().requires_grad_(True)
                    (g,) = torch.autograd.grad(self.value(w, targets), w, create_graph=True)
                    graph.extend((w, g))
                w, g = graph
                if not g.requires_grad:  # linear in the outputs: H = 0
                    return torch.zeros_like(u)
                try:
                    (hu,) = torch.autograd.grad(g, w, u, retain_graph=True, allow_unused=True)
                except (NotImplementedError, RuntimeError) as error:
                    op = missing_rule(error)
                    if op is None:
                        raise
                    raise ValueError(
                        f"the loss {self.name!r} has no second derivative in PyTorch ({op} "
                        "cannot be differentiated): SGN needs the Hessian of the loss with "
                        "respect to the model's outputs; give a loss that PyTorch can "
                        "differentiate twice"
                    ) from error
            return torch.zeros_like(u) if hu is None else hu

        return product

    def check_parameters(
        self, parameters: Sequence[Tensor], outputs: Callable[[], Tensor], targets: Tensor
    ) -> None:
        """Raises ``ValueError`` where the loss's value depends on ``parameters`` (a penalty
        inside the callable): checked once per set of parameters; ``outputs`` is called only
        then."""
        key = tuple(map(id, parameters))
        if key == self._parameters_checked:
            return
        if parameters_read(self, parameters, outputs(), targets):
            raise ValueError(
                f"the loss {self.name!r} depends on the model's parameters, not only on its "
                "outputs (a penalty on the parameters inside the loss?): that term is not part "
                "of the Gauss-Newton model, so SGN's steps would ignore it. For an L2 penalty "
                "use the optimizer's weight_decay; for another, return it as extra residual "
                "outputs of the model (e.g. concatenate sqrt(lam) * p.flatten() to the "
                "outputs, with zero targets) so that the loss sees it"
            )
        self._parameters_checked = key

    _parameters_checked: tuple = ()

    def normalizer(self, targets: Tensor) -> float:
        if self._per_element:  # torch's loss modules average over elements
            return float(targets.numel())
        return super().normalizer(targets)


def parameters_read(
    loss: OutputLoss, parameters: Sequence[Tensor], outputs: Tensor, targets: Tensor
) -> bool:
    """Whether the loss's value at ``outputs`` has a gradient path to any of ``parameters``.

    The engines evaluate the loss on outputs computed from parameters of their own, so a loss
    that reads the model's ``nn.Parameter`` tensors adds a term whose derivatives no engine
    sees: its value would count in the loss reported but not in the step.
    """
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        return False
    with torch.enable_grad():
        value = loss.value(outputs.detach(), targets)
        if not value.requires_grad:
            return False
        grads = torch.autograd.grad(value, trainable, allow_unused=True)
    return any(g is not None for g in grads)


class _WeightedCrossEntropy(_Generic):
    """``nn.CrossEntropyLoss`` with class weights, or ``nn.NLLLoss`` (log-probabilities in):
    Hessian products by autograd, the targets checked and the mean's divisor read as torch
    computes them."""

    def __init__(self, fn: nn.Module, name: str):
        super().__init__(fn, name)
        self.probabilities = isinstance(fn, nn.CrossEntropyLoss)

    def normalizer(self, targets: Tensor) -> float:
        return _cross_entropy_normalizer(targets, self.fn.ignore_index, self.fn.weight)

    def check_targets(self, outputs: Tensor, targets: Tensor) -> None:
        _check_class_targets(
            self.name, outputs, targets, self.fn.ignore_index, probabilities=self.probabilities
        )


class _WeightedBCEWithLogits(_Generic):
    """``nn.BCEWithLogitsLoss`` with ``weight`` or ``pos_weight``: products by autograd."""

    def normalizer(self, targets: Tensor) -> float:
        return float(targets.numel())

    def check_targets(self, outputs: Tensor, targets: Tensor) -> None:
        _BCEWithLogits.check_targets(self, outputs, targets)


_NAMED = {"mse": _MSE, "cross_entropy": _CrossEntropy, "bce_with_logits": _BCEWithLogits}


def _is_plain(loss: object, module: type) -> bool:
    """Whether ``loss`` is a ``module`` that computes what ``module`` does: a subclass with a
    ``forward`` of its own computes something else, and is a callable like any other."""
    return isinstance(loss, module) and type(loss).forward is module.forward


def resolve_loss(loss: LossSpec) -> OutputLoss:
    """Turns a loss given by name, ``torch.nn`` module or callable into an :class:`OutputLoss`.

    Module forms with options the closed-form Hessians do not cover (class ``weight``,
    ``pos_weight``) are handled by the generic autograd path, which is exact for them too.
    ``nn.KLDivLoss`` takes ``reduction="batchmean"`` as well.
    """
    if isinstance(loss, OutputLoss):
        return loss
    if isinstance(loss, type):
        raise TypeError(
            f"loss={loss.__name__} is a class; pass an instance, e.g. loss={loss.__name__}(), "
            "or a name such as 'mse'"
        )
    if isinstance(loss, str):
        if loss not in _NAMED:
            raise ValueError(
                f"unknown loss {loss!r}: use one of {sorted(_NAMED)}, a torch.nn loss module or "
                "a callable loss(outputs, targets) -> scalar"
            )
        return _NAMED[loss]()
    if _is_plain(loss, nn.MSELoss):
        return _MSE(loss.reduction)
    if _is_plain(loss, nn.CrossEntropyLoss):
        if loss.weight is None:
            return _CrossEntropy(loss.reduction, loss.label_smoothing, loss.ignore_index)
        _check_reduction(loss.reduction)
        return _WeightedCrossEntropy(loss, "cross_entropy")
    if _is_plain(loss, nn.NLLLoss):
        _check_reduction(loss.reduction)
        warn(
            "nn.NLLLoss is linear in the model's outputs (log-probabilities), so its "
            "Gauss-Newton matrix is zero and each SGN step is a gradient step of length "
            "lr / damping. To give SGN the curvature of the softmax, end the model at the logits "
            "(no log_softmax) and pass loss='cross_entropy', or nn.CrossEntropyLoss(weight=...) "
            "for class weights"
        )
        return _WeightedCrossEntropy(loss, "nll")
    if _is_plain(loss, nn.L1Loss):
        _check_reduction(loss.reduction)
        warn(
            "nn.L1Loss is piecewise linear in the model's outputs, so its Gauss-Newton matrix "
            "is zero and each SGN step is a gradient step of length lr / damping. For a loss "
            "with curvature near the targets, pass nn.HuberLoss() or nn.SmoothL1Loss()"
        )
        return _Generic(loss)
    if _is_plain(loss, nn.BCEWithLogitsLoss):
        if loss.weight is None and loss.pos_weight is None:
            return _BCEWithLogits(loss.reduction)
        _check_reduction(loss.reduction)
        return _WeightedBCEWithLogits(loss, "bce_with_logits")
    if _is_plain(loss, nn.KLDivLoss):
        _check_reduction(loss.reduction, ("mean", "sum", "batchmean"))
        warn(
            "nn.KLDivLoss is linear in the model's outputs (log-probabilities), so its "
            "Gauss-Newton matrix is zero and each SGN step is a gradient step of length "
            "lr / damping. To give SGN the curvature of the softmax, end the model at the logits "
            "and pass loss=lambda z, t: F.kl_div(F.log_softmax(z, dim=1), t, "
            "reduction='batchmean')"
        )
        return _Generic(loss, "kl_div")
    if isinstance(loss, nn.modules.loss._Loss):
        _check_reduction(loss.reduction)
    if callable(loss):
        return _Generic(loss)
    raise TypeError(
        f"loss must be a name, a torch.nn loss module or a callable, got {type(loss).__name__}"
    )
