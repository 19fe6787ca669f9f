"""Methods of particular objects replaced for the length of a block.

SGN's passes run some of a model's modules another way (:mod:`torch_sgn.lookups`,
:mod:`torch_sgn.weight_norms`): the replacement is bound to the object itself, so the class
and every other instance keep their own method, and removed on exit.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Tuple

__all__ = ["replaced_methods"]


@contextmanager
def replaced_methods(replacements: Iterable[Tuple[object, str, Callable]]) -> Iterator[None]:
    """Within this block, ``obj.name`` is ``function`` bound to ``obj`` for each
    ``(obj, name, function)``; the object's own method is back on exit, also where the block
    raises. A method replaced already (by an enclosing block) is left to that block."""
    replaced = []
    for obj, name, function in replacements:
        if name in obj.__dict__:
            continue
        setattr(obj, name, types.MethodType(function, obj))
        replaced.append((obj, name))
    try:
        yield
    finally:
        for obj, name in replaced:
            delattr(obj, name)
