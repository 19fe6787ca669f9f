"""The model as a function: the first of torch-sgn's three layers.

* :mod:`.flat_model`: :class:`~torch_sgn.model.flat_model.FunctionalModel`, any ``nn.Module``
  evaluated at one flat parameter vector; every engine evaluates the model through it.
* :mod:`.forward_mode`: what forward-mode AD needs (decompositions, kernels with a
  forward-mode rule, ``J v`` by double backward where an operator has none, gradient stops,
  backward hooks).
* :mod:`.attributes`: the plain Python settings a ``forward`` reads.
* :mod:`.composites`, :mod:`.lookups`, :mod:`.weight_norms`: layers replaced while SGN
  evaluates them by compositions of operators every engine differentiates.
"""
