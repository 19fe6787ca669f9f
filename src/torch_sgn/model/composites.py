"""Functions that SGN's passes run as composites of differentiable operators.

Some of PyTorch's functions compute what a gradient method needs, yet break a Gauss-Newton
product: their kernels have no forward-mode rule, or forward mode would differentiate what
their gradient leaves out. Within :class:`Composites` (a function mode, entered by
:meth:`~torch_sgn.model.flat_model.FunctionalModel.composites` around every forward pass of SGN's),
each call of them, from PyTorch's modules, a subclass with a forward of its own or ``forward``
itself, runs a composite that gives the same values and, in both modes, the derivatives of the
function's gradient:

* :func:`torch.nn.functional.embedding` with ``padding_idx``, ``max_norm``,
  ``scale_grad_by_freq`` or ``sparse`` (and the operator ``torch.embedding`` called directly
  with one of them), and :func:`torch.nn.functional.embedding_bag` (:mod:`torch_sgn.model.lookups`);
* ``torch._weight_norm``, which weight normalization calls (:mod:`torch_sgn.model.weight_norms`).

Every other function runs as it is. TorchScript code runs in C++, out of the mode's sight:
:func:`scripted_stop` finds scripted submodules that may hold such a lookup (or a
``torch.no_grad`` block), for which ``J v`` is taken by double backward instead.

A function mode passes every call of the forward pass
through Python and keeps ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` off their
fast paths, so :class:`~torch_sgn.model.flat_model.FunctionalModel` enters it only where the model
has such modules or its first, checked forward pass called one of these functions
(:attr:`Composites.routed`).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .lookups import bag_lookup, lookup
from .weight_norms import normalized

__all__ = ["Composites", "composite_modules", "scripted_stop"]

_EMBEDDING = inspect.signature(F.embedding)
_EMBEDDING_BAG = inspect.signature(F.embedding_bag)


def _schema(*names: str, **defaults: object) -> inspect.Signature:
    """The signature of a builtin operator, which has none to inspect: its schema's."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter(n, kind) for n in names]
    parameters += [inspect.Parameter(n, kind, default=d) for n, d in defaults.items()]
    return inspect.Signature(parameters)


_EMBEDDING_OP = _schema("weight", "indices", padding_idx=-1, scale_grad_by_freq=False, sparse=False)
_WEIGHT_NORM = _schema("v", "g", dim=0)


class Composites(TorchFunctionMode):
    """Routes the functions of this module's docstring through their composites; ``routed``
    says whether any call was."""

    def __init__(self) -> None:
        super().__init__()
        self.routed = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding:
            a = _bind(_EMBEDDING, args, kwargs)
            if _has_options(a["padding_idx"], a["max_norm"], a["scale_grad_by_freq"], a["sparse"]):
                self.routed = True
                return lookup(**a)
        elif func is torch.embedding:  # the operator, called directly (no padding: -1)
            a = _bind(_EMBEDDING_OP, args, kwargs)
            padding = a["padding_idx"] if a["padding_idx"] >= 0 else None
            if _has_options(padding, None, a["scale_grad_by_freq"], a["sparse"]):
                self.routed = True
                return lookup(
                    a["indices"], a["weight"], padding, None, 2.0, a["scale_grad_by_freq"], False
                )
        elif func is F.embedding_bag:
            a = _bind(_EMBEDDING_BAG, args, kwargs)
            if a["weight"].dtype == torch.long and a["input"].is_floating_point():
                a["input"], a["weight"] = a["weight"], a["input"]  # the deprecated order
            self.routed = True
            return bag_lookup(**a)
        elif func is torch._weight_norm:
            self.routed = True
            return normalized(**_bind(_WEIGHT_NORM, args, kwargs))
        return func(*args, **kwargs)


def composite_modules(model: nn.Module) -> bool:
    """Whether ``model`` has modules whose forward passes call a function of
    :class:`Composites`: embeddings with one of the options, embedding bags, weight
    normalization."""
    from torch.nn.utils import parametrize

    try:
        from torch.nn.utils.weight_norm import WeightNorm  # the older hook
    except ImportError:  # pragma: no cover - a torch without it
        WeightNorm = ()
    for module in model.modules():
        if isinstance(module, nn.EmbeddingBag):
            return True
        if isinstance(module, nn.Embedding) and _has_options(
            module.padding_idx, module.max_norm, module.scale_grad_by_freq, module.sparse
        ):
            return True
        if parametrize.is_parametrized(module):
            return True  # weight_norm, or another parametrization that may call it
        if any(isinstance(hook, WeightNorm) for hook in module._forward_pre_hooks.values()):
            return True
    return False


def scripted_stop(model: nn.Module) -> Optional[str]:
    """Where ``model`` holds a TorchScript submodule with trainable parameters whose code may
    look up embedding rows with one of the options above or compute under ``torch.no_grad``
    (neither :class:`Composites` nor the gradient-stop check sees into scripted code; forward
    mode would then differentiate what the gradient leaves out), said as "the forward pass
    ..." for :func:`~torch_sgn.model.forward_mode.gradient_stop_notice`; else ``None``. A scripted
    ``nn.Embedding`` is judged by its options; any other scripted module by whether its code
    calls ``aten::embedding`` or enters a ``with`` block at all."""
    seen: set = set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.jit.ScriptModule) or any(
            name.startswith(outer + ".") for outer in seen
        ):
            continue
        seen.add(name)
        if not any(p.requires_grad for p in module.parameters()):
            continue
        options = [getattr(module, o, None) for o in _OPTIONS]
        # a scripted nn.Embedding holds its options (a traced one, or another class of that
        # name, need not: their code is read below)
        if getattr(module, "original_name", None) == "Embedding" and all(
            isinstance(flag, bool) for flag in options[2:]
        ):
            if _has_options(*options):
                return (
                    f"looks up rows of the TorchScript embedding {name!r} with a padding row, "
                    "max_norm or frequency scaling: scripted code runs without SGN's "
                    "composite, and forward-mode AD would differentiate what the gradient "
                    "leaves out"
                )
            continue
        kinds = ("aten::embedding", "aten::embedding_renorm_", "prim::Enter")
        try:
            graph = module.inlined_graph
            found = any(graph.findAllNodes(kind) for kind in kinds)
        except (AttributeError, RuntimeError):  # no forward to read: assume the worst
            found = True
        if found:
            return (
                f"runs TorchScript module {name!r}, whose code looks up embedding rows or "
                "enters a with-block: a padding row or torch.no_grad there, which SGN cannot "
                "check in scripted code, would make forward-mode AD differentiate what the "
                "gradient leaves out"
            )
    return None


_OPTIONS = ("padding_idx", "max_norm", "scale_grad_by_freq", "sparse")


def _has_options(
    padding_idx: Optional[int], max_norm: Optional[float], scale_grad_by_freq: bool, sparse: bool
) -> bool:
    """Whether an embedding lookup has an option that breaks a Gauss-Newton product."""
    return padding_idx is not None or max_norm is not None or scale_grad_by_freq or sparse


def _bind(signature: inspect.Signature, args, kwargs) -> dict:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
