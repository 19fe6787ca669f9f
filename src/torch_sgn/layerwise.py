r"""The fast curvature engine: ``G v`` for chains of known layers at about one gradient.

The functional engine (:class:`torch_sgn.functional.FunctionalEngine`) works for any model
but re-runs the forward pass with forward-mode AD at every product. For an
:class:`~torch.nn.Sequential` of known layers this module runs **one** forward pass per step,
keeps what each layer needs, and then per CG iteration only propagates

* tangents forward by hand (``J v``): a linear layer maps ``(a, t)`` to
  ``W t + dW a + db``, an activation multiplies by ``f'(z)`` computed once per step, max
  pooling gathers with the stored indices, dropout multiplies by the stored mask;
* cotangents backward (``J^T u``, and the gradient itself) by hand as well: a linear layer
  by two matrix products, a zero-padded convolution by ``aten.convolution_backward``, max
  pooling by a scatter-add at the stored indices. A chain with a layer that has no hand-made
  cotangent (average pooling, other padding modes) goes backward through the autograd graph
  of that same forward pass instead.

So a product costs a tangent forward plus one backward pass, against a forward plus a backward
for a gradient. The loss at the trust region's and line search's trial points is a plain
forward pass through the same chain (no autograd, the recorded dropout masks). With
``cuda_graphs`` the by-hand work is captured and replayed (:mod:`torch_sgn.graphs`).

:class:`LayerwiseEngine` is the engine of ``engine="fast"`` and ``"auto"`` (see
:mod:`torch_sgn.engines`); where the model is not such a chain it raises (``"fast"``) or
hands over to the functional engine with a one-time warning (``"auto"``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import graphs
from .diagnostics import warn
from .functional import FunctionalEngine, FunctionalModel
from .linearization import Batch, Linearization, loss_and_output_gradient
from .losses import OutputLoss

# A parameter slot of a layer: an index into the trainable parameters, a frozen tensor, or None.
_Slot = Union[int, Tensor, None]


class Unsupported(Exception):
    """The fast engine cannot evaluate this model; the message says why."""


# --- layers ------------------------------------------------------------------------------------
class _Step:
    """One layer of the chain: a recorded forward pass and its tangent map."""

    def forward(self, a: Tensor, params: Sequence[Tensor]) -> Tuple[Tensor, object]:
        raise NotImplementedError

    def tangent(self, ctx: object, t: Optional[Tensor], vs: Sequence[Tensor]) -> Optional[Tensor]:
        raise NotImplementedError

    def value(self, ctx: object, a: Tensor, params: Sequence[Tensor]) -> Tensor:
        """The layer's output at other parameters, with the recorded random numbers."""
        raise NotImplementedError

    #: whether :meth:`cotangent` is implemented (else products go through autograd)
    by_hand = True
    #: whether the layer has trainable parameters
    trainable = False

    def cotangent(
        self, ctx: object, u: Tensor, grads: List[Optional[Tensor]], need_input: bool
    ) -> Optional[Tensor]:
        """``J^T u`` for this layer: accumulates parameter cotangents into ``grads`` (by slot)
        and returns the input's cotangent (``None`` when ``need_input`` is false)."""
        raise NotImplementedError


def _accumulate(grads: List[Optional[Tensor]], slot: _Slot, g: Tensor) -> None:
    if isinstance(slot, int):  # frozen or absent parameters take no cotangent
        grads[slot] = g if grads[slot] is None else grads[slot] + g  # tied weights add up


def _get(slot: _Slot, values: Sequence[Tensor]) -> Optional[Tensor]:
    return values[slot] if isinstance(slot, int) else slot


def _tangent_of(slot: _Slot, vs: Sequence[Tensor]) -> Optional[Tensor]:
    return vs[slot] if isinstance(slot, int) else None  # frozen or absent: no tangent


class _Affine(_Step):
    """Linear and convolution layers: ``z = op(a, W) + b``, linear in ``a`` and in ``(W, b)``."""

    def __init__(self, module: nn.Module, slots: Tuple[_Slot, _Slot]):
        self.module = module
        self.weight, self.bias = slots
        self.trainable = any(isinstance(slot, int) for slot in slots)
        if isinstance(module, nn.Linear):
            self.op = F.linear
        else:
            self.op = module._conv_forward  # handles padding modes
        self.bias_shape = (
            (-1,) if isinstance(module, nn.Linear) else (-1,) + (1,) * (len(module.kernel_size))
        )

    @property
    def by_hand(self) -> bool:  # read at every step: the module's settings may change
        m = self.module
        # A convolution by hand only where it is one aten op (zero padding in numbers or
        # "valid"); other padding modes and "same" pad first: those go through autograd.
        return isinstance(m, nn.Linear) or (m.padding_mode == "zeros" and m.padding != "same")

    def forward(self, a, params):
        w = _get(self.weight, params)
        z = self.op(a, w, _get(self.bias, params))
        return z, (a.detach(), w.detach(), z.shape)

    def value(self, ctx, a, params):
        return self.op(a, _get(self.weight, params), _get(self.bias, params))

    def tangent(self, ctx, t, vs):
        a, w, shape = ctx
        dw, db = _tangent_of(self.weight, vs), _tangent_of(self.bias, vs)
        out = None
        if dw is not None:
            out = self.op(a, dw, db)  # dW a + db
        elif db is not None:  # a frozen weight: db alone, broadcast to the output's shape
            out = db.view(self.bias_shape).expand(shape)
        if t is not None:
            wt = self.op(t, w, None)  # W t
            out = wt if out is None else out + wt
        return out

    def _conv_backward(self, u: Tensor, a: Tensor, w: Tensor, need_input: bool):
        """A convolution's cotangents, as autograd would compute them (one aten op)."""
        m = self.module
        dims = len(m.kernel_size)
        unbatched = a.dim() == dims + 1  # (C, *spatial): the op wants a batch dimension
        if unbatched:
            a, u = a.unsqueeze(0), u.unsqueeze(0)
        mask = [need_input, isinstance(self.weight, int), isinstance(self.bias, int)]
        ga, gw, gb = torch.ops.aten.convolution_backward(
            u, a, w, [m.out_channels] if m.bias is not None else None, list(m.stride),
            [0] * dims if m.padding == "valid" else list(m.padding), list(m.dilation),
            False, [0] * dims, m.groups, mask,
        )  # fmt: skip
        return (ga.squeeze(0) if unbatched and ga is not None else ga), gw, gb

    def cotangent(self, ctx, u, grads, need_input):
        a, w, _ = ctx
        if self.op is not F.linear:
            ga, gw, gb = self._conv_backward(u, a, w, need_input)
            _accumulate(grads, self.weight, gw)
            _accumulate(grads, self.bias, gb)
            return ga
        u2 = u.reshape(-1, u.shape[-1])  # nn.Linear: z = a W^T + b
        _accumulate(grads, self.weight, u2.T @ a.reshape(-1, a.shape[-1]))
        _accumulate(grads, self.bias, u2.sum(0))
        return u @ w if need_input else None


class _Elementwise(_Step):
    """``y = f(z)`` elementwise: the tangent is ``f'(z) t``, ``f'`` evaluated once per step."""

    def __init__(self, fn: Callable[[Tensor], Tensor], derivative: Optional[Callable]):
        self.fn = fn
        self.derivative = derivative  # (z, y) -> f'(z); None: by autograd

    def forward(self, z, params):
        y = self.fn(z)
        with torch.no_grad():
            if self.derivative is not None:
                d = self.derivative(z.detach(), y.detach())
            else:
                with torch.enable_grad():
                    zz = z.detach().requires_grad_(True)
                    (d,) = torch.autograd.grad(self.fn(zz).sum(), zz)
        return y, d

    def tangent(self, d, t, vs):
        return None if t is None else t * d

    def value(self, d, z, params):
        return self.fn(z)

    def cotangent(self, d, u, grads, need_input):
        return u * d if need_input else None


class _ReLU(_Elementwise):
    """ReLU: ``f'(z) t`` keeps ``t`` where the output is positive. The output itself is the
    context (the next layer usually keeps it anyway), applied as a mask by the kernel autograd
    uses, ``threshold_backward``: cheaper on a CPU than a stored boolean mask, which must be
    converted to floats in every product."""

    def __init__(self) -> None:
        super().__init__(torch.relu, None)

    def forward(self, z, params):
        y = torch.relu(z)
        return y, y.detach()

    def tangent(self, y, t, vs):
        return None if t is None else torch.ops.aten.threshold_backward(t, y, 0)

    def cotangent(self, y, u, grads, need_input):
        return torch.ops.aten.threshold_backward(u, y, 0) if need_input else None


class _MaxPool(_Step):
    """Max pooling: the tangent is gathered at the stored argmax indices (flat over the pooled
    dimensions), the cotangent scattered back to them."""

    def __init__(self, module: nn.Module, dims: int):
        self.module = module
        self.dims = dims
        self.pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[dims]

    def forward(self, a, params):
        m = self.module
        y, idx = self.pool(
            a, m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode,
            return_indices=True,
        )  # fmt: skip
        return y, (idx, a.shape)

    def value(self, ctx, a, params):
        return self.module(a)

    def tangent(self, ctx, t, vs):
        if t is None:
            return None
        idx, _ = ctx
        return t.flatten(-self.dims).gather(-1, idx.flatten(-self.dims)).view(idx.shape)

    def cotangent(self, ctx, u, grads, need_input):
        if not need_input:
            return None
        idx, shape = ctx
        flat = u.new_zeros(shape).flatten(-self.dims)
        # Overlapping windows may pick one input twice: their cotangents add up.
        flat.scatter_add_(-1, idx.flatten(-self.dims), u.flatten(-self.dims))
        return flat.view(shape)


class _Linear(_Step):
    """A parameter-free linear map (flatten, average pooling, identity): the tangent is the map."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.by_hand = isinstance(module, (nn.Flatten, nn.Unflatten, nn.Identity))

    def forward(self, a, params):
        return self.module(a), a.shape

    def tangent(self, ctx, t, vs):
        return None if t is None else self.module(t)

    def value(self, ctx, a, params):
        return self.module(a)

    def cotangent(self, shape, u, grads, need_input):  # a reshape: its adjoint reshapes back
        return u.reshape(shape) if need_input else None


class _Dropout(_Step):
    """Dropout: in training mode the mask is drawn once and applied to values and tangents.

    ``module(ones)`` draws the same random numbers as ``module(a)`` would, so a step with this
    engine leaves the random state where the functional engine leaves it.
    """

    def __init__(self, module: nn.Module):
        self.module = module

    def forward(self, a, params):
        if not self.module.training:
            return a, None
        mask = self.module(torch.ones_like(a, requires_grad=False)).detach()
        return a * mask, mask

    def tangent(self, mask, t, vs):
        return t if mask is None or t is None else t * mask

    def value(self, mask, a, params):
        return a if mask is None else a * mask

    def cotangent(self, mask, u, grads, need_input):
        if not need_input:
            return None
        return u if mask is None else u * mask


_ACTIVATIONS: dict = {
    nn.Sigmoid: lambda m: (torch.sigmoid, lambda z, y: y * (1 - y)),
    nn.Tanh: lambda m: (torch.tanh, lambda z, y: 1 - y * y),
    nn.LeakyReLU: lambda m: (
        lambda z: F.leaky_relu(z, m.negative_slope),
        lambda z, y: torch.where(z > 0, 1.0, m.negative_slope).to(z.dtype),
    ),
    nn.ELU: lambda m: (
        lambda z: F.elu(z, m.alpha),
        lambda z, y: torch.where(z > 0, torch.ones_like(y), y + m.alpha),
    ),
    nn.Hardtanh: lambda m: (
        lambda z: F.hardtanh(z, m.min_val, m.max_val),
        lambda z, y: (z > m.min_val) & (z < m.max_val),
    ),
    nn.ReLU6: lambda m: (lambda z: F.hardtanh(z, 0.0, 6.0), lambda z, y: (z > 0) & (z < 6)),
    # The rest: f' by autograd once per step.
    nn.Softplus: lambda m: (lambda z: F.softplus(z, m.beta, m.threshold), None),
    nn.GELU: lambda m: (lambda z: F.gelu(z, approximate=m.approximate), None),
    nn.SiLU: lambda m: (F.silu, None),
    nn.Mish: lambda m: (F.mish, None),
    nn.Softsign: lambda m: (F.softsign, None),
    nn.LogSigmoid: lambda m: (F.logsigmoid, None),
    nn.Tanhshrink: lambda m: (F.tanhshrink, None),
}
_LINEAR_MAPS = (
    nn.Flatten, nn.Unflatten, nn.Identity, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
)  # fmt: skip
_MAX_POOLS = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}
_AFFINE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


# --- the plan ----------------------------------------------------------------------------------
def _leaves(module: nn.Module, path: str) -> List[Tuple[str, nn.Module]]:
    """The layers of a (nested) plain Sequential, in order."""
    if module._forward_hooks or module._forward_pre_hooks:
        raise Unsupported(f"{path or 'the model'} has forward hooks")
    if isinstance(module, nn.Sequential):
        if type(module).forward is not nn.Sequential.forward:
            raise Unsupported(f"{path or 'the model'} overrides Sequential.forward")
        out = []
        for name, child in module._modules.items():  # named_children() skips repeated layers
            if child is None:
                continue
            out += _leaves(child, f"{path}.{name}" if path else name)
        return out
    return [(path, module)]


def plan(fmodel: FunctionalModel) -> List[_Step]:
    """The model as a list of :class:`_Step`; raises :class:`Unsupported` with the reason."""
    model = fmodel.model
    if not isinstance(model, nn.Sequential) and type(model) not in _AFFINE:
        raise Unsupported(
            f"the model is a {type(model).__name__}, not an nn.Sequential of supported layers"
        )
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        raise Unsupported("global forward hooks are registered")
    index = {id(p): i for i, p in enumerate(fmodel.params)}
    steps: List[_Step] = []
    used = set()
    for path, m in _leaves(model, ""):
        kind = type(m)  # exact types: a subclass may change forward (e.g. parametrizations)
        if kind in _AFFINE:
            slots = []
            for p in (m.weight, m.bias):
                if p is None:
                    slots.append(None)
                elif id(p) in index:
                    slots.append(index[id(p)])
                    used.add(id(p))
                else:
                    slots.append(p.detach())
            steps.append(_Affine(m, tuple(slots)))
        elif kind is nn.ReLU:
            steps.append(_ReLU())
        elif kind in _ACTIVATIONS:
            steps.append(_Elementwise(*_ACTIVATIONS[kind](m)))
        elif kind in _MAX_POOLS:
            steps.append(_MaxPool(m, _MAX_POOLS[kind]))
        elif kind in _LINEAR_MAPS:
            steps.append(_Linear(m))
        elif kind in _DROPOUTS:
            steps.append(_Dropout(m))
        else:
            raise Unsupported(f"layer {path!r} ({kind.__name__}) is not supported")
    if len(used) != len(fmodel.params):
        raise Unsupported("some trainable parameters are not weights of supported layers")
    if any(True for _ in model.buffers()):
        raise Unsupported("the model has buffers")
    return steps


# --- the engine --------------------------------------------------------------------------------
def _structure(model: nn.Module) -> tuple:
    """What the plan depends on; a model changed after planning (a layer inserted, a hook
    registered) is planned again."""
    return (
        tuple((id(m), bool(m._forward_hooks or m._forward_pre_hooks)) for m in model.modules()),
        tuple(id(p) for p in model.parameters()),
        bool(nn.modules.module._global_forward_hooks),
        bool(nn.modules.module._global_forward_pre_hooks),
    )


class LayerwiseEngine:
    """The :class:`~torch_sgn.linearization.Engine` of a planned chain: one recorded forward
    pass, hand-made tangents.

    The plan is checked against the model's structure at every call. With ``strict`` a model
    that cannot be planned raises ``ValueError``; otherwise the functional engine takes over,
    with a warning the first time.
    """

    def __init__(
        self, fmodel: FunctionalModel, loss: OutputLoss, strict: bool, cuda_graphs: bool = False
    ):
        self.fmodel, self.loss, self.strict = fmodel, loss, strict
        self._functional = FunctionalEngine(fmodel, loss)
        self._key: Optional[tuple] = None
        self._steps: Optional[List[_Step]] = None
        self._warned = False
        self._graphs = graphs.Graphs() if cuda_graphs else None
        self._graphs_warned = False
        self._plan(fmodel)

    def _plan(self, fmodel: FunctionalModel) -> Optional[List[_Step]]:
        key = _structure(fmodel.model)
        if key != self._key:
            self._key = key
            if self._graphs is not None:
                self._graphs.clear()
            try:
                self._steps = plan(fmodel)
            except Unsupported as why:
                self._steps = None
                if self.strict:
                    raise ValueError(f"engine='fast' cannot evaluate this model: {why}") from None
                self._warn(f"the fast curvature engine does not apply ({why})")
        return self._steps

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warn(
                f"{why}; using the functional engine, which re-runs the forward pass at "
                "every G v product"
            )

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        fmodel, loss = self.fmodel, self.loss
        steps = self._plan(fmodel)
        inputs, targets = batch.inputs, batch.targets
        if isinstance(inputs, tuple):
            if len(inputs) != 1:
                if self.strict:
                    raise ValueError("engine='fast' takes one input tensor, got a tuple")
                self._warn("the fast curvature engine takes one input tensor")
                steps = None
            else:
                inputs = inputs[0]
        if self._graphs is not None:
            why = (
                "the fast engine does not apply to this model"
                if steps is None
                else graphs.obstacle(steps, fmodel.model, loss, flat.device)
            )
            if why is None:
                lin = self._graphs(_by_hand, steps, fmodel, loss, flat, Batch(inputs, targets))
                if lin is not None:
                    return lin
            elif not self._graphs_warned:
                self._graphs_warned = True
                warn(f"cuda_graphs=True does not apply ({why}); running eagerly")
        if steps is None:
            return self._functional(flat, batch, buffers_out)
        if all(step.by_hand for step in steps):
            return _by_hand(steps, fmodel, loss, flat, inputs, targets)
        return _through_autograd(steps, fmodel, loss, flat, inputs, targets)


def _per_parameter(fmodel: FunctionalModel, flat: Tensor) -> List[Tensor]:
    """Views of a flat vector shaped as the trainable parameters, in their order."""
    return [c.view(s) for c, s in zip(flat.split(fmodel.numels), fmodel.shapes)]


def _record(steps, fmodel, flat, inputs, grad_mode: bool, replay_rng: bool = True):
    """One forward pass through the chain; returns the outputs and each layer's context."""
    ctxs = []
    rng = fmodel.replay_rng() if replay_rng else contextlib.nullcontext()
    with torch.set_grad_enabled(grad_mode), rng:
        params = _per_parameter(fmodel, flat)
        h = inputs
        for step in steps:
            h, ctx = step.forward(h, params)
            ctxs.append(ctx)
    return h, list(zip(steps, ctxs))


def _jvp(chain, fmodel, v: Tensor, like: Tensor) -> Tensor:
    """``J v``: tangents forward through the recorded chain."""
    vs = _per_parameter(fmodel, v)
    t = None
    for step, ctx in chain:
        t = step.tangent(ctx, t, vs)
    return torch.zeros_like(like) if t is None else t


def _value_at(chain, fmodel, loss, inputs, targets) -> Callable[[Tensor], Tensor]:
    """``flat -> loss`` on the recorded batch: a plain forward pass through the chain, with the
    recorded dropout masks; nothing is recorded."""

    def value_at(flat: Tensor) -> Tensor:
        with torch.no_grad():
            params = _per_parameter(fmodel, flat)
            h = inputs
            for step, ctx in chain:
                h = step.value(ctx, h, params)
            return loss.value(h, targets)

    return value_at


def _through_autograd(steps, fmodel, loss, flat, inputs, targets) -> Linearization:
    """Tangents by hand, cotangents through the autograd graph of the recorded forward pass."""
    leaf = flat.detach().requires_grad_(True)
    outputs, chain = _record(steps, fmodel, leaf, inputs, grad_mode=True)
    value, dz = loss_and_output_gradient(loss, outputs, targets)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(outputs, leaf, dz, retain_graph=True)
    z = outputs.detach()
    with torch.no_grad():
        hessian = loss.hessian(z, targets)

    def ggn_vp(v: Tensor) -> Tensor:
        with torch.no_grad():
            hjv = hessian(_jvp(chain, fmodel, v, z))  # v -> J v -> H J v
        with torch.enable_grad():
            (jthjv,) = torch.autograd.grad(outputs, leaf, hjv, retain_graph=True)
        return jthjv

    return Linearization(value, grad, ggn_vp, _value_at(chain, fmodel, loss, inputs, targets))


def _by_hand(steps, fmodel, loss, flat, inputs, targets, captured=False) -> Linearization:
    """Tangents and cotangents by hand: no autograd graph is recorded or kept.

    For chains of linear layers, zero-padded convolutions, max pooling, elementwise
    activations, dropout and reshapes (the paper's five networks), where a small model's
    products are dominated by fixed costs per operation. ``captured``: inside a CUDA graph
    capture, where the targets (checked before) are not checked and no random state is set.
    """
    outputs, chain = _record(
        steps, fmodel, flat.detach(), inputs, grad_mode=False, replay_rng=not captured
    )
    value, dz = loss_and_output_gradient(loss, outputs, targets, check=not captured)
    z = outputs
    # Layers before the first one with trainable parameters need no cotangent at all.
    first = min(i for i, step in enumerate(steps) if step.trainable)

    def vjp(u: Tensor) -> Tensor:  # J^T u, layer by layer from the output
        grads: List[Optional[Tensor]] = [None] * len(fmodel.params)
        for i in range(len(chain) - 1, first - 1, -1):
            step, ctx = chain[i]
            u = step.cotangent(ctx, u, grads, need_input=i > first)
        return torch.cat([g.reshape(-1) for g in grads])

    def ggn_vp(v: Tensor) -> Tensor:
        with torch.no_grad():
            return vjp(hessian(_jvp(chain, fmodel, v, z)))  # J^T H J v

    with torch.no_grad():
        hessian = loss.hessian(z, targets)
        grad = vjp(dz)
    value_at = _value_at(chain, fmodel, loss, inputs, targets)
    return Linearization(value, grad, ggn_vp, value_at, outputs=z)
