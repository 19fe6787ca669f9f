"""The traced engine: any model ``torch.fx`` can trace, as one graph of the loss, its
gradient and ``G v``, split at ``v``.

* :mod:`.engine`: the engine (:class:`TracedEngine`): a trace per input shape, its graphs run
  at each step;
* :mod:`.trace`: the tracing, with the forward-mode rules of :mod:`.jvp_rules`;
* :mod:`.split`: the split into the once-per-step set-up and the per-product part;
* :mod:`.passes`: the rewrites of the graphs, each with its switch;
* :mod:`.replay`: the graphs captured as CUDA graphs and replayed, or compiled;
* :mod:`.nodes`: what a graph's operator writes into, draws and depends on.
"""

from .engine import TracedEngine

__all__ = ["TracedEngine"]
