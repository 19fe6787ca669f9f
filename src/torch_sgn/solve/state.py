"""SGN's state from one step to the next, typed: :class:`StepState`.

The optimizer keeps it, as torch's optimizers keep global state (:class:`torch.optim.LBFGS`), in
the ``state`` of its first parameter, as a plain dict of the keys :data:`KEYS` (so that
``state_dict()`` saves plain values and ``load_state_dict`` casts its tensors to the
parameters' device and dtype). A step reads it with :meth:`StepState.of`, works on the
dataclass, and writes it back with :meth:`StepState.write` only when it commits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, List, MutableMapping, Optional

from torch import Tensor

from .damping import GROWTH_START

if TYPE_CHECKING:
    from ..options import Options

__all__ = ["KEYS", "StepState"]


@dataclass(frozen=True)
class StepState:
    """What one step hands the next.

    Attributes:
        step: the steps taken, ``t``.
        damping: the damping the trust region carries to the next step.
        damping_growth: Nielsen's growth factor of a run of rejected attempts
            (``damping_update="nielsen"``; ``None`` before the rule has run).
        momentum_buffer: the gradient's moving average ``m`` (``momentum > 0``).
        prev_direction: the last step's solution ``d`` (``warm_start > 0``).
        prev_step: the last step's update, the parameters' change (``step_rule="quadratic"``;
            ``None`` after a step that did not move).
        exact: ``solver="auto"`` has switched to exact steps for good
            (:mod:`~torch_sgn.solve.auto`).
        next_probe: the step of ``"auto"``'s next probe.
        candidate: the last probe's point, judged on the next step's batch.
        recent: the last batch losses of ``"auto"``'s stall test.
        stalls: how often the exact steps on samples of a problem of more rows than an exact
            step takes have stalled (:mod:`torch_sgn.many_rows`): each doubles the sample,
            and past the largest sample the steps go on every row.
        sampled_losses: the last losses of those sampled steps (the stall test).
    """

    step: int
    damping: float
    damping_growth: Optional[float] = None
    momentum_buffer: Optional[Tensor] = None
    prev_direction: Optional[Tensor] = None
    prev_step: Optional[Tensor] = None
    exact: bool = False
    next_probe: Optional[int] = None
    candidate: Optional[Tensor] = None
    recent: Optional[List[float]] = None
    stalls: int = 0
    sampled_losses: Optional[List[float]] = None

    @classmethod
    def first(cls, options: Options) -> StepState:
        """The state before the first step, from SGN's options: the initial damping, and
        Nielsen's growth factor where ``damping_update="nielsen"``."""
        growth = GROWTH_START if options.damping_update == "nielsen" else None
        return cls(0, float(options.damping), growth)

    @classmethod
    def of(cls, stored: MutableMapping) -> StepState:
        """The state kept as a dict (in a parameter's ``state``); keys it does not know are
        ignored."""
        return cls(**{k: stored[k] for k in KEYS if k in stored})

    def as_dict(self) -> dict:
        """The dict kept and saved: every key whose value is set (``exact`` only once true,
        ``stalls`` once above 0), so that a saved state holds exactly what the run has used."""
        out = {}
        for key in KEYS:
            value = getattr(self, key)
            if value is not None and not (key in ("exact", "stalls") and not value):
                out[key] = value
        return out

    def write(self, stored: MutableMapping) -> None:
        """Replaces the contents of ``stored`` (the same dict object) with this state."""
        stored.clear()
        stored.update(self.as_dict())

    def restricted(self, mask: Tensor) -> StepState:
        """The state whose vectors (gradient average, previous direction and update) are zero
        where ``mask`` is: CG's iterates then stay in the directions still trainable."""
        m, d, s = self.momentum_buffer, self.prev_direction, self.prev_step
        return replace(
            self,
            momentum_buffer=None if m is None else m * mask,
            prev_direction=None if d is None else d * mask,
            prev_step=None if s is None else s * mask,
        )


#: The keys of the stored state, in :class:`StepState`'s order.
KEYS = tuple(f.name for f in fields(StepState))
