r"""The layer-wise engine: ``G v`` for chains of known layers at about one gradient.

The functional engine (:class:`torch_sgn.engines.functional.FunctionalEngine`) works for any model
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

How each kind of layer does this is its rule in :mod:`torch_sgn.engines.layerwise.rules`, the
registry
of supported layers (:func:`~torch_sgn.engines.layerwise.rules.supported_layers`,
``docs/LAYERS.md``).

So a product costs a tangent forward plus one backward pass, against a forward plus a backward
for a gradient. The loss at the trust region's and line search's trial points is a plain
forward pass through the same chain (no autograd, the recorded dropout masks). With
``cuda_graphs`` the by-hand work is captured and replayed (:mod:`torch_sgn.engines.cuda_graphs`).

:class:`LayerwiseEngine` is the engine of ``engine="layerwise"`` and ``"auto"`` (see
:mod:`torch_sgn.engines.selection`); where the model is not such a chain it raises
(``"layerwise"``) or hands over to another engine with a one-time warning (``"auto"``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ...diagnostics import warn
from ...linearization import Batch, Linearization, SampleSpace, loss_and_output_gradient
from ...losses import OutputLoss
from ...model.attributes import model_attributes
from ...model.flat_model import FunctionalModel
from ...model.forward_mode import backward_hook_handles
from .. import cuda_graphs as graphs
from ..not_applicable import NotApplicable
from .rules import RULES, LayerRule, Slot


class Unsupported(Exception):
    """The layer-wise engine cannot evaluate this model; the message says why."""


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


def plan(fmodel: FunctionalModel) -> List[LayerRule]:
    """The model as a list of :class:`~torch_sgn.engines.layerwise.rules.LayerRule`, one per layer;
    raises
    :class:`Unsupported` with the reason."""
    model = fmodel.model
    if not isinstance(model, nn.Sequential) and not RULES.get(type(model), LayerRule).parameters:
        raise Unsupported(
            f"the model is a {type(model).__name__}, not an nn.Sequential of supported layers"
        )
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        raise Unsupported("global forward hooks are registered")
    if backward_hook_handles(model):  # the layer rules' products and gradient skip them
        raise Unsupported("the model has backward hooks, which its layer rules would not run")
    index = {id(p): i for i, p in enumerate(fmodel.params)}
    steps: List[LayerRule] = []
    used = set()
    for path, m in _leaves(model, ""):
        # exact types: a subclass may change forward (e.g. parametrizations)
        layer_rule = RULES.get(type(m))
        if layer_rule is None:
            raise Unsupported(f"layer {path!r} ({type(m).__name__}) is not supported")
        slots: List[Slot] = []
        for name in layer_rule.parameters:
            p = getattr(m, name)
            if p is None:
                slots.append(None)
            elif id(p) in index:
                slots.append(index[id(p)])
                used.add(id(p))
            else:
                slots.append(p.detach())
        steps.append(layer_rule.from_module(m, tuple(slots)))
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
        bool(backward_hook_handles(model)),
        model_attributes(model),  # the rules hold the layers' settings (stride, p, slope)
    )


class LayerwiseEngine:
    """The :class:`~torch_sgn.linearization.Engine` of a planned chain: one recorded forward
    pass, hand-made tangents.

    The plan is checked against the model's structure at every call. With ``strict`` a model
    that cannot be planned raises ``ValueError``; otherwise
    :class:`~torch_sgn.engines.not_applicable.NotApplicable`, and the engine selection hands
    the call to the next engine of its chain.
    """

    def __init__(
        self,
        fmodel: FunctionalModel,
        loss: OutputLoss,
        strict: bool,
        cuda_graphs: bool = False,
    ):
        self.fmodel, self.loss, self.strict = fmodel, loss, strict
        self._key: Optional[tuple] = None
        self._steps: Optional[List[LayerRule]] = None
        self._unplanned: Optional[str] = None  # why the model, as it is now, is not planned
        self._graphs = graphs.Graphs() if cuda_graphs else None
        self._graphs_warned = False
        self._plan(fmodel)

    def _plan(self, fmodel: FunctionalModel) -> Optional[List[LayerRule]]:
        key = _structure(fmodel.model)
        if key != self._key:
            self._key = key
            if self._graphs is not None:
                self._graphs.clear()
            try:
                self._steps, self._unplanned = plan(fmodel), None
            except Unsupported as why:
                self._steps, self._unplanned = None, str(why)
                if self.strict:
                    raise ValueError(
                        f"engine='layerwise' cannot evaluate this model: {why}"
                    ) from None
        return self._steps

    @property
    def planned(self) -> bool:
        """Whether the model, as it is now, is a chain this engine runs itself."""
        return self._steps is not None

    @property
    def may_solve_through_outputs(self) -> bool:
        """Whether this engine's linearizations can offer the route through the batch's outputs
        (:class:`~torch_sgn.linearization.SampleSpace`): a planned chain, not captured in CUDA
        graphs. Each batch decides for itself (its chain must be of linear layers and
        activations, each sample's outputs its own)."""
        return self.planned and self._graphs is None

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        fmodel, loss = self.fmodel, self.loss
        steps = self._plan(fmodel)
        if steps is None:  # (the next engine decides on graphs itself)
            raise NotApplicable(f"the layer-wise engine does not apply ({self._unplanned})")
        inputs, targets = batch.inputs, batch.targets
        if isinstance(inputs, tuple):
            if len(inputs) != 1:
                if self.strict:
                    raise ValueError("engine='layerwise' takes one input tensor, got a tuple")
                raise NotApplicable("the layer-wise engine takes one input tensor")
            inputs = inputs[0]
        if self._graphs is not None:
            why = graphs.obstacle(steps, loss, flat.device)
            if why is None:
                lin = self._graphs(_by_hand, steps, fmodel, loss, flat, Batch(inputs, targets))
                if lin is not None:
                    return lin
            elif not self._graphs_warned:
                self._graphs_warned = True
                warn(f"cuda_graphs=True does not apply ({why}); running eagerly")
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


def _outputs_at(chain, fmodel, inputs) -> Callable[[Tensor], Tensor]:
    """``flat -> outputs`` on the recorded batch: a plain forward pass through the chain, with
    the recorded dropout masks; nothing is recorded."""

    def outputs_at(flat: Tensor) -> Tensor:
        with torch.no_grad():
            params = _per_parameter(fmodel, flat)
            h = inputs
            for step, ctx in chain:
                h = step.value(ctx, h, params)
            return h

    return outputs_at


def _value_at(outputs_at, loss, targets) -> Callable[[Tensor], Tensor]:
    """``flat -> loss`` on the recorded batch (see :func:`_outputs_at`)."""
    return lambda flat: loss.value(outputs_at(flat), targets)


def _through_autograd(steps, fmodel, loss, flat, inputs, targets) -> Linearization:
    """Tangents by hand, cotangents through the autograd graph of the recorded forward pass."""
    leaf = flat.detach().requires_grad_(True)
    outputs, chain = _record(steps, fmodel, leaf, inputs, grad_mode=True)
    value, dz = loss_and_output_gradient(loss, outputs, targets)

    def vjp(u: Tensor) -> Tensor:  # J^T u through the recorded graph, kept for the next one
        with torch.enable_grad():
            (jtu,) = torch.autograd.grad(outputs, leaf, u, retain_graph=True)
        return jtu

    grad = vjp(dz)
    z = outputs.detach()
    with torch.no_grad():
        hessian = loss.hessian(z, targets)

    def ggn_vp(v: Tensor) -> Tensor:
        with torch.no_grad():
            hjv = hessian(_jvp(chain, fmodel, v, z))  # v -> J v -> H J v
        return vjp(hjv)

    outputs_at = _outputs_at(chain, fmodel, inputs)
    value_at = _value_at(outputs_at, loss, targets)
    return Linearization(value, grad, ggn_vp, value_at, outputs=z, outputs_at=outputs_at, vjp=vjp)


def _by_hand(steps, fmodel, loss, flat, inputs, targets, captured=False) -> Linearization:
    """Tangents and cotangents by hand: no autograd graph is recorded or kept.

    For chains whose every rule has a hand-made cotangent (``by_hand``; the paper's five
    networks), where a small model's products are dominated by fixed costs per operation.
    ``captured``: inside a CUDA graph capture, where the targets (checked before) are not
    checked and no random state is set.
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
        # In the parameters' dtype: under autocast the layers' products return bf16 or fp16.
        return torch.cat([g.reshape(-1) for g in grads]).to(flat.dtype)

    def ggn_vp(v: Tensor) -> Tensor:
        with torch.no_grad():
            return vjp(hessian(_jvp(chain, fmodel, v, z)))  # J^T H J v

    with torch.no_grad():
        hessian = loss.hessian(z, targets)
        grad = vjp(dz)
    outputs_at = _outputs_at(chain, fmodel, inputs)
    value_at = _value_at(outputs_at, loss, targets)
    dense = None
    if not captured and _per_sample_chain(chain[first:], z, inputs.shape[0], fmodel.numel):

        def dense() -> Tensor:
            with torch.no_grad():
                return _dense_ggn(chain, first, fmodel, hessian, z)

    space = None
    if not captured and _sample_chain(chain[first:], z, inputs.shape[0]):
        space = SampleSpace(
            outputs=z,
            output_grad=dz,
            hessian=hessian,
            vjp=vjp,
            kernel=lambda: _sample_kernel(chain, first, fmodel, z),
            jvp=lambda v: _jvp(chain, fmodel, v, z),
        )
    return Linearization(
        value, grad, ggn_vp, value_at, outputs=z, outputs_at=outputs_at, vjp=vjp,
        dense_ggn=dense, sample_space=space,
    )  # fmt: skip


#: The largest output Jacobian (samples x outputs x parameters) :func:`_dense_ggn` forms; a
#: larger one is left to products with the identity's columns.
_MAX_JACOBIAN_ENTRIES = 1 << 25


def _per_sample_chain(chain, z: Tensor, n_samples: int, n: int) -> bool:
    """Whether every layer's rule keeps the samples apart (:attr:`LayerRule.per_sample`: linear
    layers, activations, dropout, reshapes that keep the batch dimension), the outputs keep
    the batch dimension, and the Jacobian is small enough to hold."""
    return z.numel() * n <= _MAX_JACOBIAN_ENTRIES and _sample_chain(chain, z, n_samples)


def _sample_chain(chain, z: Tensor, n_samples: int) -> bool:
    """Whether every layer's rule keeps the samples apart and the outputs keep the batch
    dimension: then ``J J^T`` comes from each sample's own cotangents."""
    if z.dim() < 2 or z.shape[0] != n_samples:
        return False
    return all(step.per_sample for step, _ in chain)


def _sample_kernel(chain, first: int, fmodel: FunctionalModel, z: Tensor) -> Tensor:
    r"""``K = J J^\top`` (``R x R``, float64) from each sample's own cotangents.

    As :func:`_dense_ggn`, one backward pass per output unit gives every sample's cotangent at
    each layer, in factored form (:meth:`LayerRule.sample_factors`): a linear layer's rows are
    ``u_n a_n^T``, so two samples' rows have the inner product ``(u_n . u_m)(a_n . a_m)`` and
    ``K`` costs ``R^2`` times the layers' widths, never ``R P``. Rows of a parameter reached
    twice (tied weights) add up, so every pair of its factors contributes.
    """
    n_samples = z.shape[0]
    factors: Dict[int, list] = {}
    for o, step, ctx, u in _output_cotangents(chain, first, fmodel, z):
        for slot, left, right in step.sample_factors(ctx, u):
            if isinstance(slot, int):  # frozen or absent parameters have no rows
                right = None if right is None else right.reshape(n_samples, -1)
                factors.setdefault(slot, []).append((o, left.reshape(n_samples, -1), right))
    return kernel_of_factors(factors, z)


def kernel_of_factors(factors: Dict[int, list], z: Tensor, by_pairs: bool = False) -> Tensor:
    """``J J^T`` from each parameter's ``(o, left, right)`` factors (:func:`_sample_kernel`).

    A parameter with one entry per output unit, in order, sharing one right factor (or none),
    adds all its pairs of output units at once (:func:`stacked_factors`); any other (tied
    weights, a single output unit) pair by pair, as does every one with ``by_pairs``.
    """
    n_samples, n_out = z.shape[0], z[0].numel()
    kernel = z.new_zeros((n_samples, n_out, n_samples, n_out), dtype=torch.float64)
    grams: Dict[tuple, Tensor] = {}  # a layer's weight and bias share their left factor

    def gram(a: Tensor, b: Tensor) -> Tensor:
        key = (id(a), id(b))
        if key not in grams:
            grams[key] = a @ b.T
        return grams[key]

    for entries in factors.values():
        stacked = None if by_pairs else stacked_factors(entries, n_out)
        if stacked is not None:
            add_stacked_pairs(kernel, *stacked)
            continue
        for i, (o1, left1, right1) in enumerate(entries):
            for j in range(i, len(entries)):
                o2, left2, right2 = entries[j]
                if right1 is None and right2 is None:
                    block = gram(left1, left2)
                elif right1 is not None and right2 is not None:
                    block = gram(left1, left2) * (right1 @ right2.T)
                else:  # a row against a factored one: the lefts' widths differ
                    block = _mixed_gram(left1, right1, left2, right2)
                block = block.double()  # summed in float64; each block in the model's dtype
                kernel[:, o1, :, o2] += block
                if j != i:  # the pair (j, i): the transposed block
                    kernel[:, o2, :, o1] += block.T
    kernel = kernel.view(z.numel(), z.numel())
    return (kernel + kernel.T) * 0.5


def stacked_factors(entries: list, n_out: int) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """A parameter's left factors stacked ``(n_out, n, d)`` and the right factor they all share
    (``None``: rows given whole), or ``None`` where it has not one entry per output unit in
    order (tied weights), a single output unit, or right factors that differ.

    A linear layer's right factor is its input, the same for every output unit but reshaped
    into a new tensor for each: the same memory, shape and strides tell it.
    """
    if n_out < 2 or [o for o, _, _ in entries] != list(range(n_out)):
        return None
    right = entries[0][2]
    for _, _, other in entries[1:]:
        if (other is None) != (right is None):
            return None
        if right is not None and (
            other.data_ptr() != right.data_ptr()
            or other.shape != right.shape
            or other.stride() != right.stride()
            or other.dtype != right.dtype
        ):
            return None
    return torch.stack([left for _, left, _ in entries]), right


def add_stacked_pairs(kernel: Tensor, lefts: Tensor, right: Optional[Tensor]) -> None:
    """Adds to ``kernel[n, o, m, p]`` every pair of output units' blocks of one parameter,
    ``(lefts[o, n] . lefts[p, m]) (right[n] . right[m])``: computed in the factors' dtype and
    summed in float64, as pair by pair."""
    n_out, n_samples = lefts.shape[:2]
    flat = lefts.reshape(n_out * n_samples, -1)
    block = (flat @ flat.T).view(n_out, n_samples, n_out, n_samples)  # (o, n, p, m)
    if right is not None:
        block *= (right @ right.T)[None, :, None, :]
    kernel.permute(1, 0, 3, 2).add_(block)


def _output_cotangents(chain, first: int, fmodel: FunctionalModel, z: Tensor) -> Iterator:
    """One backward pass per output unit (``z[n, o]`` for every sample ``n`` at once): yields
    ``(o, step, ctx, u)`` at each trainable layer, ``u`` the cotangent of its output, which for
    a per-sample chain holds each sample's own cotangent."""
    n_samples, n_out = z.shape[0], z[0].numel()
    unused: List[Optional[Tensor]] = [None] * len(fmodel.params)
    for o in range(n_out):
        u = z.new_zeros((n_samples, n_out))
        u[:, o] = 1.0
        u = u.view(z.shape)
        for i in range(len(chain) - 1, first - 1, -1):
            step, ctx = chain[i]
            if step.trainable:
                yield o, step, ctx, u
            u = step.cotangent(ctx, u, unused, need_input=i > first)


def _mixed_gram(left1, right1, left2, right2) -> Tensor:
    """Inner products of rows given one factored and one formed (tied weights only)."""

    def rows(left, right):
        return left if right is None else (left.unsqueeze(2) * right.unsqueeze(1)).flatten(1)

    return rows(left1, right1) @ rows(left2, right2).T


def _dense_ggn(chain, first: int, fmodel: FunctionalModel, hessian, z: Tensor) -> Tensor:
    r"""``G = \sum_n J_n^\top H_n J_n`` (float64) from the per-sample output Jacobians ``J_n``.

    One backward pass per output unit (``z[n, o]`` for every sample ``n`` at once) yields,
    at each linear layer, every sample's own cotangent ``u_n`` and input ``a_n``: the rows of
    ``J`` are ``u_n a_n^T`` (weight) and ``u_n`` (bias). So ``J`` costs ``O`` backward passes
    where products with the identity's columns cost ``P`` tangent and cotangent passes: on a
    regression MLP with one output, ``G`` costs about as much as two or three products.
    """
    n_samples, n_out = z.shape[0], z[0].numel()
    offsets = [0]
    for numel in fmodel.numels:
        offsets.append(offsets[-1] + numel)
    jac = z.new_zeros((n_samples, n_out, fmodel.numel))

    def put(slot: Slot, o: int, rows: Tensor) -> None:
        if isinstance(slot, int):  # tied weights add up
            jac[:, o, offsets[slot] : offsets[slot + 1]] += rows.reshape(n_samples, -1)

    for o, step, ctx, u in _output_cotangents(chain, first, fmodel, z):
        step.sample_jacobian(ctx, u, lambda slot, rows, o=o: put(slot, o, rows))
    # H J column by column (as outputs-shaped tangents), then G = (H J)^T J.
    hj = _hessian_columns(hessian, jac.view(-1, fmodel.numel).T.reshape(-1, *z.shape))
    # Summed in float64 whatever the model's dtype: in float32 the rounding of the sums over
    # samples would bury every eigenvalue of G below about 1e-7 of its largest.
    return hj.reshape(fmodel.numel, -1).double() @ jac.view(-1, fmodel.numel).double()


def _hessian_columns(hessian: Callable[[Tensor], Tensor], columns: Tensor) -> Tensor:
    """``H c`` for each ``c`` along the first dimension of ``columns``: batched by ``vmap``,
    one by one where ``vmap`` cannot batch the product.

    The columns lead: batched along a trailing dimension, the double backward of
    ``torch.abs`` (an L1 loss's) breaks inside ``vmap`` (torch 2.13: expanded sizes of
    garbage), along the leading one it holds.
    """
    try:
        return torch.func.vmap(hessian)(columns)
    except (RuntimeError, NotImplementedError):
        return torch.stack([hessian(c) for c in columns.unbind(0)])
