"""torch-sgn: the Stochastic Generalized Gauss-Newton optimizer for PyTorch.

Public API::

    from torch_sgn import SGN, GGN, StepInfo, conjugate_gradient, CGResult
"""

from .cg import CGResult, conjugate_gradient
from .ggn import GGN
from .optimizer import SGN, StepInfo

__all__ = ["SGN", "GGN", "StepInfo", "CGResult", "conjugate_gradient"]
__version__ = "0.1.0"
