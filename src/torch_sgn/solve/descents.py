r"""What a route and a descent are: the routes' names, a step's :class:`Phase` and the
:class:`Descent` protocol.

.. math::
    (G + \rho I)\, d = -\hat m

A *descent* (Optimistix's word, ``optimistix/_solver/levenberg_marquardt.py``) is a small object
``damping -> result`` built once per step from the step's curvature operator and right-hand side,
both explicit values; the step's damping attempts (:mod:`~torch_sgn.solve.step`) call it with
one damping after another and it may keep work between the calls (a matrix formed once, factored
at each damping). Four descents, one per *route*, built by the step core
(:mod:`torch_sgn.solve.core`, which holds them):

* :class:`~torch_sgn.solve.core.CGDescent` (``"cg"``): truncated conjugate gradient on
  ``v -> G v + rho v``;
* :class:`~torch_sgn.solve.core.MatrixDescent` (``"matrix"``): exactly, through the ``P x P``
  matrix ``G`` (:func:`~torch_sgn.solve.direct.solve_damped`);
* :class:`~torch_sgn.solve.core.SampleSpaceDescent` (``"samples"``): exactly, through the
  batch's ``R`` outputs (:func:`~torch_sgn.solve.direct.solve_in_sample_space`);
* :class:`~torch_sgn.solve.core.SampledDescent` (``"sampled"``): CG on every row of a problem
  too large for either, preconditioned by a random sample of its rows
  (:mod:`~torch_sgn.solve.sampled`).

Every result (:class:`~torch_sgn.solve.cg.CGResult` or
:class:`~torch_sgn.solve.direct.DirectResult`) has ``x`` (``d``), ``residual``
(``A d + rhs`` for the matrix ``A`` actually solved), ``iterations``, ``reason`` (why the
solve stopped, or how it solved) and ``breakdown``. This module names them for the step
(:mod:`~torch_sgn.solve.step`), the quadratic step rule and the route plan, which import
nothing of the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

from torch import Tensor

from .cg import CGResult
from .direct import DirectResult

__all__ = [
    "CG", "MATRIX", "ROUTES", "SAMPLED", "SAMPLES", "TOO_LARGE", "Accelerate", "Descent", "Phase",
    "Result", "TooLarge",
]  # fmt: skip

#: The routes: by CG, exactly through ``G``, exactly through the batch's outputs, by CG on
#: every row preconditioned by a sample of them.
CG, MATRIX, SAMPLES, SAMPLED = "cg", "matrix", "samples", "sampled"
ROUTES = (CG, MATRIX, SAMPLES, SAMPLED)

#: What a descent returns.
Result = Union[CGResult, DirectResult]


class TooLarge:
    """What :func:`~torch_sgn.solve.core.accelerator` gives for an ``a`` above
    :data:`~torch_sgn.solve.core.RATIO` against the step (where the caller may reject the
    attempt, Transtrum and Sethna's rule) rather than ``None``."""

    def __repr__(self) -> str:
        return "TOO_LARGE"


#: The one :class:`TooLarge`.
TOO_LARGE = TooLarge()

#: ``result -> (lr^2 / 2) a``: the geodesic acceleration's term of an exact solve, ``None``
#: where it is not used, :data:`TOO_LARGE` where it is too large against the step
#: (:func:`torch_sgn.solve.core.accelerator`).
Accelerate = Callable[[Result], Union[Tensor, TooLarge, None]]


@dataclass(frozen=True)
class Phase:
    """What one step of ``solver="auto"`` does.

    ``route``: the route it takes (:data:`ROUTES`); ``probe``: the exact route solved besides, whose
    point is the next step's candidate (``None``: no probe); ``verdict``: whether the last probe's
    candidate won on this step's batch (``None``: none was judged); ``one_batch``: a CG step of a
    run that fits one batch with a forward that differentiates itself
    (:func:`~torch_sgn.solve.core.cg_settings`).
    """

    route: str
    probe: Optional[str] = None
    verdict: Optional[bool] = None
    one_batch: bool = False


class Descent(Protocol):
    """``damping -> result``: the step's damped system solved at one damping."""

    def __call__(self, damping: float) -> Result: ...
