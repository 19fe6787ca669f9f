"""Choosing the curvature engine, and the curvature mini-batch.

:func:`select_engine` returns the :class:`~torch_sgn.linearization.Engine` for the ``engine``
argument of :class:`~torch_sgn.SGN` and :class:`~torch_sgn.GGN`: ``"layerwise"`` (the layer-wise
engine of :mod:`torch_sgn.engines.layerwise.engine`; raises where it cannot apply), ``"traced"``
(the traced
engine of :mod:`torch_sgn.engines.traced.engine`, any model ``torch.fx`` can trace; raises where it
cannot),
``"functional"`` (:mod:`torch_sgn.model.flat_model`, any model) or ``"auto"``: the layer-wise engine
where it applies (the fastest on the chains it knows), else the traced engine, else the
functional engine with the reason in a one-time warning. The fallbacks are this module's: an
engine that does not apply raises :class:`~torch_sgn.engines.not_applicable.NotApplicable` and
:class:`EngineChain` calls the next one. A residual problem
(:class:`~torch_sgn.residual_problem.ResidualProblem`) gets its rows engine
(:class:`~torch_sgn.engines.functional.RowsEngine`) first: under ``"auto"`` with exact steps its
products are the functional engine's (one recorded pass; ``G v`` comes from the rows, nothing
is traced); steps by CG alone (``solver="cg"``, a data-parallel group, CUDA graphs) take
their ``G v`` products from the chain above, which replays them faster than forward mode
re-runs the problem. :func:`curvature_subset` wraps an engine to take ``G v``
on a random subset of the batch.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..diagnostics import WarnOnce, warn
from ..linearization import Batch, Engine, Linearization
from ..losses import OutputLoss
from ..model.flat_model import FunctionalModel
from .functional import FunctionalEngine, RowsEngine
from .layerwise.engine import LayerwiseEngine
from .not_applicable import NotApplicable
from .traced.engine import TracedEngine

__all__ = ["ENGINES", "EngineChain", "curvature_subset", "engine_name", "select_engine"]

ENGINES = ("auto", "layerwise", "traced", "functional")

#: Former names, accepted with a ``FutureWarning`` for one release.
ENGINE_ALIASES = {"fast": "layerwise"}


def engine_name(engine: str) -> str:
    """``engine`` checked against :data:`ENGINES`, a former name replaced by its current one."""
    if engine in ENGINE_ALIASES:
        new = ENGINE_ALIASES[engine]
        warnings.warn(
            f"engine={engine!r} is now called engine={new!r}; the old name will be removed in "
            "the next release",
            FutureWarning,
            stacklevel=3,
        )
        return new
    if engine not in ENGINES:
        raise ValueError(f"invalid engine={engine!r}: must be one of {ENGINES}")
    return engine


def select_engine(
    fmodel: FunctionalModel,
    loss: OutputLoss,
    engine: str,
    cuda_graphs: bool = False,
    compile: bool = False,
    exact: bool = True,
) -> Engine:
    """The engine for ``engine`` (one of :data:`ENGINES`); with ``cuda_graphs`` the layer-wise and
    the traced engines capture their work as CUDA graphs where they can (see
    :mod:`torch_sgn.engines.cuda_graphs` and
    :class:`~torch_sgn.engines.traced.engine.TracedEngine`), with ``compile``
    the traced engine runs its graphs compiled by ``torch.compile``. A residual problem's
    engine is its :class:`~torch_sgn.engines.functional.RowsEngine`, forming the rows where
    ``exact`` (:func:`torch_sgn.route_plan.forms_rows`: the steps may be exact)."""
    engine = engine_name(engine)
    if fmodel.problem is None:
        return _engine(fmodel, loss, engine, cuda_graphs, compile)
    if engine == "auto" and exact and not compile:  # G v from the rows: nothing to trace
        products: Engine = FunctionalEngine(fmodel, loss)
    else:
        products = _engine(fmodel, loss, engine, cuda_graphs, compile)
    return RowsEngine(fmodel, loss, products, exact)


def _engine(
    fmodel: FunctionalModel, loss: OutputLoss, engine: str, cuda_graphs: bool, compile: bool
) -> Engine:
    """The engine (or chain) for ``engine`` on any model."""
    functional = FunctionalEngine(fmodel, loss)
    if engine == "functional":  # SGN refuses cuda_graphs with it
        return functional
    if engine == "layerwise":  # SGN refuses compile with it; strict: it never declines
        return LayerwiseEngine(fmodel, loss, strict=True, cuda_graphs=cuda_graphs)
    strict = engine == "traced"  # (an attribute that keeps changing declines it all the same)
    traced = TracedEngine(fmodel, loss, strict=strict, cuda_graphs=cuda_graphs, compile=compile)
    if strict:
        return EngineChain([traced, functional], cuda_graphs)
    layerwise = LayerwiseEngine(fmodel, loss, strict=False, cuda_graphs=cuda_graphs)
    if compile and layerwise.planned:
        warn(
            "compile=True applies to the traced engine; this model is a chain that the "
            "layer-wise engine runs by hand, uncompiled"
        )
    return EngineChain([layerwise, traced, functional], cuda_graphs)


class EngineChain:
    """An :class:`~torch_sgn.linearization.Engine` that calls ``engines`` in turn until one
    applies (the others raise :class:`~torch_sgn.engines.not_applicable.NotApplicable`); the
    last, the functional engine, applies to every model.

    Where the last takes over, the reason of the engine before it is warned once (each reason
    once), after the functional engine has linearized: where the batch is bad (targets of the
    wrong shape) its error is the one to read. An engine that hands over to another engine
    than the last is silent: that one reports its own choices.
    """

    def __init__(self, engines: Sequence[Engine], cuda_graphs: bool = False):
        self.engines, self.cuda_graphs = list(engines), cuda_graphs
        self._warn = WarnOnce()

    @property
    def may_solve_through_outputs(self) -> bool:
        """The first engine's (see :class:`~torch_sgn.engines.layerwise.engine.LayerwiseEngine`)."""
        return getattr(self.engines[0], "may_solve_through_outputs", False)

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        *first, last = self.engines
        for engine in first:
            try:
                return engine(flat, batch, buffers_out)
            except NotApplicable as error:
                why = error
        lin = last(flat, batch, buffers_out)
        self._warn(
            f"{why}; using the functional engine, which re-runs the forward pass at every G v "
            "product"
        )
        if self.cuda_graphs:
            self._warn(
                "cuda_graphs=True does not apply (the functional engine captures no CUDA "
                "graphs); running eagerly"
            )
        return lin


def curvature_subset(engine: Engine, loss: OutputLoss, fraction: float, seed: int = 0) -> Engine:
    """Loss and gradient on the whole batch, ``G v`` on a random ``fraction`` of it.

    The subset is drawn from a private generator seeded with ``seed`` (the global random
    state is not touched); :class:`~torch_sgn.SGN` passes the step number. ``G`` is scaled
    to estimate the whole batch's: with ``reduction="mean"`` the subset's mean already does;
    with ``"sum"`` it is multiplied by ``N / m``.
    """
    generator = torch.Generator().manual_seed(seed)

    def subset_engine(
        flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        full = engine(flat, batch, buffers_out)
        n = len(batch)
        m = max(1, int(round(fraction * n)))
        if m >= n:
            return full
        idx = torch.randperm(n, generator=generator)[:m].sort().values
        sub = engine(flat, batch.subset(idx.to(batch.args[0].device)))
        scale = n / m if loss.reduction == "sum" else 1.0
        if scale == 1.0:
            return replace(full, ggn_vp=sub.ggn_vp, dense_ggn=sub.ggn_matrix, sample_space=None)
        return replace(
            full,
            ggn_vp=lambda v: sub.ggn_vp(v) * scale,
            dense_ggn=lambda: sub.ggn_matrix() * scale,
            sample_space=None,  # G from other samples than the gradient
        )

    return subset_engine
