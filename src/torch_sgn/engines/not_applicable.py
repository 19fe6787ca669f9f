"""The exception by which an engine declines a model or a batch it cannot evaluate: the engine
selection (:mod:`torch_sgn.engines.selection`) then hands the call to the next engine of its
chain."""

__all__ = ["NotApplicable"]


class NotApplicable(Exception):
    """The engine does not apply to this model or batch; the message says why (it completes a
    warning: ``"<why>; using the functional engine, ..."``)."""
