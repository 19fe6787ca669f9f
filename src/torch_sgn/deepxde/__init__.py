"""SGN for DeepXDE models (``pip install "torch-sgn[deepxde]"``, DeepXDE >= 1.15, its PyTorch
backend).

A DeepXDE user switches optimizer the DeepXDE way, and nothing else changes::

    import torch_sgn.deepxde

    model = dde.Model(data, net)
    model.compile(torch_sgn.deepxde.SGN(model))   # SGN's options as keywords
    model.train(iterations=1000, callbacks=[...])  # DeepXDE's own loop, display, callbacks

* :class:`SGN` (:mod:`.optimizer`): the optimizer DeepXDE's ``compile`` takes;
* :class:`ResidualPoints` (:mod:`.points`): a callback that redraws the PDE's training points
  where its residual is large (RAD);
* :mod:`.problem`: the model's loss as residual blocks (:class:`torch_sgn.pinn.Residuals`), one
  per PDE component and per condition;
* :mod:`.derivatives`: ``dde.grad.jacobian`` and ``dde.grad.hessian`` answered from forward
  jets of the network, with no nested autograd.
"""

try:
    import deepxde  # noqa: F401
except ImportError as error:  # pragma: no cover - the optional extra
    raise ImportError(
        'torch_sgn.deepxde needs DeepXDE: pip install "torch-sgn[deepxde]" (with '
        "DDE_BACKEND=pytorch)"
    ) from error

from .optimizer import SGN
from .points import ResidualPoints
from .problem import Problem

__all__ = ["SGN", "Problem", "ResidualPoints"]
