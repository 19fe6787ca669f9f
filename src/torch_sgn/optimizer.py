"""The SGN optimizer: one damped Gauss-Newton step per mini-batch."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch
from torch import Tensor, nn

from .diagnostics import warn
from .distributed import ProcessGroup, SingleProcess, communicator
from .engines.jacobian import per_sample, with_jacobian
from .engines.selection import (
    ENGINE_ALIASES,
    ENGINES,
    curvature_subset,
    engine_name,
    select_engine,
)
from .linearization import Batch, Inputs, Linearization, check_loss_parameters
from .losses import LossSpec, OutputLoss, resolve_loss
from .model.flat_model import FunctionalModel
from .options import KEYS, check_loaded_state, check_options
from .solve import auto, direct, geodesic
from .solve.cg import CGResult, conjugate_gradient
from .solve.damping import (
    CG_DAMPING_MIN,
    DIRECT_DAMPING_MIN,
    GROWTH_START,
    nielsen_update,
    rejected_update,
    scheduled_damping,
    trust_region_update,
)
from .solve.direct import DirectResult
from .solve.line_search import LineSearchResult, backtracking
from .step_call import batch_of_call

__all__ = ["SGN", "StepInfo"]

logger = logging.getLogger("torch_sgn")

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
        warm_start=0.0,
        ls_c=1e-4,
        ls_shrink=0.5,
        ls_max_evals=10,
        geodesic_acceleration=False,
        curvature_fraction=1.0,
    )
)


@dataclass(frozen=True)
class StepInfo:
    """What one :meth:`SGN.step` did.

    Attributes:
        loss: mini-batch loss before the step.
        loss_after: mini-batch loss at the accepted point (same batch).
        grad_norm: 2-norm of the mini-batch gradient.
        cg_iters: conjugate-gradient iterations run.
        cg_residual: 2-norm of the final CG residual ``(G + damping I) d + m_hat``.
        cg_stop: why CG stopped (see :class:`~torch_sgn.solve.cg.CGResult`).
        damping: the damping ``rho`` used in this step.
        next_damping: the damping the next step will use.
        step_size: the step length taken along the CG direction, ``lr * a`` with ``a`` the
            line-search factor (0 when no step was taken).
        tr_ratio: actual over predicted reduction at the full step (``None`` when the trust
            region is off).
        predicted_change: the damped quadratic model's change at the full step.
        loss_evals: loss evaluations at trial points (trust-region test and line search).
        line_search_ok: whether the Armijo condition held (``True`` when line search is off).
        attempts: how many times the step's system was solved: a solution that fails the
            Armijo test at its full step is solved again with a larger damping, up to
            ``SGN(attempts=...)`` times (Levenberg-Marquardt). ``damping``, ``cg_*``,
            ``tr_ratio`` and ``predicted_change`` describe the last attempt.
        solver: ``"cg"`` or ``"direct"``, the solver that ran (see ``SGN(solver=...)``). For
            the direct solver ``cg_iters`` is 0, ``cg_residual`` the residual of the system it
            solved, and ``cg_stop`` how it solved it: ``"cholesky"``; ``"eigh"`` where
            Cholesky failed in floating point (the eigenvalues of ``G`` clipped to ``>= 0``);
            ``"scaled_gradient"`` where that failed too; ``"lu"`` (or ``"pinv"`` where that
            failed) for the non-symmetric system through the batch's outputs of a loss whose
            output-space Hessian is not a multiple of the identity; ``"non_finite"`` (no step).
        accelerated: whether the step carried a geodesic acceleration (see
            ``SGN(geodesic_acceleration=...)``); ``step_size`` is then the factor along the
            parabola ``s d + s^2 a / 2``.
    """

    loss: float
    loss_after: float
    grad_norm: float
    cg_iters: int
    cg_residual: float
    cg_stop: str
    damping: float
    next_damping: float
    step_size: float
    tr_ratio: Optional[float]
    predicted_change: float
    loss_evals: int
    line_search_ok: bool
    attempts: int = 1
    solver: str = "cg"
    accelerated: bool = False


class SGN(torch.optim.Optimizer):
    r"""Stochastic Generalized Gauss-Newton (SGN), a Hessian-free second-order optimizer.

    Each :meth:`step` takes one mini-batch ``(inputs, targets)`` and solves the damped
    Gauss-Newton system by a few conjugate-gradient (CG) iterations,

    .. math::
        (G + \rho I)\, d = -\hat m,\qquad
        G = J^\top H J,\qquad
        \theta \leftarrow \theta + a\,\alpha\, d,

    where ``J`` is the Jacobian of the network's output, ``H`` the Hessian of the loss in output
    space, :math:`\hat m` the (bias-corrected, optionally averaged) gradient, :math:`\alpha`
    the step size ``lr`` and ``a`` the backtracking factor. A trust-region rule adapts
    :math:`\rho` from the ratio of the actual to the predicted reduction.

    Args:
        model: any ``nn.Module`` whose forward returns one tensor. Its trainable parameters are
            optimized (one frozen later keeps its value); it is evaluated functionally with its
            buffers.
        loss: ``"mse"``, ``"cross_entropy"``, ``"bce_with_logits"``, the matching ``torch.nn``
            loss module (``reduction`` ``"mean"`` or ``"sum"``; ``label_smoothing``), or any
            callable ``loss(outputs, targets) -> scalar`` convex in ``outputs``, of the
            outputs alone (one that reads the model's parameters, a penalty inside the loss,
            raises ``ValueError`` at the first step). Required: a loss that does not fit the
            model must fail, not train silently.
        lr: step size :math:`\alpha` (the original's ``ALPHA``). Default 1, the natural step of
            a Newton-type method and the paper's value; kept in ``param_groups`` so
            ``torch.optim.lr_scheduler`` can change it.
        damping: initial Levenberg-Marquardt damping :math:`\rho` (``DAMP_RHO``). Default
            ``1e-4``, the paper's value for every benchmark (the original's default is 1e-3).
        damping_min: floor :math:`\rho_{\min}` for the trust-region rule and target of the
            decay schedules (``DAMP_RHO_MIN``). Default ``None``: the floor of the solver that
            runs the step, the paper's ``1e-6`` for CG (its inexact steps gain nothing from a
            smaller one) and ``1e-15`` for the direct solver, so that the damping never stops
            an exact fit short of the precision it can reach (``docs/SOLVERS.md``).
        cg_iters: CG iterations per step, :math:`k_{\max}` (``MAX_CG_ITERS``). Default 10, the
            original's default and the paper's best setting on CIFAR-10.
        cg_tol: CG stops early once the largest absolute residual entry is at most this
            (``CG_TOL``). Default ``1e-6``, as the original and the paper.
        cg_rtol: CG also stops once the residual's 2-norm is at most this fraction of the
            right-hand side's, a test that, unlike ``cg_tol``, does not depend on the scale of
            the loss. Default 0 (off), as the paper.
        cg_progress_tol: CG also stops when it stops making progress on the quadratic model:
            Martens's (2010) relative-progress rule with this epsilon (he used ``5e-4``; see
            :func:`~torch_sgn.solve.cg.conjugate_gradient`). It can fire only after 10 iterations,
            so
            it matters with a larger ``cg_iters``. Default 0 (off), as the paper.
        attempts: Levenberg-Marquardt re-solves: a step whose full step fails the Armijo test
            (the line search's first test, constant ``ls_c``) is solved again on the same batch
            and the same linearization with a larger damping (by ``damping_update``'s rule for
            a failure), up to this many solves in all; the line search, if on, then backtracks
            along the last one. Counted in :attr:`StepInfo.attempts`. Default 1 (the paper:
            one solve, then the line search).
        damping_update: how the trust region adapts the damping. ``"threshold"``: the paper's
            rule (:func:`~torch_sgn.solve.damping.trust_region_update`: times 3/2 below ratio 1/4,
            times 2/3 above 3/4). ``"nielsen"``: Nielsen's smooth rule
            (:func:`~torch_sgn.solve.damping.nielsen_update`: down to a third after a good step,
            with no band where it is stuck), and on a rejected attempt times 2, 4, 8, ...
            (:func:`~torch_sgn.solve.damping.rejected_update`); it needs ``damping_min > 0``.
            Default ``"threshold"``.
        line_search: backtracking Armijo line search on the same mini-batch (``LS``). Default on,
            as in the paper.
        trust_region: adapt the damping by the trust-region rule (``TR``). Default on, as in
            the paper.
        momentum: gradient averaging :math:`\beta` (``BETA``):
            :math:`m \leftarrow \beta m + (1-\beta) g`,
            :math:`\hat m = m / (1 - \beta^t)` is the CG right-hand side. Default 0 (plain
            gradient), as the original and the paper. Kept in ``param_groups`` under
            ``"gradient_averaging"``, not ``"momentum"``, so that schedulers which cycle momentum
            (``OneCycleLR``, ``CyclicLR``) do not turn it on: they ask for
            ``cycle_momentum=False``.
        warmup_cg_iters: CG iterations during the first ``warmup_steps`` steps
            (``MIN_CG_ITERS``); ``None`` uses ``cg_iters`` throughout. Default ``None``; the
            paper's runs used 10 for the first 10 steps (see the benchmark presets).
        warmup_steps: length of that warm-up (``K_CG``). Default 10.
        damping_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` decay of the damping to
            ``damping_min`` over ``damping_decay_steps`` steps (``RHO_DECAY``); only with
            ``trust_region=False``. Default ``"constant"``.
        damping_decay_steps: the schedule's length :math:`K`. Default 10, as the original.
        preconditioner: diagonal CG preconditioner
            :math:`M = (\hat m^2 + \rho)^{-\text{exponent}}` (``CG_PREC``). Default off.
        preconditioner_exponent: its exponent (``ALPHA_EXP``). Default 1.
        warm_start: start CG from this factor times the previous step's CG solution (Martens,
            2010); 0 starts from zero as the original does. Default 0.
        ls_c: Armijo constant (``C_LS``). Default ``1e-4`` (Nocedal & Wright).
        ls_shrink: backtracking factor (``RHO_LS``). Default 0.5.
        ls_max_evals: most loss evaluations in one line search (``MAX_LS_ITERS``). Default 10.
        keep_grad: write the mini-batch gradient into each parameter's ``.grad``. Default off:
            SGN leaves ``.grad`` untouched.
        geodesic_acceleration: add to each exact (direct) step its geodesic acceleration
            (Transtrum and Sethna, 2012; :mod:`torch_sgn.solve.geodesic`): the second-order term
            ``a / 2``, ``(G + rho I) a = -J^T H f_vv``, of the path along which the outputs
            keep their velocity, with ``f_vv`` the outputs' second difference along the step
            ``d`` (three forward passes) and the step's own factorization. Used only while
            ``2 |a| <= 0.75 |d|`` and above the outputs' rounding; the trust region and the
            line search judge ``d``. It keeps exact steps moving along the curved valleys of
            precise fits (``docs/SOLVERS.md``). Ignored by CG steps. Default ``None``: on for
            float64 models, where it reaches far lower losses far sooner, off in lower
            precision, where the outputs' rounding blurs ``f_vv`` near a precise fit and the
            fits measured ended slightly higher with it. :meth:`SGN.paper` turns it off.
        engine: how ``G v`` products are computed. ``"layerwise"``: the layer-wise engine of
            :mod:`torch_sgn.engines.layerwise.engine` for ``nn.Sequential`` chains of the layers
            listed by
            ``torch_sgn.engines.layerwise.rules.supported_layers()`` (one forward pass per step,
            about one
            gradient per product); raises if the model is not such a chain. ``"traced"``: the
            traced engine of :mod:`torch_sgn.engines.traced.engine` for any model ``torch.fx`` can
            trace
            (residual connections, normalization layers, attention, recurrent layers, custom
            ``forward`` methods): the product is traced once per input shape and split so that
            a CG iteration runs only its part that depends on ``v``; raises if the model cannot
            be traced. ``"functional"``: ``torch.func`` forward-mode AD, any model (re-runs the
            forward pass at every product). ``"auto"``: layer-wise where it applies, else traced,
            else functional with the reason in a one-time warning. Default ``"auto"``.
        cuda_graphs: capture the engine's set-up, ``G v`` product and trial-point loss as
            CUDA graphs, once per batch shape, and replay them every step (see
            :mod:`torch_sgn.engines.cuda_graphs`): for small models on a GPU, whose steps cost
            kernel
            launches more than arithmetic. The layer-wise engine captures CUDA models whose chain it
            runs by hand with a named loss (each layer's rule in
            :mod:`torch_sgn.engines.layerwise.rules`
            says whether it can be captured; ``docs/LAYERS.md`` has the table); the traced
            engine (``"traced"``, and ``"auto"`` for other models) captures CUDA models whose
            forward pass draws random numbers only for dropout (its masks are drawn before
            each replay, as eager steps draw them) and writes into no inputs, and into
            buffers only in training mode (batch normalization's running statistics, kept
            exact). Elsewhere the step runs eagerly after a one-time
            warning. Single process only; not with ``engine="functional"``. Default off. The
            direct solver forms ``G`` from the captured product, one replay per parameter.
        compile: run the traced engine's set-up and ``G v`` product compiled by
            ``torch.compile`` (``engine="traced"``, and ``"auto"`` for models that are not
            chains of known layers): each batch shape is compiled at its first step, which
            takes seconds to minutes, and its products then cost less (on a CPU, 1.0-1.2
            gradients instead of 1.2-1.4 on a ResNet, a transformer and an LSTM model; see
            ``docs/PERFORMANCE.md``). Dropout's masks are drawn as in eager passes (by
            PyTorch's operators, Inductor's ``fallback_random``). Not with ``cuda_graphs``; a
            compilation that fails warns once and the graphs run uncompiled. Default off.
        curvature_fraction: compute ``G v`` on a random subset of this fraction of each batch
            (drawn at step ``t`` from a generator seeded with ``t``), the loss and gradient on
            the whole batch (Martens, 2010). Default 1 (the whole batch, as the paper).
        process_group: the ranks that train this model data-parallel, each on its shard of
            every mini-batch (see :mod:`torch_sgn.distributed`). Default ``None``: the default
            group if ``torch.distributed`` is initialised, else one process. Parameters and
            buffers are broadcast from the group's rank 0 here.
        solver: how the damped system is solved. ``"cg"``: ``cg_iters`` conjugate-gradient
            iterations, as the paper. ``"direct"``: exactly, by forming the ``P x P`` matrix
            ``G`` (from the per-sample output Jacobian for chains of linear layers and
            activations, else from ``P`` products) and a Cholesky factorization of
            ``G + damping I`` (:math:`P^3/3` flops), both in float64 whatever the model's
            dtype; where Cholesky fails in floating point, the eigenvalues of ``G`` are clipped
            to ``>= 0``. On a chain of linear layers and
            activations whose batch has fewer outputs ``R`` (samples times outputs per sample)
            than the model has parameters, the same step is solved through the ``R x R``
            matrix ``J J^T`` instead (:func:`~torch_sgn.solve.direct.solve_in_sample_space`;
            without ``momentum``, single process). For small models, and for fits to high
            precision, where CG's inexact steps stall (see ``docs/SOLVERS.md``). A model whose
            matrices (``3 P^2`` float64 numbers) do not fit in the free memory of its device
            raises ``ValueError`` here, or, where its steps may go through the outputs (the
            layer-wise engine's chains, one process, no ``momentum``), at a step that cannot
            (nothing changes). ``"auto"`` (default): CG where the direct solver's matrix
            would have more than ``direct_max_params`` rows (``R`` through the outputs; ``P``
            where ``G`` comes from the per-sample Jacobian, or ``P <= cg_iters``); elsewhere
            CG's steps first, then exact steps for good once they prove better: every 10th
            step also computes the exact step, which wins if its point has a lower loss on the
            next batch, or the batch loss stalls (:mod:`torch_sgn.solve.auto`). Rules, not
            timings, so every machine takes the same steps. :attr:`StepInfo.solver` says which
            ran. :meth:`SGN.paper` sets ``"cg"``.
        direct_max_params: the largest matrix ``solver="auto"`` takes the direct solver for
            (its rows: parameters, or the batch's outputs). Default 4000 (the matrix and its
            factor take about 384 MB: they are float64).

    :meth:`SGN.paper` builds the paper's configuration (:data:`PAPER_OPTIONS`) whatever the
    defaults here.

    Example:
        >>> opt = SGN(model, loss="cross_entropy", cg_iters=5)
        >>> for x, y in loader:
        ...     info = opt.step(x, y)
        ...     print(info.loss, info.damping)

    .. note::
        The trust-region ratio is evaluated at the full step :math:`\alpha d` before the line
        search, as in the original, and its loss is reused as the line search's first trial.
        The predicted change is the damped quadratic model
        :math:`g^\top s + \tfrac12 s^\top (G + \rho I) s`, with ``g`` the gradient; with
        ``momentum=0`` this is the original's :math:`\tfrac12 (r + g)^\top d`.
        When that predicted change is within rounding of the loss, the damping is kept rather
        than raised (the original's rule would raise it every step once a batch is solved).

    .. note::
        A step is atomic: if it raises (non-finite loss or gradient, bad targets), the
        parameters, buffers, optimizer state and random state are as they were.

    References:
        M. Gargiani, A. Zanelli, M. Diehl, F. Hutter. On the Promise of the Stochastic
        Generalized Gauss-Newton Method for Training DNNs. arXiv:2006.02409, 2020.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: LossSpec,
        *,
        lr: float = 1.0,
        damping: float = 1e-4,
        damping_min: Optional[float] = None,
        cg_iters: int = 10,
        cg_tol: float = 1e-6,
        cg_rtol: float = 0.0,
        cg_progress_tol: float = 0.0,
        attempts: int = 1,
        damping_update: str = "threshold",
        line_search: bool = True,
        trust_region: bool = True,
        momentum: float = 0.0,
        warmup_cg_iters: Optional[int] = None,
        warmup_steps: int = 10,
        damping_schedule: str = "constant",
        damping_decay_steps: int = 10,
        preconditioner: bool = False,
        preconditioner_exponent: float = 1.0,
        warm_start: float = 0.0,
        ls_c: float = 1e-4,
        ls_shrink: float = 0.5,
        ls_max_evals: int = 10,
        keep_grad: bool = False,
        geodesic_acceleration: Optional[bool] = None,
        engine: str = "auto",
        cuda_graphs: bool = False,
        compile: bool = False,
        curvature_fraction: float = 1.0,
        process_group: ProcessGroup = None,
        solver: str = "auto",
        direct_max_params: int = direct.DEFAULT_DIRECT_MAX_PARAMS,
    ):
        defaults = dict(
            lr=lr, damping=damping, damping_min=damping_min, cg_iters=cg_iters, cg_tol=cg_tol,
            cg_rtol=cg_rtol, cg_progress_tol=cg_progress_tol, attempts=attempts,
            damping_update=damping_update, line_search=line_search, trust_region=trust_region,
            gradient_averaging=momentum, warmup_cg_iters=warmup_cg_iters,
            warmup_steps=warmup_steps, damping_schedule=damping_schedule,
            damping_decay_steps=damping_decay_steps, preconditioner=preconditioner,
            preconditioner_exponent=preconditioner_exponent, warm_start=warm_start, ls_c=ls_c,
            ls_shrink=ls_shrink, ls_max_evals=ls_max_evals, keep_grad=keep_grad,
            geodesic_acceleration=geodesic_acceleration,
        )  # fmt: skip
        assert set(defaults) == set(KEYS)
        check_options(defaults)
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

        _check(solver in direct.SOLVERS, "solver", solver, f"must be one of {direct.SOLVERS}")
        _check(
            type(direct_max_params) is int and direct_max_params >= 0,
            "direct_max_params",
            direct_max_params,
            "must be an int >= 0",
        )

        if isinstance(model, nn.parallel.DistributedDataParallel) and process_group is None:
            process_group = model.process_group  # (FunctionalModel takes the module it wraps)
        self._fmodel = FunctionalModel(model)
        self._solver = solver
        self._direct_max_params = direct_max_params
        self._loss = resolve_loss(loss)
        self._comm = communicator(self._fmodel, self._loss, process_group)
        super().__init__(self._fmodel.params, defaults)
        if len(self.param_groups) != 1:  # pragma: no cover - guarded by add_param_group
            raise ValueError("SGN doesn't support per-parameter options (parameter groups)")
        if cuda_graphs and not isinstance(self._comm, SingleProcess):
            raise ValueError(
                "cuda_graphs=True is not supported in a data-parallel group of several "
                "processes (shards may differ in shape); leave it off there"
            )
        self._engine = select_engine(self._fmodel, self._loss, engine, cuda_graphs, compile)
        self._engine_options = (engine, cuda_graphs, compile)  # a copy builds its own engine
        self._per_sample: dict = {}  # batch shapes -> whether the model is per-sample on them
        self._last_inputs: tuple = ()  # the last step's inputs (see _fits_one_batch)
        self._curvature_fraction = curvature_fraction
        if solver == "direct" and not self._may_solve_through_outputs():
            # before anything of the matrix's size is allocated
            fm = self._fmodel
            direct.check_direct_fits(fm.numel, torch.float64, fm.device)
        self._global_state()  # created now, so that a failed first step changes nothing

    @classmethod
    def paper(cls, model: nn.Module, loss: LossSpec, **overrides) -> SGN:
        """SGN configured exactly as the paper's experiments ran it.

        The arguments are :data:`PAPER_OPTIONS`: CG, damping ``1e-4`` with floor ``1e-6``, the
        threshold trust-region rule (:func:`~torch_sgn.solve.damping.trust_region_update`), one
        solve per step (no Levenberg-Marquardt re-solves), 10 CG iterations stopped only by
        the absolute ``cg_tol=1e-6``, 10 CG iterations during the first 10 steps
        (``warmup_cg_iters``), Armijo backtracking, step size 1. ``overrides`` replace any
        of them or set any other argument of :class:`SGN`, e.g.
        ``SGN.paper(model, "mse", cg_iters=5)`` for the paper's SGN(5). The benchmark
        runner's paper presets and grids are built this way.

        Args:
            model: as for :class:`SGN`.
            loss: as for :class:`SGN`.
            **overrides: keyword arguments of :class:`SGN`.

        Returns:
            The optimizer.
        """
        return cls(model, loss, **{**PAPER_OPTIONS, **overrides})

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise ValueError(
                "SGN optimizes the whole model given to it and doesn't support parameter groups"
            )
        super().add_param_group(param_group)

    # --- state -------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Loads SGN's state; another optimizer's ``state_dict`` raises ``ValueError`` here.
        The ``"solver_choice"`` that earlier versions saved (a measured choice) is ignored; a
        state saved after steps by a version whose ``solver="auto"`` took exact steps from the
        first (without :mod:`~torch_sgn.solve.auto`'s keys) goes on with exact steps."""
        loaded = {k: v for k, v in check_loaded_state(state_dict).items() if k != "solver_choice"}
        key = loaded["param_groups"][0]["params"][0] if loaded["param_groups"][0]["params"] else 0
        first = loaded.get("state", {}).get(key)
        if first and first.get("step", 0) > 0 and not set(auto.KEYS) & set(first):
            state = dict(loaded["state"])
            state[key] = {**first, "exact": True}
            loaded["state"] = state
        super().load_state_dict(loaded)

    def __getstate__(self) -> dict:
        # torch's Optimizer pickles only its defaults, state and groups; SGN's model, loss and
        # communicator go along, and the copy builds its engine (which caches plans and CUDA
        # graphs) afresh from the copied model.
        if not isinstance(self._comm, SingleProcess):
            raise TypeError(
                "an SGN in a data-parallel group of several processes cannot be copied or "
                "pickled (its process group cannot): save opt.state_dict() and load it into an "
                "SGN built on each rank"
            )
        state = super().__getstate__()
        own = ("_fmodel", "_loss", "_curvature_fraction", "_engine_options", "_solver")
        own += ("_direct_max_params",)
        state.update({k: self.__dict__[k] for k in own})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_comm" in self.__dict__:  # load_state_dict's call: the optimizer is built already
            return
        self._comm = SingleProcess()
        self._per_sample, self._last_inputs = {}, ()
        with warnings.catch_warnings():  # the original already warned about its engine
            warnings.simplefilter("ignore")
            self._engine = select_engine(self._fmodel, self._loss, *self._engine_options)

    def _global_state(self) -> dict:
        """SGN's state, kept on the first parameter so that load_state_dict casts it."""
        state = self.state[self._fmodel.params[0]]
        if not state:
            state["step"] = 0
            state["damping"] = float(self.param_groups[0]["damping"])
            if self.param_groups[0]["damping_update"] == "nielsen":
                state["damping_growth"] = GROWTH_START
        return state

    # --- one step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        inputs: Optional[Inputs] = None,
        targets: Optional[Tensor] = None,
        *,
        closure: Optional[Callable[[], object]] = None,
    ) -> StepInfo:
        """Performs one SGN iteration on the mini-batch ``(inputs, targets)``.

        Args:
            inputs: the model's input: a tensor, or a tuple of tensors passed positionally.
            targets: the loss's targets for this batch (required).
            closure: called once, with gradients enabled, before the step; its value is not
                used. For training loops that pass one beside the batch (PyTorch Lightning's
                ``self.optimizers().step(inputs=x, targets=y)`` passes its hooks' wrapper).

        Returns:
            A :class:`StepInfo` describing the step.

        Raises:
            ValueError: inputs or targets with NaN or infinite values that reach the loss or
                its gradient, or targets that do not fit the loss.
            FloatingPointError: the loss or its gradient is not finite at the current point
                on a finite batch.
            TypeError: a closure instead of a batch (see below; under PyTorch Lightning's
                automatic optimization the message says how to switch to manual).

        .. note::
            Unlike :class:`torch.optim.LBFGS`, SGN takes no closure: a closure returns the
            loss's value, while SGN needs the model's outputs and the targets to form the
            Gauss-Newton matrix :math:`J^\top H J` of the loss in output space. It runs the
            forward passes itself. A parameter frozen (``requires_grad=False``) after SGN was
            built keeps its value: steps are taken in the other parameters alone. One made
            trainable after SGN was built is not trained (SGN warns once): build a new SGN.
        """
        inputs, targets = batch_of_call(inputs, targets, closure)
        group = self.param_groups[0]
        check_options(group, in_step=True)  # a user or a scheduler may have changed them
        state = self._global_state()
        _check_batch(inputs, targets)
        batch = Batch(inputs, targets)
        t = state["step"]
        theta = self._fmodel.flat()
        buffers: dict = {}
        trainable = self._trainable_mask()
        self._warn_unfrozen()
        with self._fmodel.consistent():
            lin = self._comm.linearize(t, self._step_engine(t), theta, batch, buffers)
            check_loss_parameters(self._loss, self._fmodel, lin, theta, batch)
            if self._jacobian_applies(lin, theta, batch):
                lin = with_jacobian(lin, self._fmodel, self._loss, theta, batch)
            work = state  # what the direction is computed from
            if trainable is not None:  # restricted to the parameters still trainable
                lin, work = _restrict(lin, trainable), _restrict_state(state, trainable)
            loss0, grad_norm = _finite_loss(lin, batch, self._loss)
            rhs, momentum_buffer = self._momentum(lin.grad, work, t)
            route = self._route(lin, rhs)

            def loss_at(displacement: Tensor, a: float = 1.0) -> float:
                value = self._loss_at(lin, theta + displacement, batch)
                logger.debug("  line search: a=%.4g loss=%.6g", a, value)
                return value

            phase = auto.Phase(route)
            if self._solver == "auto":
                at = lambda point: self._loss_at(lin, point, batch)  # noqa: E731
                phase = auto.plan(state, t, route, loss0, at, self._fits_one_batch(batch))

            def attempt(route: Optional[str]) -> _Attempt:
                solve = self._step_solver(lin, rhs, work, t, route)
                accelerate = self._accelerator(lin, batch, theta, route, trainable)
                return self._attempt(
                    solve, accelerate, lin.grad, rhs, state, t, route, loss0, loss_at
                )

            run = attempt(phase.route)
            candidate, evals = None, run.evals
            if phase.probe is not None:  # the exact step too, judged on the next batch
                exact = attempt(phase.probe)
                evals += exact.evals
                if exact.moved:
                    candidate = theta + exact.trial.displacement(exact.search.step)
                exact = None
        trial, search, damping = run.trial, run.search, run.damping
        ratio, next_damping, growth = run.ratio, run.next_damping, run.growth
        cg, solution = trial.cg, trial.solution
        take = run.moved
        a = search.step if take else 0.0

        # Commit: nothing above has touched the model or the optimizer's state.
        if take:
            self._fmodel.write(theta + trial.displacement(a))
        self._fmodel.write_buffers(buffers)
        if group["keep_grad"]:
            self._write_grad(lin.grad)
        state["step"] = t + 1
        state["damping"] = next_damping
        if self._solver == "auto" and route is not None:
            switched = auto.advance(state, t, phase, loss0, candidate)
            if switched is not None:
                logger.info("step %d: solver='auto' switches to exact steps (%s)", t, switched)
        if group["damping_update"] == "nielsen":
            state["damping_growth"] = growth
        if momentum_buffer is not None:
            state["momentum_buffer"] = momentum_buffer
        if group["warm_start"] > 0:
            state["prev_direction"] = cg.x

        info = StepInfo(
            loss=loss0,
            loss_after=search.loss if take else loss0,
            grad_norm=grad_norm,
            cg_iters=cg.iterations,
            cg_residual=solution.residual_norm,
            cg_stop=cg.reason,
            damping=damping,
            next_damping=next_damping,
            step_size=group["lr"] * a,
            tr_ratio=ratio,
            predicted_change=solution.predicted,
            loss_evals=evals,
            line_search_ok=search.success,
            attempts=run.attempts,
            solver="direct" if isinstance(cg, DirectResult) else "cg",
            accelerated=take and trial.curve is not None,
        )
        self._log(t, info)
        return info

    # --- the step's parts --------------------------------------------------------------------
    def _attempt(
        self,
        solve: Callable[[float], CGResult | DirectResult],
        accelerate: Optional[Callable[[DirectResult], Optional[Tensor]]],
        grad: Tensor,
        rhs: Tensor,
        state: dict,
        t: int,
        route: Optional[str],
        loss0: float,
        loss_at: Callable[..., float],
    ) -> _Attempt:
        """One step's solution by one route, its damping attempts and its line search; nothing
        is written."""
        group = self.param_groups[0]
        floor = self._floor(route is not None)
        # Levenberg-Marquardt: a step that fails the sufficient-decrease test is solved
        # again on the same linearization with a larger damping, up to `attempts` times.
        damping = self._damping(state, t, floor)
        growth = state.get("damping_growth", GROWTH_START)
        evals = 0
        for attempts in range(1, group["attempts"] + 1):
            result = solve(damping)
            curve = None if accelerate is None else accelerate(result)
            trial = _Trial.of(result, curve, grad, rhs, group, loss0, loss_at)
            if trial.settled or attempts == group["attempts"]:
                break
            evals += trial.evals
            logger.debug(
                "  attempt %d rejected: damping %.3g, loss %.6g", attempts, damping, trial.loss
            )
            damping, growth = self._rejected(damping, growth, trial.ratio, floor)
            result = curve = trial = None  # its factorization, freed before the next one
        ratio, next_damping, growth = self._next_damping(damping, growth, trial, loss0, floor)
        search = LineSearchResult(1.0, trial.loss, 1, math.isfinite(trial.loss))
        if group["line_search"] and trial.moved:
            search = backtracking(
                lambda a: loss_at(trial.displacement(a), a), loss0, trial.solution.slope,
                c=group["ls_c"], shrink=group["ls_shrink"], max_evals=group["ls_max_evals"],
                first=trial.loss,
            )  # fmt: skip
            evals += search.evaluations
        else:
            evals += trial.evals
        return _Attempt(trial, search, damping, attempts, ratio, next_damping, growth, evals)

    def _trainable_mask(self) -> Optional[Tensor]:
        """1 at the parameters still trainable, 0 at those frozen since construction; ``None``
        when none is frozen."""
        flags = [p.requires_grad for p in self._fmodel.params]
        if all(flags):
            return None
        fm = self._fmodel
        return torch.cat([
            torch.full((n,), float(f), dtype=fm.dtype, device=fm.device)
            for n, f in zip(fm.numels, flags)
        ])  # fmt: skip

    def _warn_unfrozen(self) -> None:
        """Warns once about parameters made trainable after construction: SGN's parameter
        vector was fixed then, and they stay where they are."""
        if getattr(self, "_unfrozen_warned", False):
            return
        own = {id(p) for p in self._fmodel.params}
        names = [
            n
            for n, p in self._fmodel.model.named_parameters()
            if p.requires_grad and id(p) not in own
        ]
        if names:
            self._unfrozen_warned = True
            warn(
                f"parameter(s) {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} became "
                "trainable after SGN was built; SGN trains the parameters that were trainable "
                "then, so these keep their values. Build a new SGN to train them"
            )

    def _step_engine(self, t: int):
        """The engine for step ``t``: the curvature subset is drawn from a generator seeded
        with ``t``, so a resumed run, or a step retried after a failure, draws the same one."""
        if self._curvature_fraction < 1:
            return curvature_subset(self._engine, self._loss, self._curvature_fraction, seed=t)
        return self._engine

    def _floor(self, direct: bool) -> float:
        """The damping floor of this step: ``damping_min``, or where it is ``None`` the floor
        of the solver that runs."""
        floor = self.param_groups[0]["damping_min"]
        if floor is not None:
            return floor
        return DIRECT_DAMPING_MIN if direct else CG_DAMPING_MIN

    def _damping(self, state: dict, t: int, floor: float) -> float:
        group = self.param_groups[0]
        if group["trust_region"]:
            return max(state["damping"], floor)  # CG's floor after the direct solver's
        return scheduled_damping(
            group["damping_schedule"], group["damping"], min(floor, group["damping"]), t,
            group["damping_decay_steps"],
        )  # fmt: skip

    def _rejected(
        self, damping: float, growth: float, ratio: float, floor: float
    ) -> tuple[float, float]:
        """The damping of the next attempt at this step, and Nielsen's growth factor."""
        group = self.param_groups[0]
        if group["damping_update"] == "nielsen":
            return rejected_update(damping, growth)
        return trust_region_update(damping, ratio, floor), growth

    def _next_damping(
        self, damping: float, growth: float, trial: _Trial, loss0: float, floor: float
    ) -> tuple[Optional[float], float, float]:
        """The trust-region ratio (``None`` with the trust region off), the next step's damping
        and growth factor.

        A predicted change within rounding of the loss (at a minimum, or with a vanishing
        gradient) says nothing about the model's quality: the damping is then kept, where the
        plain rule would read the rounding noise as a failed prediction and raise the damping
        step after step until it overflows.
        """
        group = self.param_groups[0]
        if not group["trust_region"]:
            return None, damping, growth
        if trial.noise:
            return math.nan, damping, growth
        if group["damping_update"] == "threshold":
            return (
                trial.ratio,
                trust_region_update(damping, trial.ratio, floor),
                growth,
            )
        if trial.accepted:
            return (
                trial.ratio,
                nielsen_update(damping, trial.ratio, floor),
                GROWTH_START,
            )
        return (trial.ratio, *rejected_update(damping, growth))

    def _momentum(self, grad: Tensor, state: dict, t: int) -> tuple[Tensor, Optional[Tensor]]:
        """The CG right-hand side ``m_hat`` and the new moving average (None without momentum)."""
        beta = self.param_groups[0]["gradient_averaging"]
        if beta == 0:
            return grad, None
        m = state.get("momentum_buffer")
        m = (1 - beta) * grad if m is None else beta * m + (1 - beta) * grad
        return m / (1 - beta ** (t + 1)), m

    def _step_solver(
        self, lin: Linearization, rhs: Tensor, state: dict, t: int, route: Optional[str]
    ) -> Callable[[float], CGResult | DirectResult]:
        r"""``damping -> solution`` of :math:`(G + \rho I) d = -\hat m` for this step's
        linearization: the step's attempts share it and differ only in the damping (the
        direct solver forms its matrix once and factors it for each). ``route``: see
        :meth:`_route`."""
        if route == "samples":
            space = lin.sample_space
            assert space is not None and rhs is lin.grad
            return lambda damping: self._logged(
                direct.solve_in_sample_space(space, lin.grad, damping, lin.ggn_vp), damping
            )
        if route == "matrix":
            return lambda damping: self._logged(
                direct.solve_damped(lin.ggn_matrix(), rhs, damping), damping
            )
        group = self.param_groups[0]
        iters = group["cg_iters"]
        if group["warmup_cg_iters"] is not None and t < group["warmup_steps"]:
            iters = group["warmup_cg_iters"]
        x0 = None
        previous = state.get("prev_direction")
        if group["warm_start"] > 0 and previous is not None:
            x0 = group["warm_start"] * previous

        def solve(damping: float) -> CGResult:
            precond = None
            if group["preconditioner"]:
                precond = (rhs.square() + damping).pow(-group["preconditioner_exponent"])

            def damped(v: Tensor) -> Tensor:
                return lin.ggn_vp(v).add_(v, alpha=damping)  # a product is a fresh tensor

            result = conjugate_gradient(
                damped, -rhs, max_iters=iters, tol=group["cg_tol"], rtol=group["cg_rtol"],
                progress_tol=group["cg_progress_tol"], x0=x0, preconditioner=precond,
            )  # fmt: skip
            if result.breakdown:
                logger.warning(
                    "CG stopped early (%s) after %d iterations; using its last good iterate",
                    result.reason, result.iterations,
                )  # fmt: skip
            return result

        return solve

    def _accelerator(
        self,
        lin: Linearization,
        batch: Batch,
        theta: Tensor,
        route: Optional[str],
        mask: Optional[Tensor],
    ) -> Optional[Callable[[DirectResult], Optional[Tensor]]]:
        r"""``solution -> (lr^2 / 2) a``, the geodesic acceleration's term of an exact step
        (:mod:`torch_sgn.solve.geodesic`; ``None`` where it is not used), or ``None`` where no step
        takes one: CG steps, or the option off.

        In a data-parallel group each rank differences its shard's outputs and the shards'
        ``J^T H f_vv`` are reduced as the gradient is, so every rank takes the same step."""
        group = self.param_groups[0]
        on = group["geodesic_acceleration"]
        if on is None:
            on = theta.dtype == torch.float64
        if route is None or not on:
            return None
        outputs_at = lin.outputs_at
        if outputs_at is None:
            outputs_at = lambda flat: self._fmodel(flat, batch.inputs)  # noqa: E731
        vjp = lin.vjp
        centre = None  # the outputs at theta, shared by the step's attempts
        scale = 0.5 * group["lr"] ** 2
        # Through the outputs the system takes its right-hand side in output space.
        size = lin.sample_space.size if route == "samples" else theta.numel()

        def curve(result: DirectResult) -> Optional[Tensor]:
            if result.again is None or result.breakdown:
                return None
            v = result.x

            def local() -> tuple[Tensor, Tensor]:  # (J^T) H f_vv and the rounding's norms
                nonlocal vjp, centre
                if centre is None:
                    centre = outputs_at(theta)
                fvv, norms = geodesic.second_difference(outputs_at, theta, v, centre)
                hf = self._loss.hessian(centre, batch.targets)(fvv)
                if route == "samples":
                    return hf, norms
                if vjp is None:
                    vjp = self._vjp_at(theta, batch)
                b = vjp(hf)
                return (b if mask is None else b * mask), norms

            b, norms = self._comm.shares(local, (size, 4), "the geodesic acceleration")
            if not geodesic.above_rounding(norms, theta.dtype):
                return None
            a = geodesic.accepted(v, result.again(b))
            return None if a is None else a.mul_(scale)

        return curve

    def _vjp_at(self, theta: Tensor, batch: Batch) -> Callable[[Tensor], Tensor]:
        """``u -> J^T u`` at ``theta`` by a forward and a backward pass, for engines that keep
        no graph."""

        def vjp(u: Tensor) -> Tensor:
            leaf = theta.detach().requires_grad_(True)
            with torch.enable_grad():
                (jtu,) = torch.autograd.grad(self._fmodel(leaf, batch.inputs), leaf, u)
            return jtu

        return vjp

    def _route(self, lin: Linearization, rhs: Tensor) -> Optional[str]:
        """How this step solves: ``None`` by CG, ``"matrix"`` directly through the ``P x P``
        matrix ``G``, ``"samples"`` directly through the batch's outputs
        (:func:`~torch_sgn.solve.direct.solve_in_sample_space`). ``solver="auto"``: the direct
        solver wherever its matrix has at most ``direct_max_params`` rows, through the outputs
        where they are fewer than the parameters, and through ``G`` only where the engine forms
        it from the per-sample Jacobian (or ``P <= cg_iters``): from products with the
        identity's columns ``G`` costs ``P`` products, which on a model of thousands of
        parameters is hundreds of times CG's ``k``. Else CG. A rule, not a timing, so that a
        run takes the same steps on every machine."""
        if self._solver == "cg":
            return None
        if self._samples_fit(lin, rhs):
            return "samples"
        if self._solver == "direct":
            fm = self._fmodel
            try:  # raised here, before the step changes anything
                direct.check_direct_fits(fm.numel, torch.float64, fm.device)
            except ValueError as e:
                raise ValueError(
                    f"{e}. This step could not go through the batch's outputs either (that "
                    "route needs fewer outputs than parameters, no momentum, one process and "
                    "a chain of linear layers and activations); the step was not taken"
                ) from None
            return "matrix"
        cheap = lin.dense_ggn is not None or self._fmodel.numel <= self.param_groups[0]["cg_iters"]
        return "matrix" if cheap and self._matrix_fits() else None

    def _may_solve_through_outputs(self) -> bool:
        """Whether steps may go through the batch's outputs (the engine and the options allow
        it; each batch decides): ``solver="direct"`` then checks the ``P x P`` matrix's memory
        at the steps that cannot, not at construction. The layer-wise engine may, and any
        engine on a residual problem (:mod:`torch_sgn.engines.jacobian`)."""
        return (
            (
                getattr(self._engine, "may_solve_through_outputs", False)
                or hasattr(self._fmodel.model, "jacobian_blocks")
            )
            and isinstance(self._comm, SingleProcess)
            and self.param_groups[0]["gradient_averaging"] == 0
            and self._curvature_fraction == 1
        )

    def _fits_one_batch(self, batch: Batch) -> bool:
        """Whether this run fits one batch rather than a stream of mini-batches: the model is a
        least-squares problem of residuals (:class:`torch_sgn.pinn.Residuals`, whose points
        may be drawn anew), or this step's inputs are the previous step's tensors, unchanged
        (a full-batch fit). ``solver="auto"`` then takes exact steps at once."""
        key = tuple((x.data_ptr(), tuple(x.shape), x._version) for x in batch.args)
        same, self._last_inputs = key == self._last_inputs, key
        return same or hasattr(self._fmodel.model, "jacobian_blocks")

    def _jacobian_applies(self, lin: Linearization, theta: Tensor, batch: Batch) -> bool:
        """Whether this step's exact solves form ``J`` row by row
        (:func:`~torch_sgn.engines.jacobian.with_jacobian`): on a residual problem
        (:class:`torch_sgn.pinn.Residuals`) unless CG is asked for, and on any model with
        ``solver="direct"`` (in place of ``P`` products); where the engine has no route of its
        own, CUDA graphs are off, and the model is per-sample on batches of this shape (checked
        once per shape and mode). ``solver="auto"`` keeps its cost rule on other models."""
        residual_problem = hasattr(self._fmodel.model, "jacobian_blocks")
        if (
            self._solver == "cg"
            or (self._solver == "auto" and not residual_problem)
            or self._engine_options[1]  # cuda_graphs: the captured products are the route
            or lin.dense_ggn is not None
            or lin.sample_space is not None
            or not isinstance(self._comm, SingleProcess)
            or self._curvature_fraction != 1
        ):
            return False
        key = (
            tuple((tuple(x.shape), x.dtype) for x in batch.args),
            self._fmodel.model.training,
            self._fmodel.settings(),
        )
        if key not in self._per_sample:
            self._per_sample[key] = per_sample(self._fmodel, theta, batch)
        return self._per_sample[key]

    def _samples_fit(self, lin: Linearization, rhs: Tensor) -> bool:
        """Whether the step can be solved through the batch's outputs, more cheaply than
        through ``G`` (fewer outputs than parameters), within ``direct_max_params`` for
        ``"auto"`` and in the free memory."""
        space = lin.sample_space
        if space is None or rhs is not lin.grad or space.size >= self._fmodel.numel:
            return False
        if self._solver == "auto" and space.size > self._direct_max_params:
            return False
        return _fits(space.size, torch.float64, self._fmodel.device)

    def _matrix_fits(self) -> bool:
        fm = self._fmodel
        return fm.numel <= self._direct_max_params and _fits(fm.numel, torch.float64, fm.device)

    def _logged(self, result: DirectResult, damping: float) -> DirectResult:
        if result.reason not in ("cholesky", "lu"):  # an indefinite G, or rounding
            logger.debug(
                "  the direct solve's factorization failed at damping %.3g; solved by the %s "
                "fallback",
                damping, result.reason,
            )  # fmt: skip
        return result

    def _loss_at(self, lin: Linearization, flat: Tensor, batch: Batch) -> float:
        if lin.value_at is not None:
            return self._comm.loss_value(lambda: lin.value_at(flat))
        return self._comm.loss_value(
            lambda: self._loss.value(self._fmodel(flat, batch.inputs), batch.targets)
        )

    def _write_grad(self, grad: Tensor) -> None:
        fm = self._fmodel
        for p, g, shape in zip(fm.params, grad.split(fm.numels), fm.shapes):
            p.grad = g.view(shape).clone()

    def _log(self, t: int, info: StepInfo) -> None:
        logger.info(
            "step %d: loss %.6g -> %.6g, damping %.3g, step %.3g",
            t, info.loss, info.loss_after, info.damping, info.step_size,
        )  # fmt: skip
        logger.debug(
            "  |g| %.4g, CG %d it (%s), |r| %.3g, ratio %s, %d loss evals",
            info.grad_norm, info.cg_iters, info.cg_stop, info.cg_residual,
            "-" if info.tr_ratio is None else f"{info.tr_ratio:.3g}", info.loss_evals,
        )  # fmt: skip


@dataclass(frozen=True)
class _Solution:
    """What the step's decisions need from the CG solution ``d``, copied to the host at once."""

    predicted: float  # the damped quadratic model's change at ``s = lr d``
    slope: float  # ``m_hat^T s``, the line search's directional derivative
    residual_norm: float
    moved: bool  # ``d != 0``

    @staticmethod
    def of(grad: Tensor, rhs: Tensor, cg: CGResult | DirectResult, lr: float) -> _Solution:
        r"""The change :math:`g^\top s + \frac12 s^\top A s` uses CG's residual, which gives
        :math:`A d = r - \hat m` without another product."""
        d = cg.x
        g_d, curv, m_d, res, d_max = torch.stack([
            torch.dot(grad, d), torch.dot(d, cg.residual - rhs), torch.dot(rhs, d),
            torch.linalg.vector_norm(cg.residual), d.abs().max(),
        ]).tolist()  # fmt: skip
        return _Solution(lr * g_d + 0.5 * lr * lr * curv, lr * m_d, res, d_max != 0)


@dataclass(frozen=True)
class _Trial:
    """One attempt at a step: the solution at one damping and the loss at its full step."""

    cg: CGResult
    solution: _Solution
    step: Tensor  # lr d
    curve: Optional[Tensor]  # lr^2 a / 2, the geodesic acceleration's term; None without
    loss: float  # at the full step (loss0 when d = 0)
    evals: int  # loss evaluations made (0 or 1)
    ratio: float  # actual over predicted change; NaN unless the prediction is a decrease
    accepted: bool  # the Armijo condition holds at the full step
    noise: bool  # the predicted change is within rounding of the loss

    @property
    def moved(self) -> bool:
        return self.solution.moved

    def displacement(self, a: float) -> Tensor:
        """The change of the parameters at the line search's factor ``a``: ``a lr d``, and
        with a geodesic acceleration the parabola ``a lr d + a^2 lr^2 a_geo / 2``."""
        if self.curve is None:
            return a * self.step
        return torch.add(self.step, self.curve, alpha=a).mul_(a)

    @property
    def settled(self) -> bool:
        """Whether another attempt with a larger damping is pointless."""
        return self.accepted or self.noise or not self.moved

    @staticmethod
    def of(
        cg: CGResult,
        curve: Optional[Tensor],
        grad: Tensor,
        rhs: Tensor,
        group: dict,
        loss0: float,
        loss_at: Callable[[Tensor], float],
    ) -> _Trial:
        solution = _Solution.of(grad, rhs, cg, group["lr"])
        step = group["lr"] * cg.x
        moved = solution.moved
        loss = loss_at(step if curve is None else step + curve) if moved else loss0
        predicted = solution.predicted
        dtype = grad.dtype
        noise = 100 * torch.finfo(dtype).eps * max(abs(loss0), torch.finfo(dtype).tiny)
        within_noise = abs(predicted) <= noise and not cg.breakdown and math.isfinite(loss)
        ratio = (loss - loss0) / predicted if predicted < 0 else math.nan
        # The line search's first test, at a = 1.
        accepted = moved and math.isfinite(loss) and loss <= loss0 + group["ls_c"] * solution.slope
        return _Trial(cg, solution, step, curve, loss, int(moved), ratio, accepted, within_noise)


@dataclass(frozen=True)
class _Attempt:
    """A step's outcome by one route: the last attempt's trial, its line search, the damping it
    was solved at, the attempts made, the trust-region ratio, the next damping and growth factor,
    and the loss evaluations made."""

    trial: _Trial
    search: LineSearchResult
    damping: float
    attempts: int
    ratio: Optional[float]
    next_damping: float
    growth: float
    evals: int

    @property
    def moved(self) -> bool:
        """Whether the step changes the parameters (a finite loss where it ends)."""
        return self.trial.moved and math.isfinite(self.search.loss)


def _finite_loss(lin: Linearization, batch: Batch, loss_fn: OutputLoss) -> tuple[float, float]:
    """The loss and the gradient's norm (one host transfer); raises unless both are finite.

    The batch is scanned for NaN and infinite values only then, to name the cause: a
    non-finite entry that reaches the loss or the gradient is found without a pass over the
    batch in every step (on a distributed step, every rank sees the reduced values, so all
    raise together).
    """
    norm = torch.linalg.vector_norm(lin.grad).to(lin.loss.dtype)
    loss, grad_norm = torch.stack([lin.loss.reshape(()), norm]).tolist()
    # A norm that overflows on finite entries is settled by the exact test.
    finite = math.isfinite(loss) and (
        math.isfinite(grad_norm) or bool(torch.isfinite(lin.grad).all())
    )
    if not finite:
        _check_finite_batch(batch.inputs, batch.targets)
        _check_counted_targets(batch.targets, loss_fn)
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"the loss is {loss} at the current parameters on this batch; the parameters were "
            "not changed. Check the data and the model's output (e.g. lower the learning rate "
            "of an earlier optimizer, or raise `damping`)"
        )
    if not finite:
        raise FloatingPointError(
            "the gradient has non-finite entries at the current parameters; the parameters "
            "were not changed"
        )
    return loss, grad_norm


def _restrict(lin: Linearization, mask: Tensor) -> Linearization:
    """The linearization in the directions where ``mask`` is 1: ``P g`` and ``P G P``."""
    ggn_vp = lin.ggn_vp
    dense = None
    if lin.dense_ggn is not None:
        dense = lambda: lin.ggn_matrix() * mask[:, None] * mask[None, :]  # noqa: E731
    return replace(
        lin,
        grad=lin.grad * mask,
        ggn_vp=lambda v: ggn_vp(v * mask) * mask,
        dense_ggn=dense,
        sample_space=None,  # its J spans the frozen directions too
    )


def _fits(n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the direct solver's ``n x n`` matrices fit in the device's free memory."""
    try:
        direct.check_direct_fits(n, dtype, device)
    except ValueError:
        return False
    return True


def _restrict_state(state: dict, mask: Tensor) -> dict:
    """A view of the state whose vectors (gradient average, previous direction) are zero where
    ``mask`` is: CG's iterates then stay in the trainable directions."""
    view = dict(state)
    for key in ("momentum_buffer", "prev_direction"):
        if view.get(key) is not None:
            view[key] = view[key] * mask
    return view


def _check_batch(inputs: Inputs, targets: Optional[Tensor]) -> None:
    if targets is None:
        if callable(inputs):
            raise TypeError(
                "SGN.step takes the mini-batch, opt.step(inputs, targets), not a closure: SGN "
                "needs the model's outputs and the targets, not only the loss a closure "
                "returns, to form the Gauss-Newton matrix J^T H J, and runs the forward passes "
                "itself"
            )
        raise TypeError("SGN.step(inputs, targets) needs the targets of the batch")
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    for i, x in enumerate(items):
        if not isinstance(x, Tensor):
            raise TypeError(
                f"inputs must be a tensor or a tuple of tensors; item {i} is {type(x).__name__}"
            )
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")


def _check_counted_targets(targets: Tensor, loss: OutputLoss) -> None:
    """Raises ``ValueError`` if the batch has no target that a mean of the loss counts."""
    if targets.numel() == 0:
        raise ValueError(
            f"the batch is empty (targets of shape {tuple(targets.shape)}): the mean loss of no "
            "samples is NaN; skip empty batches"
        )
    if loss.reduction == "mean" and loss.normalizer(targets) == 0:
        raise ValueError(
            f"no target of this batch counts toward the mean {loss.name} loss (each one is "
            "ignore_index, or of a class of weight 0), so the mean is 0 / 0: skip such "
            "batches, or use reduction='sum'"
        )


def _check_finite_batch(inputs: Inputs, targets: Tensor) -> None:
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    for i, x in enumerate(items):
        if x.is_floating_point() and not _all_finite(x):
            where = "inputs" if not isinstance(inputs, tuple) else f"inputs[{i}]"
            raise ValueError(f"{where} contain NaN or infinite values; clean the batch first")
    if targets.is_floating_point() and not _all_finite(targets):
        raise ValueError("targets contain NaN or infinite values; clean the batch first")


def _all_finite(x: Tensor) -> bool:
    """Whether every entry is finite, without temporaries the size of ``x``.

    ``isfinite(x)`` allocates about twice the batch in temporaries, more than the rest of a
    step on an input-heavy model; one sum is finite exactly when no entry is NaN or infinite,
    unless finite entries overflow it, and then the exact test decides.
    """
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _check(ok: bool, name: str, value: object, what: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: {what}")
