"""The curvature engines: the second layer.

An engine linearizes the model and the loss at a point on a mini-batch (the
:class:`~torch_sgn.linearization.Linearization` it returns holds the loss, the gradient and the
product ``v -> G v``). :func:`select_engine` picks one for the ``engine`` argument:

* :mod:`.layerwise`: chains of known layers, by hand-written per-layer rules;
* :mod:`.traced`: any model ``torch.fx`` can trace, one traced graph split at ``v``;
* :mod:`.functional`: any model, by ``torch.func``; and on it a residual problem's engine,
  from its rows (first in the chain for such a problem);
* :mod:`.cuda_graphs`: capture and replay of an engine's work as CUDA graphs.
"""

from .selection import ENGINES, curvature_subset, select_engine

__all__ = ["ENGINES", "curvature_subset", "select_engine"]
