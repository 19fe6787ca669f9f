"""SGN's options as kept in ``param_groups``: checked at construction, at every step (a user or
a scheduler may have changed them since) and when a ``state_dict`` is loaded; the constructor's
other arguments (:func:`check_arguments`); the paper's configuration (:data:`PAPER_OPTIONS`).

SGN's gradient averaging :math:`\\beta` (the constructor's ``momentum``) is kept under the key
``"gradient_averaging"``, not ``"momentum"``: learning-rate schedulers that cycle momentum
(:class:`~torch.optim.lr_scheduler.OneCycleLR`, :class:`~torch.optim.lr_scheduler.CyclicLR`)
write any ``"momentum"`` key they find, which would silently turn the averaging on. Without the
key they refuse ``cycle_momentum=True`` with their own error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Union

from .engines.selection import ENGINE_ALIASES, ENGINES, engine_name
from .solve.direct import DEFAULT_DIRECT_MAX_PARAMS, SOLVERS
from .solve.quadratic import STEP_RULES

__all__ = [
    "ARGUMENT_NAMES",
    "DAMPING_SCHEDULES",
    "DAMPING_UPDATES",
    "KEYS",
    "KEY_OF",
    "OPTION_ARGUMENTS",
    "SETUP_KEYS",
    "PAPER_OPTIONS",
    "PRECONDITIONERS",
    "Options",
    "Setup",
    "check_arguments",
    "check_loaded_state",
    "check_options",
]


@dataclass(frozen=True)
class Options:
    """SGN's options as one step reads them: the keys of its parameter group besides
    ``"params"`` (:data:`KEYS`). ``Options()`` holds the defaults, which :class:`~torch_sgn.SGN`'s
    signature repeats (``tests/test_options.py`` ties the two together); their meaning is
    :class:`~torch_sgn.SGN`'s argument of the same name (``gradient_averaging``: its
    ``momentum``, :data:`ARGUMENT_NAMES`). A step reads them once, checked, by :meth:`of`;
    :meth:`replace` makes checked variants (:func:`torch_sgn.least_squares` builds its options
    so)."""

    lr: float = 1.0
    damping: float = 1e-4
    damping_min: Optional[float] = None
    cg_iters: int = 10
    cg_tol: Optional[float] = None
    cg_rtol: float = 0.0
    cg_progress_tol: float = 0.0
    attempts: int = 1
    damping_update: str = "threshold"
    line_search: bool = True
    trust_region: bool = True
    gradient_averaging: float = 0.0
    warmup_cg_iters: Optional[int] = None
    warmup_steps: int = 10
    damping_schedule: str = "constant"
    damping_decay_steps: int = 10
    preconditioner: Union[bool, str] = False
    preconditioner_exponent: float = 1.0
    preconditioner_rank: int = 100
    preconditioner_every: int = 10
    warm_start: float = 0.0
    ls_c: float = 1e-4
    ls_shrink: float = 0.5
    ls_max_evals: int = 10
    keep_grad: bool = False
    geodesic_acceleration: Union[None, bool, str] = None
    reject_uphill: bool = True
    weight_decay: float = 0.0
    step_rule: str = "lr"

    @classmethod
    def of(cls, group: Mapping, in_step: bool = False) -> Options:
        """The options of ``group`` (a parameter group, or any mapping of :data:`KEYS`),
        checked (:func:`check_options`; ``in_step``: read at a step, after a user or a
        scheduler may have changed them)."""
        check_options(group, in_step)
        return cls(**{key: group[key] for key in KEYS})

    def replace(self, **changes: object) -> Options:
        """A copy with ``changes``, named as :class:`~torch_sgn.SGN`'s arguments
        (``momentum`` for ``gradient_averaging``), checked as SGN checks its arguments.

        Raises:
            TypeError: a name that is not one of these options.
            ValueError: an invalid value (the message names it and its valid range).
        """
        unknown = sorted(set(changes) - set(OPTION_ARGUMENTS))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}: SGN's options are {OPTION_ARGUMENTS}")
        group = {key: getattr(self, key) for key in KEYS}
        group.update({KEY_OF.get(name, name): value for name, value in changes.items()})
        return Options.of(group)

    def group(self) -> dict:
        """The options as the keys of SGN's parameter group."""
        return {key: getattr(self, key) for key in KEYS}


#: SGN's options, the keys of its parameter group besides ``"params"``.
KEYS = tuple(f.name for f in fields(Options))


@dataclass(frozen=True)
class Setup:
    """SGN's settings fixed at construction, not kept in ``param_groups`` (see
    :class:`~torch_sgn.SGN`'s arguments of the same names); ``Setup()`` holds their defaults,
    :meth:`of` and :meth:`replace` check them."""

    engine: str = "auto"  # its canonical name (engine_name)
    cuda_graphs: bool = False
    compile: bool = False
    curvature_fraction: float = 1.0
    solver: str = "auto"
    direct_max_params: int = DEFAULT_DIRECT_MAX_PARAMS

    @classmethod
    def of(
        cls,
        engine: str,
        cuda_graphs: bool,
        compile: bool,
        curvature_fraction: float,
        solver: str,
        direct_max_params: int,
    ) -> Setup:
        """The settings, checked (:func:`check_arguments`), the engine's alias resolved."""
        check_arguments(engine, compile, cuda_graphs, curvature_fraction, solver, direct_max_params)
        return cls(
            engine_name(engine), cuda_graphs, compile, curvature_fraction, solver,
            direct_max_params,
        )  # fmt: skip

    def replace(self, **changes: object) -> Setup:
        """A copy with ``changes`` (:data:`SETUP_KEYS`), checked.

        Raises:
            TypeError: a name that is not one of these settings.
            ValueError: an invalid value.
        """
        unknown = sorted(set(changes) - set(SETUP_KEYS))
        if unknown:
            raise TypeError(f"unknown setting(s) {unknown}: SGN's settings are {SETUP_KEYS}")
        values = {key: getattr(self, key) for key in SETUP_KEYS}
        values.update(changes)
        return Setup.of(**values)


#: SGN's settings fixed at construction (:class:`Setup`).
SETUP_KEYS = tuple(f.name for f in fields(Setup))

#: The values of ``preconditioner``: none, the paper's diagonal, a randomized Nystrom one.
PRECONDITIONERS = (False, True, "diagonal", "nystrom")
#: The values of ``damping_schedule`` (:func:`~torch_sgn.solve.step.scheduled_damping`).
DAMPING_SCHEDULES = ("constant", "linear", "cosine")
#: The values of ``damping_update``, the rules that adapt the damping from the trust-region
#: ratio: ``"nielsen"`` (:func:`~torch_sgn.solve.step.nielsen_update`) and ``"threshold"``
#: (:func:`~torch_sgn.solve.step.trust_region_update`, the paper's).
DAMPING_UPDATES = ("nielsen", "threshold")

#: The constructor's argument for each group key named otherwise.
ARGUMENT_NAMES = {"gradient_averaging": "momentum"}
#: The group key of each constructor argument named otherwise.
KEY_OF = {name: key for key, name in ARGUMENT_NAMES.items()}
#: SGN's options by the names of its arguments, in :data:`KEYS`'s order.
OPTION_ARGUMENTS = tuple(ARGUMENT_NAMES.get(key, key) for key in KEYS)

#: The paper's configuration (Gargiani et al., 2020, Section 4, with the original
#: implementation's settings of its runs): the arguments :meth:`SGN.paper` passes, and the one
#: place the benchmark runner's paper presets read them from.
PAPER_OPTIONS: Mapping[str, object] = MappingProxyType(
    dict(
        lr=1.0,
        damping=1e-4,
        damping_min=1e-6,
        solver="cg",
        cg_iters=10,
        cg_tol=1e-6,
        cg_rtol=0.0,
        cg_progress_tol=0.0,
        attempts=1,
        damping_update="threshold",
        line_search=True,
        trust_region=True,
        momentum=0.0,
        warmup_cg_iters=10,
        warmup_steps=10,
        damping_schedule="constant",
        damping_decay_steps=10,
        preconditioner=False,
        preconditioner_exponent=1.0,
        preconditioner_rank=100,
        preconditioner_every=10,
        warm_start=0.0,
        ls_c=1e-4,
        ls_shrink=0.5,
        ls_max_evals=10,
        geodesic_acceleration=False,
        reject_uphill=False,
        weight_decay=0.0,
        step_rule="lr",
        curvature_fraction=1.0,
    )
)


def check_options(group: Mapping, in_step: bool = False) -> None:
    """Raises ``ValueError`` naming the first invalid option of ``group`` and its valid range.

    ``in_step``: the values come from ``param_groups`` at a step, where the message names the
    group key and says that the step was not taken.
    """

    def need(ok: Callable[[object], bool], key: str, what: str) -> None:
        value = group[key]
        try:
            valid = bool(ok(value))
        except TypeError:  # a value of the wrong type: None, a string, ...
            valid = False
        if not valid:
            if in_step:
                raise ValueError(
                    f"invalid param_groups[0][{key!r}]={value!r}: {what}. It was changed after "
                    "SGN was built; set a valid value (the step was not taken)"
                )
            raise ValueError(f"invalid {ARGUMENT_NAMES.get(key, key)}={value!r}: {what}")

    g = group
    need(lambda v: _finite(v) and v > 0, "lr", "must be > 0 and finite")
    need(lambda v: _finite(v) and v > 0, "damping", "must be > 0 and finite")
    need(
        lambda v: v is None or 0 <= v <= g["damping"],
        "damping_min",
        "must be None (the solver's floor) or in [0, damping]",
    )
    need(lambda v: _is_int(v) and v >= 1, "cg_iters", "must be an int >= 1")
    need(lambda v: v is None or (_finite(v) and v >= 0), "cg_tol", "must be None or >= 0, finite")
    need(lambda v: _finite(v) and 0 <= v < 1, "cg_rtol", "must be in [0, 1)")
    need(lambda v: _finite(v) and 0 <= v < 1, "cg_progress_tol", "must be in [0, 1)")
    need(lambda v: _is_int(v) and v >= 1, "attempts", "must be an int >= 1")
    need(lambda v: v in DAMPING_UPDATES, "damping_update", f"must be one of {DAMPING_UPDATES}")
    need(
        lambda v: not (g["damping_update"] == "nielsen" and v is not None and not v > 0),
        "damping_min",
        "must be > 0 with damping_update='nielsen' (a zero damping could not grow again)",
    )
    need(lambda v: 0 <= v < 1, "gradient_averaging", "must be in [0, 1)")
    need(
        lambda v: v is None or (_is_int(v) and v >= 1),
        "warmup_cg_iters",
        "must be None or an int >= 1",
    )
    need(lambda v: _is_int(v) and v >= 0, "warmup_steps", "must be an int >= 0")
    need(
        lambda v: v in DAMPING_SCHEDULES,
        "damping_schedule",
        f"must be one of {DAMPING_SCHEDULES}",
    )
    need(
        lambda v: not (g["trust_region"] and v != "constant"),
        "damping_schedule",
        "needs trust_region=False (the trust region adapts the damping)",
    )
    need(lambda v: _is_int(v) and v >= 1, "damping_decay_steps", "must be an int >= 1")
    need(
        lambda v: any(v is p or (isinstance(p, str) and v == p) for p in PRECONDITIONERS),
        "preconditioner",
        "must be False, True or 'diagonal' (the paper's diagonal) or 'nystrom'",
    )
    need(lambda v: _finite(v) and v > 0, "preconditioner_exponent", "must be > 0 and finite")
    need(lambda v: _is_int(v) and v >= 1, "preconditioner_rank", "must be an int >= 1")
    need(lambda v: _is_int(v) and v >= 1, "preconditioner_every", "must be an int >= 1")
    need(lambda v: 0 <= v <= 1, "warm_start", "must be in [0, 1]")
    need(lambda v: 0 < v < 1, "ls_c", "must be in (0, 1)")
    need(lambda v: 0 < v < 1, "ls_shrink", "must be in (0, 1)")
    need(lambda v: _is_int(v) and v >= 1, "ls_max_evals", "must be an int >= 1")
    need(
        lambda v: v is None or isinstance(v, bool) or v == "strict",
        "geodesic_acceleration",
        "must be None (on for float64 models), True, False or 'strict'",
    )
    need(lambda v: isinstance(v, bool), "reject_uphill", "must be True or False")
    need(lambda v: _finite(v) and v >= 0, "weight_decay", "must be >= 0 and finite (0: off)")
    need(lambda v: v in STEP_RULES, "step_rule", f"must be one of {STEP_RULES}")


def check_loaded_state(state_dict: Mapping) -> None:
    """``state_dict`` checked as SGN's before :meth:`torch.optim.Optimizer.load_state_dict`.

    Raises ``ValueError`` for another optimizer's ``state_dict``, one lacking an SGN option
    (none is filled in with a default) or one whose values SGN refuses, at load time rather
    than at the next step.
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(groups, (list, tuple)) or len(groups) != 1:
        count = len(groups) if isinstance(groups, (list, tuple)) else "no"
        raise ValueError(
            f"this is not an SGN state_dict: it has {count} parameter groups where SGN has one; "
            "load it into the optimizer that saved it"
        )
    group = groups[0]
    missing = sorted(set(KEYS) - set(group))
    if missing:
        # torch adds options of its own to every group (differentiable, foreach, ...)
        foreign = sorted(set(group) - set(KEYS) - {"params"} - _TORCH_KEYS)
        raise ValueError(
            f"this is not a whole SGN state_dict: its parameter group lacks SGN's option(s) "
            f"{missing}"
            + (f" and has options SGN does not know, {foreign}" if foreign else "")
            + ": it was saved by another optimizer or edited; load it into the optimizer that "
            "saved it, or start SGN afresh (load only the model's state_dict)"
        )
    first = state_dict.get("state", {}).get(group["params"][0] if group["params"] else 0, {})
    if not {"step", "damping"} <= set(first):
        raise ValueError(
            "this is not an SGN state_dict: the state of the first parameter lacks SGN's "
            f"'step' and 'damping' (it has {sorted(first)}); load it into the optimizer that "
            "saved it"
        )
    check_options(group)


def check_arguments(
    engine: str,
    compile: bool,
    cuda_graphs: bool,
    curvature_fraction: float,
    solver: str,
    direct_max_params: int,
) -> None:
    """Raises ``ValueError`` naming the first invalid argument of :class:`~torch_sgn.SGN` that
    is not kept in ``param_groups`` (the engine, its compilation and capture, the curvature
    subset, the solver)."""
    _check(
        engine in ENGINES or engine in ENGINE_ALIASES,
        "engine",
        engine,
        f"must be one of {ENGINES}",
    )
    engine = engine_name(engine)
    _check(
        not compile or engine in ("traced", "auto"),
        "compile",
        compile,
        "needs engine='traced' or 'auto' (only the traced engine runs compiled graphs)",
    )
    _check(
        not (compile and cuda_graphs),
        "compile",
        compile,
        "cannot be combined with cuda_graphs=True: on a GPU, cuda_graphs=True alone "
        "removes the kernel launches that dominate small models' steps",
    )
    _check(
        not (cuda_graphs and engine == "functional"),
        "cuda_graphs",
        cuda_graphs,
        "needs engine='layerwise', 'traced' or 'auto' (the functional engine captures no CUDA "
        "graphs)",
    )
    _check(
        0 < curvature_fraction <= 1,
        "curvature_fraction",
        curvature_fraction,
        "must be in (0, 1]",
    )

    _check(solver in SOLVERS, "solver", solver, f"must be one of {SOLVERS}")
    _check(
        type(direct_max_params) is int and direct_max_params >= 0,
        "direct_max_params",
        direct_max_params,
        "must be an int >= 0",
    )


def _check(ok: bool, name: str, value: object, what: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: {what}")


_TORCH_KEYS = {"differentiable", "foreach", "maximize", "capturable", "fused"}


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
