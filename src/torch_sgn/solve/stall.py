"""The stall test of a run of losses: whether their fall has stopped.

``solver="auto"`` switches to exact steps when the batch losses of its CG steps stall
(:mod:`~torch_sgn.solve.auto`), and the exact steps on samples of a problem of many rows grow
their sample when theirs stall (:mod:`torch_sgn.many_rows`): one test, each with its own
window and share (:class:`StallTest`), each over the losses its owner keeps in its part of the
optimizer's state (:mod:`~torch_sgn.solve.state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

__all__ = ["StallTest"]


@dataclass(frozen=True)
class StallTest:
    """The losses stall when the mean of the last ``window`` fell by less than ``share`` (of
    its size) below the mean of the ``window`` before.

    Attributes:
        window: the losses in each of the two windows compared.
        share: the relative fall of the windows' mean above which the losses have not stalled.
    """

    window: int
    share: float

    def kept(self, losses: Optional[Sequence[float]], loss: float) -> List[float]:
        """``losses`` with ``loss`` appended, the last ``2 * window`` of them (what the test
        reads)."""
        return [*(losses or ()), loss][-2 * self.window :]

    def stalled(self, losses: Sequence[float]) -> bool:
        """Whether ``losses`` have stalled; ``False`` until both windows are full."""
        if len(losses) < 2 * self.window:
            return False
        w = self.window
        before, last = sum(losses[-2 * w : -w]), sum(losses[-w:])
        return before - last <= self.share * abs(before)
