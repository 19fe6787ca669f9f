r"""The layer rules of the layer-wise engine: one class per kind of layer, in one registry.

A rule says how one layer of an :class:`~torch.nn.Sequential` chain is evaluated by
:mod:`torch_sgn.engines.layerwise.engine`: the recorded forward pass and what it keeps
(:meth:`forward`), the
tangent map ``J v`` (:meth:`tangent`), the output at other parameters (:meth:`value`) and,
where it has one, the hand-made cotangent ``J^T u`` (:meth:`cotangent`). The engine plans a
model by looking up each layer's exact type in the registry (a subclass may change
``forward``, so it does not inherit its parent's rule); :func:`supported_layers` lists the
registered types, and the CUDA-graph capture (:mod:`torch_sgn.engines.cuda_graphs`) asks each rule
whether it can be captured (:attr:`LayerRule.capture_obstacle`).

Adding a layer is one class here::

    @rule(nn.Hardswish)
    class _Hardswish(LayerRule):
        def forward(self, z, params):  # the output, and what the tangent needs
            ...

with ``parameters = ("weight", ...)`` where it has trainable parameters (their slots arrive
in :meth:`LayerRule.from_module`), and ``by_hand = False`` where it has no :meth:`cotangent`
(the engine then goes backward through autograd). ``docs/LAYERS.md`` is generated from the
registry (``python scripts/layers_doc.py``); a test checks that it is current, and that
every registered type is checked against the reference engine.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RULES", "LayerRule", "Slot", "rule", "supported_layers"]

#: A parameter slot of a layer: an index into the trainable parameters, a frozen tensor, or
#: ``None`` (the module has no such parameter, e.g. ``bias=False``).
Slot = Union[int, Tensor, None]

#: The registry: exact module type -> its rule.
RULES: Dict[Type[nn.Module], Type[LayerRule]] = {}


def rule(*module_types: Type[nn.Module]) -> Callable[[Type[LayerRule]], Type[LayerRule]]:
    """Class decorator: registers a :class:`LayerRule` for these exact module types."""

    def register(cls: Type[LayerRule]) -> Type[LayerRule]:
        for kind in module_types:
            if kind in RULES:
                raise ValueError(f"{kind.__name__} already has a rule ({RULES[kind].__name__})")
            RULES[kind] = cls
        return cls

    return register


def supported_layers() -> List[str]:
    """The names of the layer types the layer-wise engine evaluates (``torch.nn`` classes,
    matched exactly, sorted)."""
    return sorted(kind.__name__ for kind in RULES)


class LayerRule:
    """One layer of the chain: a recorded forward pass and its tangent map.

    Attributes:
        module: the layer.
        parameters: the names of the module's parameters the rule reads (their slots are
            passed to :meth:`from_module` in this order); a layer with parameters the rule
            does not name is not planned.
        by_hand: whether :meth:`cotangent` is implemented (else products go through autograd);
            read at every step, so a property may follow the module's settings.
        trainable: whether the layer has trainable parameters.
        per_sample: whether each sample's output depends on that sample alone and
            :meth:`cotangent` keeps the samples apart (the direct solver's Jacobian route,
            :meth:`sample_jacobian`); read at every step.
    """

    parameters: Tuple[str, ...] = ()
    by_hand = True
    trainable = False
    per_sample = False

    def __init__(self, module: nn.Module):
        self.module = module

    @classmethod
    def from_module(cls, module: nn.Module, slots: Tuple[Slot, ...]) -> LayerRule:
        """The rule for ``module``, with one slot per name in :attr:`parameters`."""
        return cls(module)

    @property
    def capture_obstacle(self) -> Optional[str]:
        """Why this layer cannot be captured in a CUDA graph; ``None`` if it can. Read at
        every step (a module's settings and training mode may change)."""
        if not self.by_hand:
            return (
                f"the layer {type(self.module).__name__} is not evaluated by hand (its "
                "products go through autograd)"
            )
        return None

    def forward(self, a: Tensor, params: Sequence[Tensor]) -> Tuple[Tensor, object]:
        """The layer's output on ``a`` and the context its other methods need."""
        raise NotImplementedError

    def tangent(self, ctx: object, t: Optional[Tensor], vs: Sequence[Tensor]) -> Optional[Tensor]:
        """The output's tangent for the input's tangent ``t`` (``None``: zero) and the
        parameters' tangents ``vs`` (by slot); ``None`` where it is zero."""
        raise NotImplementedError

    def value(self, ctx: object, a: Tensor, params: Sequence[Tensor]) -> Tensor:
        """The layer's output at other parameters, with the recorded random numbers."""
        raise NotImplementedError

    def cotangent(
        self, ctx: object, u: Tensor, grads: List[Optional[Tensor]], need_input: bool
    ) -> Optional[Tensor]:
        """``J^T u`` for this layer: accumulates parameter cotangents into ``grads`` (by slot)
        and returns the input's cotangent (``None`` when ``need_input`` is false)."""
        raise NotImplementedError

    def sample_jacobian(self, ctx: object, u: Tensor, put: Callable[[Slot, Tensor], None]) -> None:
        """Each sample's own parameter cotangent for the output cotangent ``u``: calls
        ``put(slot, rows)`` with ``rows[n]`` sample ``n``'s share of :meth:`cotangent`'s sum
        (for rules with :attr:`per_sample` and trainable parameters)."""
        if self.trainable:
            raise NotImplementedError

    def sample_factors(self, ctx: object, u: Tensor) -> List[Tuple[Slot, Tensor, Optional[Tensor]]]:
        """:meth:`sample_jacobian`'s rows in factored form, for Gram matrices of the rows.

        Returns ``(slot, left, right)`` triples: sample ``n``'s row is the outer product
        ``left[n] (x) right[n]`` flattened (``right`` ``None``: the row is ``left[n]``), so that
        two samples' rows have the inner product ``(left[n] . left[m]) (right[n] . right[m])``
        without the row being formed. The default forms the rows.
        """
        out: List[Tuple[Slot, Tensor, Optional[Tensor]]] = []
        self.sample_jacobian(
            ctx, u, lambda slot, rows: out.append((slot, rows.reshape(rows.shape[0], -1), None))
        )
        return out


def _accumulate(grads: List[Optional[Tensor]], slot: Slot, g: Tensor) -> None:
    if isinstance(slot, int):  # frozen or absent parameters take no cotangent
        grads[slot] = g if grads[slot] is None else grads[slot] + g  # tied weights add up


def _get(slot: Slot, values: Sequence[Tensor]) -> Optional[Tensor]:
    return values[slot] if isinstance(slot, int) else slot


def _tangent_of(slot: Slot, vs: Sequence[Tensor]) -> Optional[Tensor]:
    return vs[slot] if isinstance(slot, int) else None  # frozen or absent: no tangent


@rule(nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
class _Affine(LayerRule):
    """``z = op(a, W) + b``, linear in ``a`` and in ``(W, b)``; by hand except convolutions
    padded other than with zeros in numbers or ``"valid"`` (other padding modes, ``"same"``)."""

    parameters = ("weight", "bias")

    def __init__(self, module: nn.Module, slots: Tuple[Slot, Slot]):
        super().__init__(module)
        self.weight, self.bias = slots
        self.trainable = any(isinstance(slot, int) for slot in slots)
        if isinstance(module, nn.Linear):
            self.op = F.linear
        else:
            self.op = module._conv_forward  # handles padding modes
        self.bias_shape = (
            (-1,) if isinstance(module, nn.Linear) else (-1,) + (1,) * (len(module.kernel_size))
        )

    @classmethod
    def from_module(cls, module, slots):
        return cls(module, slots)

    @property
    def by_hand(self) -> bool:  # read at every step: the module's settings may change
        m = self.module
        # A convolution by hand only where it is one aten op (zero padding in numbers or
        # "valid"); other padding modes and "same" pad first: those go through autograd.
        return isinstance(m, nn.Linear) or (m.padding_mode == "zeros" and m.padding != "same")

    def forward(self, a, params):
        w = _get(self.weight, params)
        z = self.op(a, w, _get(self.bias, params))
        a, w = a.detach(), w.detach()
        if self.op is not F.linear and z.dtype != w.dtype:
            # Under autocast (bf16 or fp16) the convolution ran on copies of ``a`` and ``W`` in
            # z's dtype. Its backward is one aten op, which autocast does not cast: it is given
            # those copies, as autograd's would be, not operands of two dtypes it rejects.
            a, w = a.to(z.dtype), w.to(z.dtype)
        return z, (a, w, z.shape)

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
            u.to(w.dtype), a, w, [m.out_channels] if m.bias is not None else None,
            list(m.stride), [0] * dims if m.padding == "valid" else list(m.padding),
            list(m.dilation), False, [0] * dims, m.groups, mask,
        )  # fmt: skip
        return (ga.squeeze(0) if unbatched and ga is not None else ga), gw, gb

    @property
    def per_sample(self) -> bool:
        return self.op is F.linear

    def sample_factors(self, ctx, u):
        if u.dim() != 2:  # extra dimensions: a sample's row sums outer products; form it
            return super().sample_factors(ctx, u)
        a = ctx[0]  # nn.Linear on (samples, features): weight row u_n a_n^T, bias row u_n
        return [(self.weight, u, a), (self.bias, u, None)]

    def sample_jacobian(self, ctx, u, put):
        a, w, _ = ctx  # nn.Linear: sample n's weight cotangent sums u_n a_n^T over extra dims
        n = u.shape[0]
        u3, a3 = u.reshape(n, -1, u.shape[-1]), a.reshape(n, -1, a.shape[-1])
        put(self.weight, torch.bmm(u3.transpose(1, 2), a3))
        put(self.bias, u3.sum(1))

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


#: Elementwise activations: module -> (f, f'), with f' taking ``(z, f(z))``; ``None``: f' by
#: autograd once per step. Adding an activation is one line here.
_ACTIVATIONS: Dict[Type[nn.Module], Callable[[nn.Module], tuple]] = {
    nn.Sigmoid: lambda m: (torch.sigmoid, lambda z, y: y * (1 - y)),
    nn.Tanh: lambda m: (torch.tanh, lambda z, y: 1 - y * y),
    nn.LeakyReLU: lambda m: (
        lambda z: F.leaky_relu(z, m.negative_slope),
        lambda z, y: torch.where(z > 0, z.new_ones(()), z.new_full((), m.negative_slope)),
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
    nn.Softplus: lambda m: (lambda z: F.softplus(z, m.beta, m.threshold), None),
    nn.GELU: lambda m: (lambda z: F.gelu(z, approximate=m.approximate), None),
    nn.SiLU: lambda m: (F.silu, None),
    nn.Mish: lambda m: (F.mish, None),
    nn.Softsign: lambda m: (F.softsign, None),
    nn.LogSigmoid: lambda m: (F.logsigmoid, None),
    nn.Tanhshrink: lambda m: (F.tanhshrink, None),
}


@rule(*_ACTIVATIONS)
class _Elementwise(LayerRule):
    """``y = f(z)`` elementwise: the tangent is ``f'(z) t``, ``f'`` evaluated once per step."""

    per_sample = True

    def __init__(self, module: nn.Module):
        super().__init__(module)
        # f'(z) from (z, y); None: by autograd
        self.fn, self.derivative = _ACTIVATIONS[type(module)](module)

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


@rule(nn.ReLU)
class _ReLU(LayerRule):
    """ReLU: ``f'(z) t`` keeps ``t`` where the output is positive. The output itself is the
    context (the next layer usually keeps it anyway), applied as a mask by the kernel autograd
    uses, ``threshold_backward``: cheaper on a CPU than a stored boolean mask, which must be
    converted to floats in every product."""

    per_sample = True

    def forward(self, z, params):
        y = torch.relu(z)
        return y, y.detach()

    def value(self, y, z, params):
        return torch.relu(z)

    def tangent(self, y, t, vs):
        return None if t is None else torch.ops.aten.threshold_backward(t, y, 0)

    def cotangent(self, y, u, grads, need_input):
        return torch.ops.aten.threshold_backward(u, y, 0) if need_input else None


@rule(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
class _MaxPool(LayerRule):
    """Max pooling: the tangent is gathered at the stored argmax indices (flat over the pooled
    dimensions), the cotangent scattered back to them."""

    _DIMS = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.dims = self._DIMS[type(module)]
        self.pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[self.dims]

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


@rule(nn.Flatten, nn.Unflatten, nn.Identity)
class _Reshape(LayerRule):
    """A reshape (or identity): the tangent is the reshape, the cotangent reshapes back."""

    @property
    def per_sample(self) -> bool:  # unless it reshapes the batch dimension itself
        m = self.module
        return not (
            (isinstance(m, nn.Flatten) and m.start_dim == 0)
            or (isinstance(m, nn.Unflatten) and m.dim == 0)
        )

    def forward(self, a, params):
        return self.module(a), a.shape

    def tangent(self, ctx, t, vs):
        return None if t is None else self.module(t)

    def value(self, ctx, a, params):
        return self.module(a)

    def cotangent(self, shape, u, grads, need_input):
        return u.reshape(shape) if need_input else None


@rule(
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
)  # fmt: skip
class _LinearMap(LayerRule):
    """Average pooling, a parameter-free linear map: the tangent is the map; no hand-made
    cotangent (products go through autograd)."""

    by_hand = False

    def forward(self, a, params):
        return self.module(a), None

    def tangent(self, ctx, t, vs):
        return None if t is None else self.module(t)

    def value(self, ctx, a, params):
        return self.module(a)


@rule(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
class _Dropout(LayerRule):
    """Dropout: in training mode the mask is drawn once and applied to values and tangents;
    captured in CUDA graphs only in eval mode.

    ``module(ones)`` draws the same random numbers as ``module(a)`` would, so a step with this
    engine leaves the random state where the functional engine leaves it.
    """

    per_sample = True

    @property
    def capture_obstacle(self) -> Optional[str]:
        if self.module.training:
            return "training-mode dropout draws new random numbers every step"
        return None

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
