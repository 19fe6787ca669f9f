"""Warnings that name the user's line, not a line of this library.

``warnings.warn`` attributes a warning to the frame ``stacklevel`` frames up; counted by hand,
that number goes stale whenever the call path changes (an engine called from the optimizer's
step or from its constructor, through torch's step wrapper or not). :func:`warn` counts it at
the call: it skips every frame of this package and of torch (``Optimizer.step``'s hook wrapper,
``torch.no_grad``'s decorator) and names the first frame beyond them. Python 3.12's
``skip_file_prefixes`` does the same; this works on every version the package supports.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Type

import torch

__all__ = ["WarnOnce", "warn"]

_SKIPPED = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` called by this function's caller that names
    the first frame outside this package and torch (the outermost frame if there is none)."""
    frame = sys._getframe(1)  # the frame that calls warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _SKIPPED
    ):
        frame = frame.f_back
        level += 1
    return level


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line."""
    warnings.warn(message, category, stacklevel=_user_stacklevel())


class WarnOnce:
    """:func:`warn` for each distinct message once (an engine's notices, which would otherwise
    repeat at every step)."""

    def __init__(self) -> None:
        self._warned: set = set()

    def __call__(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warn(message)
