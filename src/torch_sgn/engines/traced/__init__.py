"""The traced engine: any model ``torch.fx`` can trace, as one graph of the loss, its
gradient and ``G v``, split at ``v`` (:mod:`.engine`), with the forward-mode rules of
:mod:`.jvp_rules`."""

from .engine import TracedEngine

__all__ = ["TracedEngine"]
