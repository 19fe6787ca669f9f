"""Physics-informed networks and residual least squares.

* :class:`Residuals` and :class:`Residual` (:mod:`.residuals`): a least-squares problem of
  weighted residual blocks, each over its own points (fixed, or drawn anew at each step) or of
  the parameters alone, as a module :class:`~torch_sgn.SGN` steps on.
* :mod:`.operators`: the differential operators residuals are written with (:func:`gradient`,
  :func:`laplacian`, :func:`divergence`, :func:`time_derivative`, :func:`jet`, :func:`hessian`,
  :func:`hessian_jet`, :func:`derivative`), propagated forward through the network's layers
  (the forward Laplacian), so every engine differentiates them as ordinary operations.
* :class:`Causal` (:mod:`.causal`): causal weighting of a block along time, its slabs'
  weights computed at each step from the current parameters.
* :mod:`.jet_layers`: layers the forward jets take beside ``nn.Linear`` and activations
  (:class:`ParallelLinear`, branches side by side; :class:`InputMap`, a map of the points).
"""

from .causal import Causal, CausalWeights
from .jet_layers import InputMap, ParallelLinear
from .operators import (
    HessianJet,
    Jet,
    Sin,
    derivative,
    divergence,
    gradient,
    hessian,
    hessian_jet,
    jet,
    laplacian,
    time_derivative,
)
from .residuals import Residual, Residuals

__all__ = [
    "Causal",
    "CausalWeights",
    "HessianJet",
    "InputMap",
    "Jet",
    "ParallelLinear",
    "Residual",
    "Residuals",
    "Sin",
    "derivative",
    "divergence",
    "gradient",
    "hessian",
    "hessian_jet",
    "jet",
    "laplacian",
    "time_derivative",
]
