"""SGN as a DeepXDE optimizer: ``model.compile(torch_sgn.deepxde.SGN(model))``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, List, Optional, Union

import torch
from torch import Tensor

from ..optimizer import SGN as _SGN
from ..pinn.causal import Causal
from ..step_info import StepInfo
from .problem import Problem, causal_of, check_model

if TYPE_CHECKING:
    import deepxde

__all__ = ["SGN"]


class SGN(torch.optim.Optimizer):
    """SGN for a DeepXDE model, in DeepXDE's own training loop.

    ::

        model = dde.Model(data, net)
        model.compile(torch_sgn.deepxde.SGN(model), loss_weights=[1, 10])
        losshistory, train_state = model.train(iterations=1000)

    Each of DeepXDE's iterations is one SGN step (:class:`torch_sgn.SGN`, with ``options``) on
    the model's loss, the weighted sum of the mean squared residuals of every PDE component and
    every condition on DeepXDE's training points, as a :class:`torch_sgn.pinn.Residuals`
    problem (:mod:`torch_sgn.deepxde.problem`): exact Gauss-Newton steps, their derivatives
    from forward jets. The parameters are the network's and those of ``compile``'s
    ``external_trainable_variables``; ``loss_weights`` weight the blocks. DeepXDE's callbacks,
    display, ``LossHistory``, ``model.predict``, ``model.save``/``restore`` (this optimizer's
    state dict) and later ``compile``/``train`` calls work as with its own optimizers. A
    ``PDEPointResampler`` or :class:`~torch_sgn.deepxde.ResidualPoints` changes the points
    between steps.

    With ``causal``, each PDE block of a ``dde.data.TimePDE`` is weighted along time
    (:class:`torch_sgn.pinn.Causal`; Wang, Sankaran and Perdikaris, 2022): each point by its
    time slab's weight, recomputed from the current parameters before each step and held
    through it. SGN then minimizes the causally weighted loss (:attr:`last_info`'s ``loss``,
    and what :meth:`step` returns), while DeepXDE's display and ``LossHistory`` keep showing
    DeepXDE's own loss terms, unweighted along time: the loss the causal weighting is a means
    to lower.

    Args:
        model: a ``dde.Model`` with ``dde.data.PDE`` or ``dde.data.TimePDE`` data and
            DeepXDE's PyTorch backend.
        balance: at the first step, divide each loss term's weight by that term's value
            (its mean squared residual on the first step's points), so that every term starts
            at its weight, and keep these scales for the rest of the run (they are in the
            state dict). For a problem whose terms start orders of magnitude apart (an
            inverse problem's PDE beside its observations): see docs/PINN.md's PINNacle
            section for the rule and what it measured. DeepXDE's display and
            ``LossHistory`` still show its own, unscaled loss terms.
        causal: ``True`` to weight the PDE blocks causally along time with
            :class:`~torch_sgn.pinn.Causal`'s defaults, a :class:`~torch_sgn.pinn.Causal`
            for other slabs or ``epsilon`` (its ``span`` defaults to the time domain), or
            ``False`` (the default): no weighting.
        **options: keyword arguments of :class:`torch_sgn.SGN` (``solver``, ``damping``, ...).

    Raises:
        TypeError: ``balance`` not ``True`` or ``False``.
        ValueError: a model SGN cannot take (another backend, data class or condition, a
            regularizer), or ``causal`` on a model that is not time-dependent, at once; at
            the first step, a ``compile`` loss other than ``"MSE"`` (DeepXDE's loss and the
            residuals' then differ; the parameters are not changed).

    Attributes:
        last_info: the :class:`~torch_sgn.StepInfo` of the last step.
        scales: with ``balance``, each loss term's scale (``1 / its value at the first
            step``; 1 for a term that starts at zero) once the first step has set them,
            else ``None``.
    """

    def __init__(
        self,
        model: deepxde.Model,
        balance: bool = False,
        causal: Union[bool, Causal, None] = False,
        **options,
    ):
        check_model(model)
        if not isinstance(balance, bool):
            raise TypeError(f"balance must be True or False, got {balance!r}")
        self.model, self.balance = model, balance
        self.scales: Optional[List[float]] = None
        self.causal = causal_of(model, causal)
        # The functional engine: DeepXDE's functions (NumPy inside) seldom trace.
        self.options = {"engine": "functional", **options}
        self.last_info: Optional[StepInfo] = None
        self._built: Optional[tuple] = None
        self._checked = False
        self._build([], None)
        super().__init__(self.problem.residuals.parameters(), {})
        self._share()

    def _build(self, variables: List[Tensor], weights) -> None:
        self.problem = Problem(self.model, variables, weights, self.causal)
        self._weights = [block.weight for block in self.problem.residuals.blocks]
        if self.scales is not None:
            self._apply_scales()
        self.sgn = _SGN(self.problem.residuals, self.problem.residuals.loss, **self.options)
        self._built = (tuple(id(v) for v in variables), None if weights is None else list(weights))

    def _share(self) -> None:
        self.param_groups = self.sgn.param_groups
        self.state = self.sgn.state

    def _sync(self) -> None:
        """Takes what ``compile`` set after this optimizer was built: its external trainable
        variables (a new problem, before any step) and loss weights."""
        variables = list(getattr(self.model, "external_trainable_variables", None) or [])
        weights = getattr(self.model, "loss_weights", None)
        weights = None if weights is None else [float(w) for w in weights]
        if self._built == (tuple(id(v) for v in variables), weights):
            return
        if self._built[0] == tuple(id(v) for v in variables):
            self._reweight(weights)
            return
        extra = {k: v for k, v in self.param_groups[0].items() if k not in self.sgn.defaults}
        extra.pop("params", None)
        self._build(variables, weights)
        self.param_groups[0].update(extra)  # e.g. a scheduler's initial_lr
        self._share()
        self._checked = False

    def _reweight(self, weights) -> None:
        blocks = self.problem.residuals.blocks
        new = [1.0] * len(blocks) if weights is None else weights
        if len(new) != len(blocks):
            raise ValueError(
                f"loss_weights has {len(new)} entries; this model has {len(blocks)} losses"
            )
        self._weights = [float(w) for w in new]
        self._apply_scales()
        self._built = (self._built[0], weights)
        self._checked = False

    def _apply_scales(self) -> None:
        """The blocks' weights: DeepXDE's loss weights times :attr:`scales` (where set)."""
        scales = self.scales or [1.0] * len(self._weights)
        for block, w, s in zip(self.problem.residuals.blocks, self._weights, scales):
            block.weight = w * s

    def _set_scales(self, inputs) -> None:
        losses = list(self.problem.residuals.losses(inputs).values())
        if not all(math.isfinite(v) for v in losses):
            return  # the step's own check names the blocks that are not finite
        self.scales = [1.0 / v if v > 0 else 1.0 for v in losses]
        self._apply_scales()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Tensor:
        """One SGN step on DeepXDE's current training points.

        Args:
            closure: DeepXDE's closure (its loss, with a backward pass); called once, at the
                first step, to check that DeepXDE's loss is the residuals' loss, and not
                needed after.

        Returns:
            The loss before the step (a 0-d tensor, as DeepXDE's loop reads it); the step's
            full record is :attr:`last_info`.

        Raises:
            ValueError: at the first step, DeepXDE's loss differs from the residuals' (a
                ``compile`` loss other than ``"MSE"``); nothing is changed.
            FloatingPointError: the loss is not finite (the message names the residual blocks
                and the points where the residuals are not); nothing is changed.
        """
        self._sync()
        self.problem.refresh()
        residuals = self.problem.residuals
        inputs, targets = residuals.batch()
        if closure is not None and not self._checked:
            self._check_loss(closure, inputs, targets)
        if self.balance and self.scales is None:
            self._set_scales(inputs)
        self.last_info = self.sgn.step(inputs, targets)
        return torch.tensor(self.last_info.loss)

    def _check_loss(self, closure: Callable[[], Tensor], inputs, targets) -> None:
        with torch.enable_grad():
            theirs = float(closure().detach())
        residuals = self.problem.residuals
        # DeepXDE's loss: its own weights on the blocks' unweighted means (no balance scales,
        # no causal weights along time)
        means = residuals.losses(inputs)
        ours = sum(w * means[name] for name, w in zip(residuals.names, self._weights))
        dtype = next(residuals.parameters()).dtype
        tol = 1e-3 if dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-8
        if not (math.isfinite(theirs) and math.isfinite(ours)):
            where = residuals.non_finite(inputs)
            raise FloatingPointError(
                f"DeepXDE's loss on these points is {theirs:.6g}, the residual blocks' weighted "
                f"mean squares are {ours:.6g}"
                + (f": the residuals are not finite in {where}" if where else "")
                + " (nothing was changed)"
            )
        if not math.isclose(theirs, ours, rel_tol=tol, abs_tol=1e-30):
            raise ValueError(
                f"DeepXDE's loss on these points is {theirs:.6g}, the residual blocks' weighted "
                f"mean squares are {ours:.6g}: torch_sgn.deepxde.SGN minimizes DeepXDE's "
                "loss='MSE' (the default of model.compile); compile with it (nothing was "
                "changed)"
            )
        self._checked = True

    def state_dict(self) -> dict:
        """The state of the SGN optimizer inside, as ``model.save`` stores it.

        Returns:
            :meth:`torch_sgn.SGN.state_dict` of the SGN optimizer this one drives, with
            ``"balance_scales"`` beside where ``balance`` has set :attr:`scales`.
        """
        state = self.sgn.state_dict()
        if self.scales is not None:
            state = {**state, "balance_scales": list(self.scales)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state :meth:`state_dict` returned, after taking ``compile``'s settings.

        Args:
            state_dict: the state, as :meth:`state_dict` returned it.
        """
        self._sync()
        state_dict = dict(state_dict)
        scales = state_dict.pop("balance_scales", None)
        self.sgn.load_state_dict(state_dict)
        if scales is not None:
            self.scales = [float(v) for v in scales]
            self._apply_scales()
        self._share()
