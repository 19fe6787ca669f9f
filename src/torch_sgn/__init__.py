"""torch-sgn: the Stochastic Generalized Gauss-Newton optimizer for PyTorch.

Public API::

    from torch_sgn import SGN, GGN, StepInfo, conjugate_gradient, CGResult
    from torch_sgn import least_squares, LeastSquaresResult, nystrom, NystromApproximation
    from torch_sgn.pinn import Residuals, Residual, laplacian  # physics-informed networks
"""

from .fitting import LeastSquaresResult, least_squares
from .ggn import GGN
from .optimizer import SGN, StepInfo
from .solve.cg import CGResult, conjugate_gradient
from .solve.nystrom import NystromApproximation, nystrom

__all__ = [
    "SGN",
    "GGN",
    "StepInfo",
    "CGResult",
    "conjugate_gradient",
    "least_squares",
    "LeastSquaresResult",
    "NystromApproximation",
    "nystrom",
]
__version__ = "0.5.0"
