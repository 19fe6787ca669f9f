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
    ``PDEPointResampler`` changes the points between steps.

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
        causal: ``True`` to weight the PDE blocks causally along time with
            :class:`~torch_sgn.pinn.Causal`'s defaults, a :class:`~torch_sgn.pinn.Causal`
            for other slabs or ``epsilon`` (its ``span`` defaults to the time domain), or
            ``False`` (the default): no weighting.
        **options: keyword arguments of :class:`torch_sgn.SGN` (``solver``, ``damping``, ...).

    Raises:
        ValueError: a model SGN cannot take (another backend, data class or condition, a
            regularizer), or ``causal`` on a model that is not time-dependent, at once; at
            the first step, a ``compile`` loss other than ``"MSE"`` (DeepXDE's loss and the
            residuals' then differ; the parameters are not changed).

    Attributes:
        last_info: the :class:`~torch_sgn.StepInfo` of the last step.
    """

    def __init__(self, model: deepxde.Model, causal: Union[bool, Causal, None] = False, **options):
        check_model(model)
        self.model = model
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
        for block, w in zip(blocks, new):
            block.weight = float(w)
        self._built = (self._built[0], weights)
        self._checked = False

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
        self.last_info = self.sgn.step(inputs, targets)
        return torch.tensor(self.last_info.loss)

    def _check_loss(self, closure: Callable[[], Tensor], inputs, targets) -> None:
        with torch.enable_grad():
            theirs = float(closure().detach())
        residuals = self.problem.residuals
        if self.causal is None:
            ours = float(residuals.loss(residuals(*inputs), targets))
        else:  # DeepXDE's loss is not weighted along time
            means = residuals.losses(inputs)
            ours = sum(b.weight * means[name] for name, b in zip(residuals.names, residuals.blocks))
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
            :meth:`torch_sgn.SGN.state_dict` of the SGN optimizer this one drives.
        """
        return self.sgn.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state :meth:`state_dict` returned, after taking ``compile``'s settings.

        Args:
            state_dict: the state, as :meth:`state_dict` returned it.
        """
        self._sync()
        self.sgn.load_state_dict(state_dict)
        self._share()
