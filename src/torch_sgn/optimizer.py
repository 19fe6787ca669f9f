"""The SGN optimizer: one damped Gauss-Newton step per mini-batch."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from .distributed import ProcessGroup, SingleProcess, communicator
from .losses import LossSpec, resolve_loss
from .model.flat_model import FunctionalModel, Inputs
from .options import (
    OPTION_ARGUMENTS,
    PAPER_OPTIONS,
    SETUP_KEYS,
    Options,
    Setup,
    check_loaded_state,
)
from .solve import direct
from .solve.state import StepState
from .step_info import StepInfo
from .stepper import NOT_A_CLOSURE, Stepper

__all__ = ["SGN", "StepInfo"]


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
            original's default and the paper's best setting on CIFAR-10. With
            ``solver="auto"``, a run that fits one batch with a forward that differentiates
            itself by ``torch.autograd.grad`` takes at least 100, to ``cg_rtol`` 1e-3 where none
            is set, with the Nystrom preconditioner on float64 parameters where none is set
            (:func:`~torch_sgn.solve.core.cg_settings`).
        cg_tol: CG stops early once the largest absolute residual entry is at most this
            (``CG_TOL``). Default ``None``: the original's and the paper's ``1e-6``
            (:meth:`paper`) on float32 parameters, near the rounding of their loss's gradient;
            off (0) on float64 ones, where a gradient that small is far from a fit's end and
            the test would end CG at its first iteration.
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
            rule (:func:`~torch_sgn.solve.step.trust_region_update`: times 3/2 below ratio 1/4,
            times 2/3 above 3/4). ``"nielsen"``: Nielsen's smooth rule
            (:func:`~torch_sgn.solve.step.nielsen_update`: down to a third after a good step,
            with no band where it is stuck), and on a rejected attempt times 2, 4, 8, ...
            (:func:`~torch_sgn.solve.step.rejected_update`); it needs ``damping_min > 0``.
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
        preconditioner: CG's preconditioner. ``True`` or ``"diagonal"``: the paper's diagonal
            :math:`M = (\hat m^2 + \rho)^{-\text{exponent}}` (``CG_PREC``). ``"nystrom"``: a
            randomized Nystrom approximation of ``G`` of rank ``preconditioner_rank``
            (:func:`torch_sgn.nystrom`, Frangella, Tropp and Udell, 2023), built from that
            many ``G v`` products every ``preconditioner_every`` steps; it flattens the top of
            ``G``'s spectrum, so CG needs far fewer iterations on ill-conditioned systems
            (large physics-informed networks: docs/PINN.md). Default ``False``: none.
        preconditioner_exponent: the diagonal's exponent (``ALPHA_EXP``). Default 1.
        preconditioner_rank: the Nystrom approximation's rank (at most the number of
            trainable parameters). Default 100.
        preconditioner_every: rebuild the Nystrom approximation every this many steps (at
            the current parameters and batch). Default 10.
        warm_start: start CG from this factor times the previous step's CG solution (Martens,
            2010); 0 starts from zero as the original does. Default 0.
        ls_c: Armijo constant (``C_LS``). Default ``1e-4`` (Nocedal & Wright).
        ls_shrink: backtracking factor (``RHO_LS``). Default 0.5.
        ls_max_evals: most loss evaluations in one line search (``MAX_LS_ITERS``). Default 10.
        reject_uphill: no step ends above the batch's starting loss: a step whose line search
            ends above it (or at a non-finite loss) is solved again with the damping raised
            (:meth:`~torch_sgn.solve.step.DampingRule.raised`), up to
            :data:`~torch_sgn.solve.step.UPHILL_RESOLVES` times, else not taken (the parameters
            unchanged, the raised damping kept); :attr:`StepInfo.uphill_resolves` and
            :attr:`StepInfo.taken` say which (``docs/OPTIONS.md``). Default on; off in
            :meth:`SGN.paper`, whose original commits the line search's last trial.
        weight_decay: an L2 penalty :math:`\lambda` with :class:`torch.optim.SGD`'s meaning:
            the objective :math:`L(\theta) + \frac\lambda2 \|\theta\|^2`, so the gradient
            :math:`g + \lambda\theta`, the curvature :math:`G + \lambda I`; the trust region,
            the line search and :class:`StepInfo`'s losses use this objective
            (``StepInfo.penalty`` is its penalty term). Every solver takes it; not decoupled
            (``docs/OPTIONS.md`` says why). Default 0 (off), as the paper.
        keep_grad: write the mini-batch gradient (with ``weight_decay``, of the penalized
            objective) into each parameter's ``.grad``. Default off: SGN leaves ``.grad``
            untouched.
        geodesic_acceleration: add to each exact (direct) step its geodesic acceleration
            (Transtrum and Sethna, 2012; :func:`torch_sgn.solve.core.accelerator`): the
            second-order term ``a / 2``, ``(G + rho I) a = -J^T H f_vv``, of the path along
            which the outputs keep their velocity, with ``f_vv`` the outputs' second difference
            along the step ``d`` (three forward passes) and the step's own factorization. Used
            only while ``2 |a| <= 0.75 |d|`` and above the outputs' rounding; the trust region
            and the line search judge ``d``. It keeps exact steps moving along the curved
            valleys of precise fits. Ignored by CG steps. Default ``None``: on for float64
            models, off in lower precision, where the outputs' rounding blurs ``f_vv`` near a
            precise fit (``docs/SOLVERS.md`` has the measurements behind this default).
            :meth:`SGN.paper` turns it off. ``"strict"``: on, and an attempt whose
            acceleration fails ``2 |a| <= 0.75 |d|`` is rejected as a failed one (solved again
            with more damping, within ``attempts``; Transtrum and Sethna's own rule) rather
            than taken without it: fewer steps off the model's valid region at the price of
            more solves (on the NIST StRD suite ``least_squares`` with ``attempts=10,
            max_steps=1000`` fits all 54 starts where the default fits 53, in 1.8 times the
            steps).
        step_rule: ``"lr"``: the step is ``lr`` times CG's solution ``d`` (the paper's).
            ``"quadratic"``: the step is ``lr`` times :math:`\alpha d + \beta \delta`, with
            :math:`\delta` the previous step's update and :math:`(\alpha, \beta)` the minimiser
            of the damped quadratic model over their span (Martens & Grosse, 2015, section 7;
            :mod:`torch_sgn.solve.quadratic`): a step size and a momentum chosen at every step,
            for one more ``G v`` product. CG steps only (exact steps keep ``"lr"``).
            Default ``"lr"``.
        engine: how ``G v`` products are computed (their costs: ``docs/PERFORMANCE.md``).
            ``"layerwise"``: the layer-wise engine of :mod:`torch_sgn.engines.layerwise.engine`
            for ``nn.Sequential`` chains of the layers listed by
            ``torch_sgn.engines.layerwise.rules.supported_layers()`` (one forward pass per
            step, products by per-layer rules); raises if the model is not such a chain.
            ``"traced"``: the traced engine of :mod:`torch_sgn.engines.traced.engine` for any
            model ``torch.fx`` can trace (residual connections, normalization layers,
            attention, recurrent layers, custom ``forward`` methods): the product is traced
            once per input shape and split so that a CG iteration runs only its part that
            depends on ``v``; raises if the model cannot be traced. ``"functional"``:
            ``torch.func`` forward-mode AD, any model (re-runs the forward pass at every
            product). ``"auto"``: layer-wise where it applies, else traced, else functional
            with the reason in a one-time warning. Default ``"auto"``.
        cuda_graphs: capture the engine's set-up, ``G v`` product and trial-point loss as
            CUDA graphs, once per batch shape, and replay them every step (see
            :mod:`torch_sgn.engines.cuda_graphs`): for small models on a GPU, whose steps cost
            kernel launches more than arithmetic. The layer-wise engine captures CUDA models
            whose chain it runs by hand with a named loss (each layer's rule in
            :mod:`torch_sgn.engines.layerwise.rules` says whether it can be captured;
            ``docs/LAYERS.md`` has the table); the traced
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
            takes seconds to minutes, and its products then cost less (measured in
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
            next batch, or the batch loss stalls (:func:`torch_sgn.route_plan.auto_phase`);
            residual problems too large for either matrix, by samples
            (:func:`torch_sgn.route_plan.row_stage`). Rules, not timings.
            :attr:`StepInfo.solver` says which ran. :meth:`SGN.paper` sets ``"cg"``.
        direct_max_params: the largest matrix ``solver="auto"`` takes the direct solver for
            (its rows: parameters, or the batch's outputs). Default 4000 (the matrix and its
            factor take about 384 MB: they are float64).

    Raises:
        ValueError: an invalid option or setting (the message names it and its valid range),
            ``cuda_graphs=True`` in a data-parallel group of several processes,
            ``curvature_fraction < 1`` on a :class:`~torch_sgn.pinn.Residuals` problem, or
            ``solver="direct"`` on a model whose ``P x P`` matrices do not fit in its device's
            free memory (where its steps cannot go through the batch's outputs).
        TypeError: a model or loss of the wrong kind.

    :meth:`SGN.paper` builds the paper's configuration
    (:data:`~torch_sgn.options.PAPER_OPTIONS`) whatever the
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
        cg_tol: Optional[float] = None,
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
        preconditioner: Union[bool, str] = False,
        preconditioner_exponent: float = 1.0,
        preconditioner_rank: int = 100,
        preconditioner_every: int = 10,
        warm_start: float = 0.0,
        ls_c: float = 1e-4,
        ls_shrink: float = 0.5,
        ls_max_evals: int = 10,
        reject_uphill: bool = True,
        keep_grad: bool = False,
        weight_decay: float = 0.0,
        geodesic_acceleration: Union[None, bool, str] = None,
        step_rule: str = "lr",
        engine: str = "auto",
        cuda_graphs: bool = False,
        compile: bool = False,
        curvature_fraction: float = 1.0,
        process_group: ProcessGroup = None,
        solver: str = "auto",
        direct_max_params: int = direct.DEFAULT_DIRECT_MAX_PARAMS,
    ):
        given = locals()  # the arguments: options (kept in param_groups) and settings
        # the options of the step in progress
        self._options = Options().replace(**{name: given[name] for name in OPTION_ARGUMENTS})
        self._setup = setup = Setup().replace(**{key: given[key] for key in SETUP_KEYS})
        defaults = self._options.group()

        if isinstance(model, nn.parallel.DistributedDataParallel) and process_group is None:
            process_group = model.process_group  # (FunctionalModel takes the module it wraps)
        self._fmodel = FunctionalModel(model)
        self._loss = resolve_loss(loss)
        self._comm = communicator(self._fmodel, self._loss, process_group)
        super().__init__(self._fmodel.params, defaults)
        # A GradScaler then calls step directly, which refuses it with the reason
        # (refuse_grad_scaler) rather than fail inside the scaler.
        self._step_supports_amp_scaling = True
        if len(self.param_groups) != 1:  # pragma: no cover - guarded by add_param_group
            raise ValueError("SGN doesn't support per-parameter options (parameter groups)")
        # the step itself (its engine, route decisions and caches)
        self._stepper = Stepper(self._fmodel, self._loss, self._comm, setup, self._options)
        self._engine = self._stepper.engine
        self._global_state()  # created now, so that a failed first step changes nothing

    @classmethod
    def paper(cls, model: nn.Module, loss: LossSpec, **overrides) -> SGN:
        """SGN configured exactly as the paper's experiments ran it.

        The arguments are :data:`~torch_sgn.options.PAPER_OPTIONS`: CG, damping ``1e-4`` with
        floor ``1e-6``, the threshold trust-region rule
        (:func:`~torch_sgn.solve.step.trust_region_update`), one solve per step (no
        Levenberg-Marquardt re-solves), 10 CG iterations stopped only by the absolute
        ``cg_tol=1e-6``, 10 CG iterations during the first 10 steps (``warmup_cg_iters``),
        Armijo backtracking, step size 1, and the original's behaviour where the line search
        fails: its last trial is taken even where the loss rose (``reject_uphill=False``).
        ``overrides`` replace any
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
        """Adds SGN's one parameter group (called once, by the constructor).

        Args:
            param_group: the group: the model's trainable parameters and SGN's options.

        Raises:
            ValueError: a second group: SGN optimizes the whole model given to it.
        """
        if self.param_groups:
            raise ValueError(
                "SGN optimizes the whole model given to it and doesn't support parameter groups"
            )
        super().add_param_group(param_group)

    # --- state -------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Loads SGN's state (its options and :class:`~torch_sgn.solve.state.StepState`).

        Args:
            state_dict: what :meth:`state_dict` returned, of an SGN on the same model.

        Raises:
            ValueError: another optimizer's ``state_dict``, one lacking an SGN option or one
                whose values SGN refuses (:func:`~torch_sgn.options.check_loaded_state`).
        """
        check_loaded_state(state_dict)
        super().load_state_dict(state_dict)
        self._stepper.nystrom.reset()  # built afresh at the next step that uses it

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
        own = ("_fmodel", "_loss", "_setup", "_options")
        state.update({k: self.__dict__[k] for k in own})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_comm" in self.__dict__:  # load_state_dict's call: the optimizer is built already
            return
        self._comm = SingleProcess()
        with warnings.catch_warnings():  # the original already warned about its engine
            warnings.simplefilter("ignore")
            self._stepper = Stepper(
                self._fmodel, self._loss, self._comm, self._setup, self._options
            )
        self._engine = self._stepper.engine

    def _global_state(self) -> dict:
        """SGN's state (:class:`~torch_sgn.solve.state.StepState` as a dict), kept on the first
        parameter so that load_state_dict casts it."""
        stored = self.state[self._fmodel.params[0]]
        if not stored:
            StepState.first(self._options).write(stored)
        return stored

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
                automatic optimization the message says how to switch to manual); a call by a
                :class:`torch.amp.GradScaler` (SGN needs none: step under ``torch.autocast``
                alone).

        .. note::
            Unlike :class:`torch.optim.LBFGS`, SGN takes no closure: a closure returns the
            loss's value, while SGN needs the model's outputs and the targets to form the
            Gauss-Newton matrix :math:`J^\top H J` of the loss in output space. It runs the
            forward passes itself. A parameter frozen (``requires_grad=False``) after SGN was
            built keeps its value: steps are taken in the other parameters alone. One made
            trainable after SGN was built is not trained (SGN warns once): build a new SGN.
        """
        refuse_grad_scaler(self)
        inputs, targets = batch_of_call(inputs, targets, closure)
        # Read once, checked: a user or a scheduler may have changed them since the last step.
        self._options = options = Options.of(self.param_groups[0], in_step=True)
        return self._stepper.step(options, inputs, targets, self._global_state())


# --- how SGN.step is called: a mini-batch, never a closure alone, never by a GradScaler -----
_LIGHTNING = (
    ". With PyTorch Lightning, set `self.automatic_optimization = False` in the "
    "LightningModule's __init__ and call `self.optimizers().step(inputs=x, targets=y)` in "
    "training_step (keywords: LightningOptimizer.step takes no positional batch)"
)
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
_GRAD_SCALER = (
    "SGN.step was called by a torch.amp.GradScaler (PyTorch Lightning: precision='16-mixed'). "
    "SGN computes its own loss, gradient and Gauss-Newton products at every step, so there is "
    "no scaled loss to unscale: drop the scaler and step under "
    "torch.autocast alone, with dtype=torch.bfloat16 (float32's range; Lightning: "
    "precision='bf16-mixed') or torch.float16 (its products are then not loss-scaled)"
)


def refuse_grad_scaler(optimizer: object) -> None:
    """Raises ``TypeError`` where a :class:`torch.amp.GradScaler` calls the step.

    An optimizer with ``_step_supports_amp_scaling`` (SGN has it) is stepped by
    ``GradScaler.step`` directly, with its scale and inf flag set as the attributes
    ``grad_scale`` and ``found_inf`` for the call: their presence says who called. Without the
    flag the scaler would first fail on its own, with an assertion that names no cause. The
    attributes are removed before the error (the scaler removes them only after a step that
    returns), so that the optimizer steps as before once the scaler is gone.

    Such a scaler (``scaler.step(opt, x, y)`` after ``scaler.scale(loss).backward()``, as a
    ``torch.amp`` training loop has it) scales a loss the user backpropagated and unscales its
    gradients, while SGN computes its own loss, gradient and curvature at every step: there is
    nothing for it to scale. (Lightning's ``precision="16-mixed"`` on CUDA never reaches SGN:
    its scaler fails first, having scaled no loss.)
    """
    present = [name for name in ("found_inf", "grad_scale") if hasattr(optimizer, name)]
    for name in present:
        delattr(optimizer, name)
    if present:
        raise TypeError(_GRAD_SCALER)


def batch_of_call(
    inputs: Optional[Inputs], targets: Optional[Tensor], closure: Optional[Callable[[], Any]]
) -> tuple[Optional[Inputs], Optional[Tensor]]:
    """The batch that ``SGN.step(inputs, targets, closure=closure)`` steps on.

    torch's optimizers take ``step(closure)``, a function that returns the loss. SGN needs the
    model's outputs and the targets (to form ``G = J^T H J``), so it takes the batch,
    positionally or by keyword. A closure given beside the batch is called once, with
    gradients enabled, before the step (where ``torch.optim`` optimizers call theirs); its
    value is not used. A closure without a batch, positional (``step(closure)``) or by keyword,
    raises ``TypeError`` with the reason.

    PyTorch Lightning's manual optimization, ``self.optimizers().step(inputs=x, targets=y)``,
    passes the batch as keywords together with a closure that it always builds (its precision
    plugin's wrapper around the user's closure, or around a no-op): calling it once keeps the
    ``on_before_optimizer_step`` hooks, and the trainer's step count, as with any optimizer.
    Lightning's automatic optimization calls ``step(closure=...)`` with no batch, which SGN
    cannot serve: the error says what to do instead.
    """
    alone = closure if inputs is None and targets is None else None
    if callable(inputs) and targets is None:  # torch's step(closure)
        alone = inputs
    if alone is not None:
        raise TypeError(NOT_A_CLOSURE + (_LIGHTNING if _from_lightning(alone) else ""))
    if closure is not None:
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        if targets is not None:  # else the step refuses the batch before anything ran
            with torch.enable_grad():
                closure()
    return inputs, targets


def _from_lightning(closure: Callable[[], Any]) -> bool:
    # Lightning's closures are functools.partial objects of its precision plugin's methods,
    # wrapping instances of its own Closure class.
    parts = [closure]
    if isinstance(closure, functools.partial):
        parts += [closure.func, *closure.args]
    modules = [getattr(p, "__module__", None) or type(p).__module__ for p in parts]
    return any(m.split(".")[0] in _LIGHTNING_PACKAGES for m in modules)
