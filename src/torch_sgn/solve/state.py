"""SGN's state from one step to the next, typed: :class:`StepState`, made of the parts each
part of the step owns and advances.

* :class:`DampingState`: the damping the trust region carries, advanced by the damped step
  (:mod:`~torch_sgn.solve.step`);
* :class:`History`: what the next step's solve reads of this one (the gradient's average, the
  last solution and update), advanced by the step core;
* :class:`AutoState`: ``solver="auto"``'s probes and switch, advanced by
  :meth:`torch_sgn.route_plan.Router.advance`;
* :class:`RowsState`: the stages of a problem of many rows, advanced by
  :func:`torch_sgn.route_plan.advance_rows`.

The optimizer keeps it, as torch's optimizers keep global state (:class:`torch.optim.LBFGS`), in
the ``state`` of its first parameter, as one plain dict of the keys :data:`KEYS` (so that
``state_dict()`` saves plain values and ``load_state_dict`` casts its tensors to the
parameters' device and dtype): :meth:`StepState.as_dict` flattens the parts, with the keys
state dicts have always had, and :meth:`StepState.of` reads them back. A step reads it with
:meth:`StepState.of`, works on the dataclasses, and writes it back with
:meth:`StepState.write` only when it commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, List, MutableMapping, Optional

from torch import Tensor

if TYPE_CHECKING:
    from ..options import Options

__all__ = [
    "GROWTH_START", "KEYS", "AutoState", "DampingState", "History", "RowsState", "StepState",
]  # fmt: skip

#: The first growth factor of a run of rejected steps (Nielsen, 1999), doubled at each: a
#: state's growth where none is carried.
GROWTH_START = 2.0


@dataclass(frozen=True)
class DampingState:
    """The damping a step starts from.

    Attributes:
        value: the damping the trust region carries to the next step (stored as ``damping``).
        growth: Nielsen's growth factor of a run of rejected attempts
            (``damping_update="nielsen"``; ``None`` before the rule has run; stored as
            ``damping_growth``).
    """

    value: float
    growth: Optional[float] = None


@dataclass(frozen=True)
class History:
    """What the next step's solve reads of this one.

    Attributes:
        momentum_buffer: the gradient's moving average ``m`` (``momentum > 0``).
        prev_direction: the last step's solution ``d`` (``warm_start > 0``).
        prev_step: the last step's update, the parameters' change (``step_rule="quadratic"``;
            ``None`` after a step that did not move).
    """

    momentum_buffer: Optional[Tensor] = None
    prev_direction: Optional[Tensor] = None
    prev_step: Optional[Tensor] = None

    def restricted(self, mask: Tensor) -> History:
        """The vectors zero where ``mask`` is: CG's iterates then stay in the directions still
        trainable."""
        m, d, s = self.momentum_buffer, self.prev_direction, self.prev_step
        return History(
            None if m is None else m * mask,
            None if d is None else d * mask,
            None if s is None else s * mask,
        )


@dataclass(frozen=True)
class AutoState:
    """``solver="auto"``'s state (:func:`~torch_sgn.route_plan.auto_phase`).

    Attributes:
        exact: it has switched to exact steps for good.
        next_probe: the step of its next probe.
        candidate: the last probe's point, judged on the next step's batch.
        recent: the last batch losses of its stall test.
    """

    exact: bool = False
    next_probe: Optional[int] = None
    candidate: Optional[Tensor] = None
    recent: Optional[List[float]] = None


@dataclass(frozen=True)
class RowsState:
    """The stages of a problem of more rows than an exact step takes
    (:func:`torch_sgn.route_plan.row_stage`).

    Attributes:
        stalls: how often the exact steps on samples have stalled: each doubles the sample, and
            past the largest sample the steps go on every row.
        sampled_losses: the last losses of those sampled steps (the stall test).
    """

    stalls: int = 0
    sampled_losses: Optional[List[float]] = None


@dataclass(frozen=True)
class StepState:
    """What one step hands the next: the steps taken ``t`` and each part's state."""

    step: int
    damping: DampingState
    history: History = field(default_factory=History)
    auto: AutoState = field(default_factory=AutoState)
    rows: RowsState = field(default_factory=RowsState)

    @classmethod
    def first(cls, options: Options) -> StepState:
        """The state before the first step, from SGN's options: the initial damping, and
        Nielsen's growth factor where ``damping_update="nielsen"``."""
        growth = GROWTH_START if options.damping_update == "nielsen" else None
        return cls(0, DampingState(float(options.damping), growth))

    @classmethod
    def of(cls, stored: MutableMapping) -> StepState:
        """The state kept as a dict (in a parameter's ``state``); keys it does not know are
        ignored."""
        parts: dict = {name: {} for name in _PARTS}
        for key, (part, name) in _PLACES.items():
            if key in stored:
                parts[part][name] = stored[key]
        return cls(
            stored["step"],
            DampingState(stored["damping"], stored.get("damping_growth")),
            **{name: kind(**parts[name]) for name, kind in _PARTS.items()},
        )

    def as_dict(self) -> dict:
        """The dict kept and saved: every key whose value is set (``exact`` only once true,
        ``stalls`` once above 0), so that a saved state holds exactly what the run has used."""
        values = {
            "step": self.step,
            "damping": self.damping.value,
            "damping_growth": self.damping.growth,
        }
        for key, (part, name) in _PLACES.items():
            values[key] = getattr(getattr(self, part), name)
        out = {}
        for key in KEYS:
            value = values[key]
            if value is not None and not (key in ("exact", "stalls") and not value):
                out[key] = value
        return out

    def write(self, stored: MutableMapping) -> None:
        """Replaces the contents of ``stored`` (the same dict object) with this state."""
        stored.clear()
        stored.update(self.as_dict())

    def restricted(self, mask: Tensor) -> StepState:
        """The state whose vectors (gradient average, previous direction and update) are zero
        where ``mask`` is (:meth:`History.restricted`)."""
        return replace(self, history=self.history.restricted(mask))


#: The parts of :class:`StepState` stored under their fields' own names.
_PARTS = {"history": History, "auto": AutoState, "rows": RowsState}
#: Each stored key of those parts: its part and field.
_PLACES = {f.name: (part, f.name) for part, kind in _PARTS.items() for f in fields(kind)}
#: The keys of the stored state, in the order state dicts have always kept them.
KEYS = (
    "step", "damping", "damping_growth", "momentum_buffer", "prev_direction", "prev_step",
    "exact", "next_probe", "candidate", "recent", "stalls", "sampled_losses",
)  # fmt: skip
