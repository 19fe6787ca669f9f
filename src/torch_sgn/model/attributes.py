"""The plain values a model's modules hold beside their parameters, buffers and submodules.

An engine that records the forward pass once (the traced engine's trace, the layer-wise
engine's plan of layer rules) takes such values as constants: a temperature, a flag, a layer's
setting (``LeakyReLU.negative_slope``), a tensor held as an attribute. :func:`model_attributes`
snapshots them, so that a change between steps calls for a new recording;
:func:`changed_attributes` names what changed.
"""

from __future__ import annotations

from typing import List

import torch
from torch import Tensor, nn

__all__ = ["changed_attributes", "model_attributes", "module_state", "restore_module_state"]

#: what every module holds (parameters, buffers, submodules, hooks, the training flag), which
#: the engines' keys cover apart
_MODULE_STATE = frozenset(vars(nn.Module()))


def model_attributes(model: nn.Module) -> tuple:
    """The plain values the modules hold beside their parameters, buffers and submodules
    (numbers, strings, flags, tensors by identity, tuples and lists of them), as
    ``(("<module path>.<name>", value), ...)``: what an engine that records the forward pass
    once (a trace, a plan of layer rules) takes as constants, to compare from step to step.
    Other objects (configurations, functions) are left out, and so are tensors under private
    names: caches of the module's own (``nn.LSTM._flat_weights`` holds whatever tensors its
    weights were last set to, a new list after each of SGN's functional passes)."""
    out = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if name in _MODULE_STATE:
                continue
            frozen = _frozen(value, tensors=not name.startswith("_"))
            if frozen is not _OPAQUE:
                out.append((f"{path}.{name}" if path else name, frozen))
    return tuple(out)


_OPAQUE = object()
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _frozen(value: object, depth: int = 0, tensors: bool = True) -> object:
    """A hashable snapshot of ``value``, or ``_OPAQUE`` (a tensor too, unless ``tensors``)."""
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, Tensor):  # read by the trace as it is, in place changes included
        return ("tensor", id(value)) if tensors else _OPAQUE
    if isinstance(value, (tuple, list)) and depth < 2 and len(value) <= 64:
        items = tuple(_frozen(v, depth + 1, tensors) for v in value)
        return _OPAQUE if any(i is _OPAQUE for i in items) else (type(value).__name__, items)
    return _OPAQUE


def changed_attributes(before: tuple, after: tuple) -> List[str]:
    """The names whose values differ between two :func:`model_attributes` snapshots."""
    old = dict(before)
    return [n for n, v in after if n in old and old[n] is not v and old[n] != v]


def module_state(model: nn.Module) -> list:
    """Every module's own attributes (beside parameters, buffers, submodules and hooks), as
    they are: what :func:`restore_module_state` puts back after a pass that must leave no
    trace in them (a trace's forward pass writes fake tensors where ``forward`` stores one)."""
    return [
        (m, {k: v for k, v in vars(m).items() if k not in _MODULE_STATE}) for m in model.modules()
    ]


def restore_module_state(state: list) -> None:
    """Puts back the attributes :func:`module_state` took (and drops those added since)."""
    for module, before in state:
        own = vars(module)
        for name in [k for k in own if k not in _MODULE_STATE and k not in before]:
            del own[name]
        for name, value in before.items():
            if own.get(name, _OPAQUE) is not value:
                own[name] = value
