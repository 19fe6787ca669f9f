"""A DeepXDE model's training loss as a :class:`torch_sgn.pinn.Residuals` problem.

DeepXDE's ``dde.data.PDE`` (and ``TimePDE``) minimizes the weighted sum of mean squared errors
of each PDE component on its collocation points and of each boundary or initial condition on
its own points. :func:`residuals_of` builds the same sum as residual blocks, one per PDE
component and one per condition (DeepXDE's ``loss_weights`` are the blocks' weights), over the
parameters of the network and of the model's external trainable variables (:class:`Network`).

Each block's points carry, beside the coordinates, what DeepXDE computes from them once (a
condition's values, the boundary normals), so that a block's row of one point depends on that
point alone, as :mod:`torch_sgn.pinn` requires; the PDE and the conditions' functions get their
derivatives from forward jets (:mod:`torch_sgn.deepxde.derivatives`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from contextlib import nullcontext
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..pinn.causal import Causal
from ..pinn.operators import derivative
from ..pinn.residuals import Residual, Residuals
from .derivatives import Answers, answering, chain_of, network_jet

__all__ = ["CONDITIONS", "Network", "Problem", "causal_of", "check_model"]

#: The conditions a problem takes, by DeepXDE class name.
CONDITIONS = (
    "DirichletBC", "NeumannBC", "RobinBC", "PeriodicBC", "OperatorBC", "PointSetBC",
    "PointSetOperatorBC", "IC",
)  # fmt: skip


def check_model(model) -> None:
    """Raises ``ValueError`` where SGN cannot take ``model`` (a ``dde.Model``), naming what to
    change: another backend, a data class other than ``PDE``/``TimePDE``, a condition it does
    not know, a regularizer, forward-mode autodiff or mixed precision."""
    import deepxde as dde

    if dde.backend.backend_name != "pytorch":
        raise ValueError(
            f"torch_sgn.deepxde needs DeepXDE's PyTorch backend, got "
            f"{dde.backend.backend_name!r}: set DDE_BACKEND=pytorch before importing deepxde"
        )
    data = getattr(model, "data", None)
    if not isinstance(data, dde.data.PDE) or type(data).__name__ not in ("PDE", "TimePDE"):
        raise ValueError(
            f"torch_sgn.deepxde takes dde.data.PDE and dde.data.TimePDE problems, got "
            f"{type(data).__name__}; train this model with DeepXDE's own optimizers"
        )
    for bc in data.bcs:
        if type(bc).__name__ not in CONDITIONS:
            raise ValueError(
                f"torch_sgn.deepxde does not know the condition {type(bc).__name__}; it takes "
                f"{', '.join(CONDITIONS)}"
            )
    if getattr(model.net, "regularizer", None) is not None:
        raise ValueError(
            f"torch_sgn.deepxde takes no regularizer (the net has {model.net.regularizer!r}): "
            "build the network with regularization=None"
        )
    if dde.config.autodiff != "reverse" or dde.config.mixed:
        raise ValueError(
            "torch_sgn.deepxde takes DeepXDE's default autodiff='reverse' without mixed "
            "precision (its own derivatives replace dde.grad's)"
        )


def causal_of(model, causal: Union[bool, Causal, None]) -> Optional[Causal]:
    """The causal weighting of a ``dde.data.TimePDE`` model's PDE blocks along its time
    coordinate (the last column of ``GeometryXTime``'s points), or ``None`` for ``False`` /
    ``None``.

    Args:
        model: the DeepXDE model.
        causal: ``True`` (:class:`~torch_sgn.pinn.Causal`'s defaults), a
            :class:`~torch_sgn.pinn.Causal` (its ``span``, where ``None``, the time domain's
            ``(t0, t1)``), or ``False`` / ``None``.

    Returns:
        The :class:`~torch_sgn.pinn.Causal` the PDE blocks take, or ``None``.

    Raises:
        ValueError: causal weighting of a model that is not time-dependent (data other than
            ``dde.data.TimePDE`` on a ``GeometryXTime``), or a ``Causal`` whose ``time`` is
            not the last column.
        TypeError: ``causal`` neither a bool nor a :class:`~torch_sgn.pinn.Causal`.
    """
    if causal is None or causal is False:
        return None
    if causal is not True and not isinstance(causal, Causal):
        raise TypeError(
            f"causal must be True, False or a torch_sgn.pinn.Causal, got {type(causal).__name__}"
        )
    import deepxde as dde

    data = getattr(model, "data", None)
    geometry = getattr(data, "geom", None)
    if not isinstance(data, dde.data.TimePDE) or not isinstance(
        geometry, dde.geometry.GeometryXTime
    ):
        raise ValueError(
            f"causal weighting is along time: it needs a dde.data.TimePDE model on a "
            f"dde.geometry.GeometryXTime, got {type(data).__name__} on "
            f"{type(geometry).__name__}; leave causal=False for this model"
        )
    columns = geometry.dim
    setting = Causal() if causal is True else causal
    if setting.time not in (-1, columns - 1):
        raise ValueError(
            f"Causal(time={setting.time}): DeepXDE's time is the last of the points' {columns} "
            f"columns; use time=-1"
        )
    if setting.span is None:
        domain = geometry.timedomain
        setting = dataclasses.replace(setting, span=(float(domain.t0), float(domain.t1)))
    return setting


class Network(nn.Module):
    """DeepXDE's network and the model's external trainable variables (``dde.Variable``), the
    parameters SGN fits. The variables become parameters that share their storage, so a step
    changes the ``dde.Variable`` itself (``dde.callbacks.VariableValue`` reports it); while a
    PDE runs (:meth:`substituted`), its references to a variable read the parameter, so that
    SGN's functional evaluations see the values they set."""

    def __init__(self, net: nn.Module, variables: Sequence[Tensor]):
        super().__init__()
        self.net = net
        self.variables = nn.ParameterList(nn.Parameter(v.detach()) for v in variables)
        self._originals = list(variables)
        # not a submodule (its nn.Linear modules are net's own): set past Module.__setattr__
        self.__dict__["chain"] = chain_of(net)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def jet(self, x: Tensor, pairs: Sequence[Tuple[int, int]]):
        """The network's value, gradient and second partials ``pairs`` at ``x``."""
        return network_jet(self.net, self.chain, x, pairs)

    def along(self, x: Tensor, dim: int, order: int) -> Tensor:
        """The network's derivative of ``order`` (3 or 4) along coordinate ``dim`` at ``x``:
        forward through the chain where there is one and no output transform, else by
        ``torch.func``."""
        if self.chain is not None and getattr(self.net, "_output_transform", None) is None:
            return derivative(self.chain, x, dim, order)
        return derivative(self.net, x, dim, order, method="func")

    def answers(self, x: Tensor, pairs: Sequence[Tuple[int, int]]) -> Answers:
        """:class:`~torch_sgn.deepxde.derivatives.Answers` at ``x`` from this network's jets."""
        return Answers(x, lambda p: self.jet(x, p), sorted(pairs), lambda d, k: self.along(x, d, k))

    def substituted(self):
        """A context in which the variables' references read :attr:`variables`."""
        if not self._originals:
            return nullcontext()
        return _Substitute({id(v): p for v, p in zip(self._originals, self.variables)})


class _Substitute(TorchFunctionMode):
    def __init__(self, mapping: Dict[int, Tensor]):
        super().__init__()
        self.mapping = mapping

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def swap(t):
            return self.mapping.get(id(t), t) if isinstance(t, Tensor) else t

        return func(*tree_map(swap, args), **tree_map(swap, kwargs or {}))


class Problem:
    """The residual blocks of ``model`` (a ``dde.Model`` with ``dde.data.PDE`` or ``TimePDE``
    data): :attr:`residuals` is the :class:`~torch_sgn.pinn.Residuals` SGN steps on, its
    points read from DeepXDE's training points at each :meth:`refresh`.

    Args:
        model: the DeepXDE model (``dde.Model``, PyTorch backend).
        variables: its external trainable variables (an inverse problem's unknowns).
        weights: the loss weights, one per PDE component and condition (``None``: all 1).
        causal: causal weighting of each PDE block along time (:func:`causal_of`: ``True``,
            a :class:`~torch_sgn.pinn.Causal`, or ``False``); the conditions' blocks are not
            weighted.

    Raises:
        ValueError: a model the adapter does not take (:func:`check_model` says why),
            ``weights`` of another length than the model's losses, or causal weighting of a
            model that is not time-dependent.
    """

    def __init__(
        self,
        model: object,
        variables: Sequence[Tensor],
        weights: Optional[Sequence[float]],
        causal: Union[bool, Causal, None] = False,
    ):
        check_model(model)
        causal = causal_of(model, causal)
        self.model, self.data = model, model.data
        self.network = Network(model.net, variables)
        self._pairs: Dict[str, Set[Tuple[int, int]]] = {}  # the second partials each asks for
        pde_count = self._pde_count()
        count = pde_count + len(self.data.bcs)
        weights = [1.0] * count if weights is None else [float(w) for w in weights]
        if len(weights) != count:
            raise ValueError(
                f"loss_weights has {len(weights)} entries; this model has {count} losses "
                f"({pde_count} PDE components and {len(self.data.bcs)} conditions)"
            )
        self._tensors: Dict[str, Tuple[Tensor, ...]] = {}
        self._seen = None
        blocks: Dict[str, Residual] = {}
        for c in range(pde_count):
            name = "pde" if pde_count == 1 else f"pde{c}"
            blocks[name] = self._block(name, self._pde_fn(name, c), weights[c], causal)
        for i, bc in enumerate(self.data.bcs):
            name = f"bc{i}_{type(bc).__name__}"
            blocks[name] = self._block(name, self._bc_fn(name, bc), weights[pde_count + i])
        self.names = list(blocks)
        self.refresh()
        self.residuals = Residuals(self.network, blocks)

    # --- points ---------------------------------------------------------------------------------
    def _block(
        self, name: str, fn: Callable, weight: float, causal: Optional[Causal] = None
    ) -> Residual:
        def mean_of_row(u: Network, *points: Tensor) -> Tensor:
            r = fn(u, *points)  # DeepXDE's MSE is the mean of all k entries of a point's row
            k = r[0].numel() if r.dim() > 1 else 1
            return r if k == 1 else r / math.sqrt(k)

        return Residual(
            mean_of_row, weight=weight, sample=lambda step: self._tensors[name], causal=causal
        )

    def refresh(self) -> bool:
        """Reads DeepXDE's training points where they changed (a first batch, a resampling).

        Returns:
            Whether they changed.
        """
        data = self.data
        if data.train_x is None:
            data.train_next_batch()
        if data.train_x is self._seen:
            return False
        x = data.train_x
        starts = np.cumsum([0] + list(data.num_bcs)).astype(int)
        dtype = next(self.network.net.parameters()).dtype

        def as_tensor(a) -> Tensor:
            return torch.tensor(np.asarray(a), dtype=dtype).reshape(len(a), -1)

        out: Dict[str, Tuple[Tensor, ...]] = {}
        pde_names = [n for n in self.names if n.startswith("pde")]
        aux = getattr(data, "train_aux_vars", None)
        for name in pde_names:
            rest = x[starts[-1] :]
            out[name] = (as_tensor(rest),)
            if data.auxiliary_var_fn is not None:
                out[name] += (as_tensor(aux[starts[-1] :]),)
        for i, (bc, name) in enumerate(zip(data.bcs, self.names[len(pde_names) :])):
            beg, end = int(starts[i]), int(starts[i + 1])
            out[name] = tuple(as_tensor(t) for t in _condition_data(bc, x, beg, end))
        self._tensors, self._seen = out, x
        return True

    def _pde_count(self) -> int:
        data = self.data
        if data.pde is None:
            return 0
        if data.train_x is None:
            data.train_next_batch()
        start = int(np.sum(data.num_bcs))
        dtype = next(self.model.net.parameters()).dtype
        x = torch.as_tensor(data.train_x[start : start + 2], dtype=dtype)
        aux = None
        if data.auxiliary_var_fn is not None:
            aux = torch.as_tensor(data.train_aux_vars[start : start + 2], dtype=dtype)
        with torch.no_grad():
            return len(self._run_pde(x, aux))

    # --- residuals ------------------------------------------------------------------------------
    def _run_pde(self, x: Tensor, aux: Optional[Tensor]) -> List[Tensor]:
        """The PDE's components at ``x``, its derivatives from one jet (the second partials
        it asked for before; the PDE's components share them)."""
        network = self.network
        pairs = self._pairs.setdefault("pde", set())
        answers = network.answers(x, pairs)
        with network.substituted(), answering(answers):
            if aux is None:
                f = self.data.pde(x, answers.value)
            else:
                f = self.data.pde(x, answers.value, aux)
        pairs |= answers.asked
        return list(f) if isinstance(f, (list, tuple)) else [f]

    def _pde_fn(self, name: str, c: int) -> Callable:
        def fn(u: Network, x: Tensor, *aux: Tensor) -> Tensor:
            return self._run_pde(x, aux[0] if aux else None)[c]

        return fn

    def _bc_fn(self, name: str, bc) -> Callable:
        kind = type(bc).__name__
        pairs = self._pairs.setdefault(name, set())

        def component(y: Tensor) -> Tensor:
            c = bc.component
            return y[:, c : c + 1] if isinstance(c, numbers.Number) else y[:, list(c)]

        if kind in ("DirichletBC", "IC"):
            return lambda u, x, v: component(u(x)) - v
        if kind == "PointSetBC":
            return lambda u, x, v: component(u(x)) - v
        if kind == "NeumannBC":

            def neumann(u: Network, x: Tensor, normal: Tensor, v: Tensor) -> Tensor:
                g = u.jet(x, ()).gradient[:, bc.component, :]
                return (g * normal).sum(1, keepdim=True) - v

            return neumann
        if kind == "RobinBC":

            def robin(u: Network, x: Tensor, normal: Tensor) -> Tensor:
                j = u.jet(x, ())
                g = j.gradient[:, bc.component, :]
                return (g * normal).sum(1, keepdim=True) - bc.func(_numpy(x), j.value)

            return robin
        if kind == "PeriodicBC":

            def periodic(u: Network, left: Tensor, right: Tensor) -> Tensor:
                c = bc.component
                if bc.derivative_order == 0:
                    return u(left)[:, c : c + 1] - u(right)[:, c : c + 1]
                gl, gr = u.jet(left, ()).gradient, u.jet(right, ()).gradient
                k = bc.component_x
                return gl[:, c, k : k + 1] - gr[:, c, k : k + 1]

            return periodic

        def operator(u: Network, x: Tensor, *v: Tensor) -> Tensor:  # OperatorBC, PointSet...
            answers = u.answers(x, pairs)
            with u.substituted(), answering(answers):
                r = bc.func(x, answers.value, _numpy(x))
            pairs.update(answers.asked)
            return r - v[0] if v else r

        return operator


def _condition_data(bc, x: np.ndarray, beg: int, end: int) -> List[object]:
    """A condition's per-point tensors on DeepXDE's training points ``x[beg:end]``: the points,
    and what its error reads of them (values, normals), computed as DeepXDE computes them."""
    kind = type(bc).__name__
    points = x[beg:end]
    n = len(points)
    if kind in ("DirichletBC", "IC"):
        return [points, _plain(bc.func(x, beg, end, None), n)]
    if kind == "NeumannBC":
        normal = _plain(bc.boundary_normal(x, beg, end, None), n)
        return [points, normal, _plain(bc.func(x, beg, end, None), n)]
    if kind == "RobinBC":
        return [points, _plain(bc.boundary_normal(x, beg, end, None), n)]
    if kind == "PeriodicBC":
        mid = beg + (end - beg) // 2
        return [x[beg:mid], x[mid:end]]
    if kind in ("PointSetBC", "PointSetOperatorBC"):
        values = bc.values
        if getattr(bc, "batch_size", None) is not None:
            values = values[bc.batch_indices]
        return [points, _plain(values, n)]
    return [points]  # OperatorBC


def _plain(t, n: int) -> np.ndarray:
    """``t`` (a tensor or array of ``n`` rows, or one value for all) as ``n`` rows."""
    a = t.detach().cpu().numpy() if isinstance(t, Tensor) else np.asarray(t)
    if a.ndim == 0 or a.shape[0] != n:
        a = np.broadcast_to(a, (n, *(a.shape[1:] if a.ndim > 1 else (1,))))
    return a.reshape(n, -1)


def _numpy(x: Tensor):
    """``x`` as DeepXDE hands a condition's function its points (a NumPy array): the points'
    values under ``torch.func``'s forward and reverse transforms too; ``x`` itself where they
    cannot leave torch (one point of a ``vmap``)."""
    functorch = getattr(torch._C, "_functorch", None)
    disable = getattr(torch._C, "_DisableFuncTorch", None)
    try:
        if functorch is None or disable is None:
            return x.detach().cpu().numpy()
        with disable():
            t = x
            while functorch.is_functorch_wrapped_tensor(t):
                if functorch.is_batchedtensor(t):
                    return x
                t = functorch.get_unwrapped(t)
            return t.detach().cpu().numpy()
    except (RuntimeError, TypeError, ValueError):
        return x
