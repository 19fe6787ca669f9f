"""When ``solver="auto"`` turns from the paper's CG steps to exact (direct) steps.

Exact Gauss-Newton steps fit a precise target orders of magnitude sooner than the paper's few CG
iterations, whose inexact steps stall (``docs/SOLVERS.md``). Early in training on a noisy
mini-batch, though, the truncated CG step is the better step: it moves along the few directions
of largest curvature, where an exact step with a small damping also fits the batch's noise and
the directions the data barely determine (Boston's 101-sample batches for 11,601 parameters, the
sine fit's plateau). So ``"auto"`` starts with CG and switches for good to exact steps when
either test says they do better (a run that fits one batch, where there is no noise to fit,
takes exact steps at once):

- **probe**: every :data:`PROBE_EVERY` steps (from the first) the step's exact solution is
  computed as well (its own damping attempts and line search on the batch), and the point it
  reaches is kept as a candidate. The next step evaluates the candidate on its own batch, which
  neither step was fitted to, and compares it with the loss at the point the CG step reached:
  the exact step wins when its loss is lower by at least the share :data:`MARGIN`, and that
  step already runs exact.
- **stall**: the mean batch loss of the last :data:`WINDOW` steps falls by less than the share
  :data:`STALL` below that of the :data:`WINDOW` steps before (CG's plateau).

A run that fits one batch with a model whose ``forward`` differentiates its own output by
``torch.autograd.grad`` (a physics-informed network written the usual way), where no engine forms
the Jacobian cheaply, keeps CG, but CG solved further (:func:`cg_settings`): at least
:data:`ONE_BATCH_CG_ITERS` iterations, to the relative residual :data:`ONE_BATCH_CG_RTOL`, with
the Nystrom preconditioner on float64 parameters. Ten iterations on a fixed batch leave most of
each step's progress unmade (``benchmarks/pinns/pinn_autograd.py``); SGN says once
(:data:`NESTED_NOTICE`) that the same problem written with :mod:`torch_sgn.pinn` takes exact
steps.

The state is its own part of the optimizer's :class:`~torch_sgn.solve.state.StepState`
(:class:`~torch_sgn.solve.state.AutoState`), advanced here (:func:`advance`) and saved with the
optimizer's state dict, so a resumed run takes the same steps. A data-parallel group decides
alike on every rank: the losses compared are reduced.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

from .descents import CG
from .stall import StallTest
from .state import AutoState

if TYPE_CHECKING:
    from ..options import Options

__all__ = [
    "CG_TOL", "MARGIN", "NESTED_NOTICE", "ONE_BATCH_CG_ITERS", "ONE_BATCH_CG_RTOL",
    "PROBE_EVERY", "STALL", "STALL_TEST", "WINDOW", "BatchMemory", "CGSettings", "Phase", "advance",
    "cg_settings", "plan",
]  # fmt: skip

#: Steps from one probe to the next (the first step probes).
PROBE_EVERY = 10
#: The share by which the exact candidate's loss must be below CG's for the switch.
MARGIN = 0.01
#: Steps in each of the stall test's two windows.
WINDOW = 20
#: The relative fall of the windows' mean loss above which it is not a stall.
STALL = 0.1

#: CG's iterations at least, and its relative residual, on a run of one batch whose forward
#: differentiates itself (:func:`cg_settings`).
ONE_BATCH_CG_ITERS = 100
ONE_BATCH_CG_RTOL = 1e-3
#: What SGN says once where it takes such CG steps (figures from
#: ``benchmarks/pinns/pinn_autograd.py``'s record, quoted in ``docs/PINN.md``).
NESTED_NOTICE = (
    "this model's forward differentiates its output by torch.autograd.grad: SGN steps by "
    "preconditioned conjugate gradient through the nested graph. Written with torch_sgn.pinn "
    "(Residuals and its operators: laplacian, gradient, hessian, derivative), the same problem "
    "takes exact Gauss-Newton steps: on a nonlinear Poisson problem each cost 1/7 of these, and "
    "in the same 40 CPU seconds its error ended 12,000 times lower "
    "(docs/PINN.md#autograd-in-forward)"
)
#: CG's absolute tolerance where ``cg_tol=None`` (the default) on float32 parameters: the
#: original's and the paper's ``CG_TOL``, near the rounding of a float32 loss's gradient.
CG_TOL = 1e-6


@dataclass(frozen=True)
class Phase:
    """What one step of ``solver="auto"`` does.

    ``route``: the route it takes (:data:`~torch_sgn.solve.descents.ROUTES`); ``probe``: the exact
    route solved besides, whose point is the next step's candidate (``None``: no probe);
    ``verdict``: whether the last probe's candidate won on this step's batch (``None``: none was
    judged); ``one_batch``: a CG step of a run that fits one batch with a forward that
    differentiates itself (:func:`cg_settings`).
    """

    route: str
    probe: Optional[str] = None
    verdict: Optional[bool] = None
    one_batch: bool = False


@dataclass(frozen=True)
class CGSettings:
    """A CG step's iterations, absolute and relative tolerances and preconditioner (the values
    of ``SGN``'s ``cg_iters``, ``cg_tol``, ``cg_rtol`` and ``preconditioner``)."""

    iters: int
    tol: float
    rtol: float
    preconditioner: object


def cg_settings(options: Options, step: int, one_batch: bool, dtype: torch.dtype) -> CGSettings:
    """The settings of a CG step ``step`` from SGN's ``options``: ``warmup_cg_iters``
    during the first ``warmup_steps``; ``cg_tol=None``: :data:`CG_TOL` for parameters of
    ``dtype`` float32 or narrower, off (0) for float64; on a run of one batch without an exact route
    (``solver="auto"``, :attr:`Phase.one_batch`) at least :data:`ONE_BATCH_CG_ITERS` iterations,
    the relative tolerance :data:`ONE_BATCH_CG_RTOL` where none is set, and the Nystrom
    preconditioner where none is set."""
    iters = options.cg_iters
    if options.warmup_cg_iters is not None and step < options.warmup_steps:
        iters = options.warmup_cg_iters
    tol = options.cg_tol
    if tol is None:
        tol = CG_TOL if torch.finfo(dtype).bits <= 32 else 0.0
    settings = CGSettings(iters, tol, options.cg_rtol, options.preconditioner)
    if not one_batch:
        return settings
    return CGSettings(
        max(iters, ONE_BATCH_CG_ITERS),
        settings.tol,
        settings.rtol or ONE_BATCH_CG_RTOL,
        settings.preconditioner or ("nystrom" if dtype == torch.float64 else False),
    )


def exact_wins(exact_loss: float, cg_loss: float) -> bool:
    """Whether the exact candidate's loss is below CG's by the share :data:`MARGIN`."""
    return exact_loss < cg_loss - MARGIN * abs(cg_loss)


#: The stall test of the CG steps' batch losses.
STALL_TEST = StallTest(WINDOW, STALL)


def stalled(losses: list) -> bool:
    """Whether the last :data:`WINDOW` losses' mean fell by less than :data:`STALL` (as a share)
    below the mean of the :data:`WINDOW` before (:data:`STALL_TEST`); ``False`` until both
    windows are full."""
    return STALL_TEST.stalled(losses)


def plan(
    state: AutoState,
    t: int,
    route: str,
    loss0: float,
    loss_at: Callable[[Tensor], float],
    one_batch: bool = False,
    nested: bool = False,
) -> Phase:
    """The phase of step ``t``. ``route``: the exact route the step could take (``"cg"`` where
    only CG can run); ``loss0``: the batch loss at the current point; ``loss_at``: the batch loss
    at a point (the candidate's); ``one_batch``: the run fits one batch (a full-batch fit, a
    least-squares problem), where no noise argues for CG: exact steps at once; ``nested``: the
    model's forward differentiates itself (CG steps of one batch then solve further)."""
    if route == CG or state.exact or one_batch:
        return Phase(route, one_batch=one_batch and nested and route == CG)
    if state.candidate is not None:
        verdict = exact_wins(loss_at(state.candidate), loss0)
        return Phase(route if verdict else CG, verdict=verdict)
    next_probe = 0 if state.next_probe is None else state.next_probe
    return Phase(CG, probe=route if t >= next_probe else None)


def advance(
    state: AutoState, t: int, phase: Phase, loss0: float, candidate: Optional[Tensor]
) -> tuple[AutoState, Optional[str]]:
    """The state after the committed step ``t`` of ``solver="auto"`` whose exact route existed
    (``phase`` from :func:`plan`, ``candidate`` the probe's point, ``None`` where its exact step
    did not move), and the reason of a switch made here (``"probe"``, ``"stall"``) or
    ``None``."""
    if state.exact:
        return state, None
    reason = None
    if phase.verdict is not None:
        state = replace(state, candidate=None)
        reason = "probe" if phase.verdict else None
    elif phase.probe is not None:
        state = replace(state, next_probe=t + PROBE_EVERY)
        if candidate is not None:
            state = replace(state, candidate=candidate)
    recent = STALL_TEST.kept(state.recent, loss0)
    state = replace(state, recent=recent)
    if reason is None and stalled(recent):
        reason = "stall"
    if reason is not None:
        state = AutoState(exact=True)
    return state, reason


class BatchMemory:
    """Whether a step's inputs are the previous step's tensors, unchanged: the same objects
    (weak references: a new batch in the freed memory of the last one is another batch), not
    written in place since: a full-batch fit rather than a stream of mini-batches."""

    def __init__(self) -> None:
        self._last: tuple = ()

    def repeated(self, args: tuple) -> bool:
        last = self._last
        same = len(last) == len(args) and all(
            ref() is x and version == x._version for (ref, version), x in zip(last, args)
        )
        self._last = tuple((weakref.ref(x), x._version) for x in args)
        return same
