"""How ``SGN.step`` is called: a mini-batch, never a closure alone.

torch's optimizers take ``step(closure)``, a function that returns the loss. SGN needs the
model's outputs and the targets (to form ``G = J^T H J``), so it takes the batch,
``step(inputs, targets)``, positionally or by keyword. Training loops that pass a closure of
their own beside the batch are served by calling it once before the step; a closure alone is
refused with the reason.

PyTorch Lightning's manual optimization, ``self.optimizers().step(inputs=x, targets=y)``, passes
the batch through as keywords together with a closure that it always builds (its precision
plugin's wrapper around the user's closure, or around a no-op when the user gives none). That
wrapper runs the ``on_before_optimizer_step`` hooks; calling it once keeps them, and the
trainer's step count, as with any optimizer. Lightning's automatic optimization calls
``step(closure=...)`` with no batch, which SGN cannot serve: the error says what to do instead.

A :class:`torch.amp.GradScaler` that steps SGN (``scaler.step(opt, x, y)`` after
``scaler.scale(loss).backward()``, as a ``torch.amp`` training loop has it) is refused with the
alternatives (:func:`refuse_grad_scaler`): it scales a loss the user backpropagated and unscales
its gradients, while SGN computes its own loss, gradient and curvature at every step, so there
is nothing for it to scale. (Lightning's ``precision="16-mixed"`` on CUDA never reaches SGN: its
scaler fails first, having scaled no loss.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .batch import Inputs

_WHY = (
    "SGN.step takes the mini-batch, opt.step(inputs, targets), not a closure: SGN needs the "
    "model's outputs and the targets, not only the loss a closure returns, to form the "
    "Gauss-Newton matrix J^T H J, and runs the forward passes itself"
)
_LIGHTNING = (
    ". With PyTorch Lightning, set `self.automatic_optimization = False` in the "
    "LightningModule's __init__ and call `self.optimizers().step(inputs=x, targets=y)` in "
    "training_step (keywords: LightningOptimizer.step takes no positional batch)"
)
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
_GRAD_SCALER = (
    "SGN.step was called by a torch.amp.GradScaler (PyTorch Lightning: precision='16-mixed'). "
    "SGN computes its own loss, gradient and Gauss-Newton products at every step, so there is "
    "no scaled loss to unscale: drop the scaler and step under "
    "torch.autocast alone, with dtype=torch.bfloat16 (float32's range; Lightning: "
    "precision='bf16-mixed') or torch.float16 (its products are then not loss-scaled)"
)


def refuse_grad_scaler(optimizer: object) -> None:
    """Raises ``TypeError`` where a :class:`torch.amp.GradScaler` calls the step.

    An optimizer with ``_step_supports_amp_scaling`` (SGN has it) is stepped by
    ``GradScaler.step`` directly, with its scale and inf flag set as the attributes
    ``grad_scale`` and ``found_inf`` for the call: their presence says who called. Without the
    flag the scaler would first fail on its own, with an assertion that names no cause. The
    attributes are removed before the error (the scaler removes them only after a step that
    returns), so that the optimizer steps as before once the scaler is gone.
    """
    present = [name for name in ("found_inf", "grad_scale") if hasattr(optimizer, name)]
    for name in present:
        delattr(optimizer, name)
    if present:
        raise TypeError(_GRAD_SCALER)


def batch_of_call(
    inputs: Optional[Inputs], targets: Optional[Tensor], closure: Optional[Callable[[], Any]]
) -> tuple[Optional[Inputs], Optional[Tensor]]:
    """The batch that ``SGN.step(inputs, targets, closure=closure)`` steps on.

    A closure given beside the batch is called once, with gradients enabled, before the step
    (where ``torch.optim`` optimizers call theirs); its value is not used. A closure without a
    batch, positional (``step(closure)``) or by keyword, raises ``TypeError``.
    """
    alone = closure if inputs is None and targets is None else None
    if callable(inputs) and targets is None:  # torch's step(closure)
        alone = inputs
    if alone is not None:
        raise TypeError(_WHY + (_LIGHTNING if _from_lightning(alone) else ""))
    if closure is not None:
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        if targets is not None:  # else the step refuses the batch before anything ran
            with torch.enable_grad():
                closure()
    return inputs, targets


def _from_lightning(closure: Callable[[], Any]) -> bool:
    # Lightning's closures are functools.partial objects of its precision plugin's methods,
    # wrapping instances of its own Closure class.
    parts = [closure]
    if isinstance(closure, functools.partial):
        parts += [closure.func, *closure.args]
    modules = [getattr(p, "__module__", None) or type(p).__module__ for p in parts]
    return any(m.split(".")[0] in _LIGHTNING_PACKAGES for m in modules)
