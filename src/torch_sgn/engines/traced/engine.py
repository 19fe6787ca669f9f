r"""The traced curvature engine: ``G v`` at about one gradient for any traceable model.

The functional engine (:mod:`torch_sgn.model.flat_model`) re-runs the whole forward pass with
forward-mode AD at every product, and the layer-wise engine
(:mod:`torch_sgn.engines.layerwise.engine`) only
knows ``nn.Sequential`` chains of known layers. This engine takes any model whose forward pass
``torch.fx`` can trace into a graph of ATen operators (residual connections, batch and layer
normalization, embeddings, attention, recurrent layers, custom ``forward`` methods):

1. Once per input shape, dtype, device and training mode it traces (``make_fx`` on fake
   tensors, :mod:`.trace`) the function ``(theta, v, buffers, inputs, targets) -> (loss, g,
   G v)``: one forward pass carrying the tangent ``v`` (forward-mode AD gives ``z = f(theta)``
   and ``J v`` together), the loss and its output gradient, ``g = J^T dz`` and
   ``G v = J^T H J v`` through the reverse pass of that same forward pass.
2. It splits the graph at the operators that depend on ``v`` (:mod:`.split`). The rest (the
   forward pass, the loss, the gradient, the loss's Hessian factors and every quantity the
   tangent formulas need that does not involve ``v``) runs **once per step**; the part that
   depends on ``v`` (the tangent pass and one reverse pass) runs at every CG iteration, reading
   what the first part left behind. The graphs are rewritten around the split
   (:mod:`.passes`): an activation's derivative (GELU's, SiLU's, ...) is one quantity the
   products multiply by where they would evaluate it twice; a matrix product of embedding
   rows is taken on the embedding table where the table has fewer rows than the batch has
   tokens.

Training-mode batch normalization stays exact (its batch statistics are differentiated, so the
samples are coupled as in the gradient), its running statistics are updated once per step into
``buffers_out``; random numbers (dropout) are drawn once per step, with the random state the
step replays (:meth:`~torch_sgn.model.flat_model.FunctionalModel.consistent`). Where an operator has
no forward-mode rule, ``J v`` is traced through the reverse pass instead
(``J v = d/du [(J^T u) . v]``).

With ``cuda_graphs=True`` (:class:`~.replay.Replayed`) the set-up, the product and the loss at
a trial point (traced once more) are captured as CUDA graphs and replayed: on a GPU a small or
recurrent model's step then costs its kernels, not their launches. With ``compile=True`` the
set-up and the product run compiled by ``torch.compile`` (:func:`~.replay.compiled_graph`),
which fuses the tangent and reverse passes' elementwise operations.

A model that cannot be traced (control flow that depends on the values of tensors, ``.item()``
in ``forward``, an output that is not one tensor) raises
:class:`~torch_sgn.engines.not_applicable.NotApplicable`, and the engine selection hands it to
the functional engine with the reason in a one-time warning; ``strict`` raises ``ValueError``
instead. Python state that ``forward`` reads
other than the modules' ``training`` flags and the shapes of its inputs is fixed at tracing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from ...diagnostics import WarnOnce
from ...linearization import Batch, Linearization
from ...losses import OutputLoss
from ...model.attributes import (
    changed_attributes,
    model_attributes,
    module_state,
    restore_module_state,
)
from ...model.flat_model import FunctionalModel
from ...model.forward_mode import backward_hook_handles, gradient_stop_notice
from .. import cuda_graphs as graphs
from ..not_applicable import NotApplicable
from .opaque_loss import calls_opaque_loss
from .passes import rewrite_whole
from .replay import Replayed, capture_obstacle, compiled_graph
from .split import split
from .trace import Traced, Untraceable, inputs_of, reason, trace_product, trace_value

__all__ = ["TracedEngine", "Untraceable"]


#: traces kept per engine (one per input shape, dtype, device and training mode); the oldest
#: is dropped beyond this
CACHE_SIZE = 8


#: a model attribute (a plain Python value a module holds, read by ``forward``: a temperature,
#: a flag) that changed this many times, each time calling for a new trace, makes the engine
#: decline the model (:class:`~torch_sgn.engines.not_applicable.NotApplicable`, which names it)
RETRACES_PER_ATTRIBUTE = 3


class TracedEngine:
    """The :class:`~torch_sgn.linearization.Engine` of traced, split products.

    Args:
        fmodel: the model as a function of its flat parameters.
        loss: the loss in output space.
        strict: raise ``ValueError`` where the model cannot be traced; otherwise raise
            :class:`~torch_sgn.engines.not_applicable.NotApplicable` (the engine selection
            then uses the functional engine). A model attribute that keeps changing raises
            ``NotApplicable`` either way.
        cuda_graphs: capture the set-up, the product and the trial-point loss of each trace
            as CUDA graphs and replay them (see :class:`Replayed`); where they cannot apply
            (not a CUDA model, random numbers other than dropout's drawn in the forward pass,
            a failed capture; :func:`capture_obstacle`) the engine runs eagerly after a
            one-time warning.
        compile: run each trace's set-up and product compiled by ``torch.compile`` (compiled
            at their first call, once per trace); where compiling fails, the graphs run
            uncompiled after a one-time warning.
    """

    def __init__(
        self,
        fmodel: FunctionalModel,
        loss: OutputLoss,
        strict: bool = False,
        cuda_graphs: bool = False,
        compile: bool = False,
    ):
        self.fmodel, self.loss, self.strict = fmodel, loss, strict
        self.cuda_graphs, self.compile = cuda_graphs, compile
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._warn = WarnOnce()
        self._capture_failed: Optional[str] = None
        # Each cached trace's captured graphs (cuda_graphs=True), dropped with it.
        self._replays: Dict[Traced, Replayed] = {}
        self._attributes: Optional[tuple] = None  # the model's attributes at the last call
        self._retraces: Dict[str, int] = {}  # traces each attribute's change called for
        self._changing: Optional[str] = None  # the attribute that keeps changing, if one does

    def _explain(self, flat: Tensor, args: tuple, targets: Tensor) -> None:
        """Raises the error an eager forward pass and the loss's target check give, where
        they give one: a trace that failed on bad targets or outputs reports those, not
        the trace."""
        with torch.no_grad():
            outputs = self.fmodel(flat, args)
        if isinstance(outputs, Tensor):
            self.loss.check_targets(outputs, targets)

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        fmodel, model = self.fmodel, self.fmodel.model
        args, targets = batch.args, batch.targets
        if self._changing is not None:
            raise NotApplicable(self._changing_reason())
        attributes = self._attributes_now()
        key = (_key(model, flat, args, targets), attributes)
        traced = self._cache.get(key)
        if traced is None and self._retrace_for_attributes(attributes):
            raise NotApplicable(self._changing_reason())
        self._attributes = attributes
        if traced is None:
            state = module_state(model)  # the trace writes fake tensors where forward stores one
            try:
                traced = _trace(fmodel, self.loss, flat, args, targets)
            except Untraceable as why:
                traced = why
            else:
                self._compile(traced)
            finally:
                after = self._attributes_now()
                restore_module_state(state)
            if isinstance(traced, Untraceable) and self.strict:
                self._explain(flat, args, targets)  # the model's or the targets' own error first
                raise ValueError(
                    f"engine='traced' cannot trace this model: {traced}. engine='auto' (the "
                    "default) hands such a model to the torch.func engine, which takes any model"
                ) from None
            if after != attributes:  # written by the forward pass itself: not a setting
                fmodel.written.update(changed_attributes(attributes, after))
                self._attributes = attributes = self._attributes_now()
                key = (key[0], attributes)
            self._cache[key] = traced
            if len(self._cache) > CACHE_SIZE:
                self._replays.pop(self._cache.popitem(last=False)[1], None)
        else:
            self._cache.move_to_end(key)
        if isinstance(traced, Untraceable):
            raise NotApplicable(f"the traced curvature engine cannot trace this model ({traced})")
        if traced.declined is not None:
            self._warn(
                "the traced engine's tangent rules (torch_sgn.engines.traced.jvp_rules) "
                f"failed on this model ({traced.declined}); it uses PyTorch's forward-mode "
                "rules, which give the same products at a higher cost"
            )
        if traced.double_backward:
            stop = fmodel.gradient_stop(flat, args)  # found when traced
            op = traced.missing or "an operator of this model"
            self._warn(
                gradient_stop_notice(stop)
                if stop is not None
                else f"forward-mode AD has no rule for {op}; the traced engine takes J v "
                "through a second reverse pass (exact; a product costs about two reverse passes)"
            )
        buffers, frozen = inputs_of(self.fmodel)
        self.loss.check_targets(_shaped_like(traced, flat), targets)  # reads targets eagerly
        inputs = (flat, buffers, frozen, args, targets)
        replayed = self._replayed(traced, inputs)
        if replayed is not None:
            value, grad, outputs, after = replayed.set_up(inputs)
            if buffers_out is not None and after:  # (training mode: see capture_obstacle)
                after_of = {id(buffers[i]): t for i, t in after.items()}
                buffers_out.update(
                    (n, after_of[id(b)]) for n, b in model.named_buffers() if id(b) in after_of
                )
            return Linearization(
                value, grad, replayed.ggn_vp(), replayed.value_at(), outputs=outputs
            )
        if model.training:  # the step's forward pass updates copies (see buffers_out)
            copies = [b.clone() for b in buffers]
            if buffers_out is not None:
                copy_of = {id(b): c for b, c in zip(buffers, copies)}
                buffers_out.update((n, copy_of[id(b)]) for n, b in model.named_buffers())
            buffers = copies
        setup, product = traced.compiled or (traced.setup, traced.product)
        with torch.no_grad(), fmodel.replay_rng():
            value, grad, outputs, *saved = setup(flat.detach(), *buffers, *frozen, *args, targets)

        def ggn_vp(v: Tensor) -> Tensor:
            with torch.no_grad():
                return product(v, *saved)

        return Linearization(value, grad, ggn_vp, outputs=outputs)

    def _compile(self, traced: Traced) -> None:
        """Sets ``traced.compiled`` where ``compile=True`` applies to the trace."""
        if not self.compile:
            return
        if calls_opaque_loss(traced.setup):  # torch.compile fails on its operators
            self._warn(
                "compile=True does not apply (the loss is called as it is from the graphs: "
                "torch_sgn.engines.traced.opaque_loss); they run uncompiled"
            )
            return

        def failed(reason: str) -> None:
            self._warn(
                f"torch.compile failed on the traced engine's graphs ({reason}); they run "
                "uncompiled"
            )

        traced.compiled = (
            compiled_graph(traced.setup, failed),
            compiled_graph(traced.product, failed),
        )

    def _replayed(self, traced: Traced, inputs: tuple) -> Optional[Replayed]:
        """The trace's captured graphs, captured now if new; ``None``: run eagerly."""
        flat, buffers, frozen, args, targets = inputs
        if not self.cuda_graphs or self._capture_failed is not None:  # (reported when it failed)
            return None
        if traced in self._replays:
            return self._replays[traced]
        if traced.not_captured is None:  # decided once per trace: it reads the whole graph
            training = self.fmodel.model.training
            why = graphs.device_obstacle(flat.device) or capture_obstacle(traced, inputs, training)
            traced.not_captured = why or ""
        if traced.not_captured:
            self._warn(
                f"cuda_graphs=True does not apply ({traced.not_captured}); the traced engine "
                "runs eagerly"
            )
            return None
        try:
            value = trace_value(self.fmodel, self.loss, inputs)
            self._replays[traced] = Replayed(traced, value, inputs, self.fmodel)
        except (RuntimeError, Untraceable) as error:  # an operation that cannot be captured
            self._capture_failed = reason(error)
            self._replays.clear()  # frees the graphs captured before
            self._warn(
                f"capturing the traced engine's work as CUDA graphs failed "
                f"({self._capture_failed}); running eagerly from now on"
            )
            return None
        return self._replays[traced]

    def _attributes_now(self) -> tuple:
        """The model's settings (:meth:`~torch_sgn.model.flat_model.FunctionalModel.settings`) and
        a loss module's attributes (as ``loss.<name>``)."""
        attributes = self.fmodel.settings()
        if isinstance(getattr(self.loss, "fn", None), nn.Module):
            own = model_attributes(self.loss.fn)
            attributes += tuple(
                ("loss." + n, v) for n, v in own if "loss." + n not in self.fmodel.written
            )
        return attributes

    def _retrace_for_attributes(self, attributes: tuple) -> bool:
        """Counts the attributes that changed since the last call (a trace is due); whether
        one has now changed :data:`RETRACES_PER_ATTRIBUTE` times (then :attr:`_changing` names
        it)."""
        if self._attributes is None or self._attributes == attributes:
            return False
        for name in changed_attributes(self._attributes, attributes):
            self._retraces[name] = self._retraces.get(name, 0) + 1
            if self._retraces[name] >= RETRACES_PER_ATTRIBUTE:
                self._changing = name
        return self._changing is not None

    def _changing_reason(self) -> str:
        """Why the attribute that keeps changing (:attr:`_changing`) ends the tracing."""
        name, owner = self._changing, "the model"
        if name.startswith("loss."):
            name, owner = name[len("loss.") :], "the loss"
        return (
            f"{owner}'s attribute {name} changed at {RETRACES_PER_ATTRIBUTE} steps, and a "
            "trace takes such values as constants (hold a value that changes during training "
            "in a buffer (register_buffer) updated in place (fill_, copy_), or pass it to "
            "forward: traces read both anew at every step)"
        )


def _trace(
    fmodel: FunctionalModel, loss: OutputLoss, flat: Tensor, args: Sequence, targets: Tensor
) -> Traced:
    """Traces the product at these shapes (:func:`~.trace.trace_product`), rewrites it
    (:func:`~.passes.rewrite_whole`) and splits it at ``v`` (:func:`~.split.split`); raises
    :class:`Untraceable`."""
    recording = trace_product(fmodel, loss, flat, args, targets)
    rewrite_whole(recording.graph.graph)
    setup, product = split(recording.graph)
    route, declined, missing = recording.route, recording.declined, recording.missing
    return Traced(setup, product, route == "reverse", declined, missing, route=route)


def _shaped_like(traced: Traced, flat: Tensor) -> Tensor:
    """A tensor of the outputs' shape and dtype (no storage of that size), for the targets'
    check."""
    shape, dtype = traced.setup.output_shape, traced.setup.output_dtype
    return torch.zeros((), dtype=dtype, device=flat.device).expand(shape)


def _key(model: nn.Module, flat: Tensor, args: Sequence[Tensor], targets: Tensor) -> tuple:
    """What a trace depends on: the modules, their modes and parameters, the tensors' shapes."""

    def spec(t: object) -> object:
        if isinstance(t, Tensor):
            return (tuple(t.shape), t.dtype, t.device, t.requires_grad)
        return ("python", type(t).__name__, repr(t))

    hooked = [bool(m._forward_hooks or m._forward_pre_hooks) for m in model.modules()]
    return (
        tuple((id(m), m.training, h) for m, h in zip(model.modules(), hooked)),
        tuple((id(p), p.requires_grad) for p in model.parameters()),
        tuple((name, id(b), spec(b)) for name, b in model.named_buffers()),
        bool(nn.modules.module._global_forward_hooks),
        bool(nn.modules.module._global_forward_pre_hooks),
        backward_hook_handles(model),  # J v by double backward, through these hooks
        spec(flat),
        tuple(spec(a) for a in args),
        spec(targets),
    )
