"""The SGN methods of the DeepXDE benchmarks (``deepxde_examples.py``, ``pinnacle.py``), in one
table: each method's ``torch_sgn.deepxde.SGN`` arguments and the callbacks it adds to a run.

* ``sgn``: the defaults;
* ``sgn_balance``: ``balance=True`` (each loss term's weight divided by its value at the first
  step: the rule for inverse problems, docs/PINN.md);
* ``sgn_causal``: ``causal=True`` (the PDE blocks weighted along time);
* ``sgn_rad``: the defaults with ``torch_sgn.deepxde.ResidualPoints()`` among the callbacks
  (the PDE's points redrawn by the residual every 25 steps: the rule for shocks, sharp fronts
  and re-entrant corners).

A script offers the methods it names (:func:`subset`).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

# (torch_sgn.deepxde is imported where it is used: the scripts set DeepXDE's backend first)

#: Each method's arguments of ``torch_sgn.deepxde.SGN`` besides the model.
ARGUMENTS: Dict[str, dict] = {
    "sgn": {},
    "sgn_balance": {"balance": True},
    "sgn_causal": {"causal": True},
    "sgn_rad": {},
}


def subset(*names: str) -> Tuple[str, ...]:
    """``names``, each checked to be a method of the table."""
    unknown = [n for n in names if n not in ARGUMENTS]
    if unknown:
        raise KeyError(f"not SGN methods of the table: {unknown}")
    return names


def optimizer(model, method: str):
    """``method``'s optimizer for the DeepXDE ``model`` (a ``torch_sgn.deepxde.SGN``)."""
    import torch_sgn.deepxde

    return torch_sgn.deepxde.SGN(model, **ARGUMENTS[method])


def callbacks(method: str) -> List:
    """The callbacks ``method`` adds to a run's ``train``."""
    import torch_sgn.deepxde

    return [torch_sgn.deepxde.ResidualPoints()] if method == "sgn_rad" else []
