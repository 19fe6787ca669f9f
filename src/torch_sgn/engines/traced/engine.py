r"""The traced curvature engine: ``G v`` at about one gradient for any traceable model.

The functional engine (:mod:`torch_sgn.model.flat_model`) re-runs the whole forward pass with
forward-mode AD at every product, and the layer-wise engine
(:mod:`torch_sgn.engines.layerwise.engine`) only
knows ``nn.Sequential`` chains of known layers. This engine takes any model whose forward pass
``torch.fx`` can trace into a graph of ATen operators (residual connections, batch and layer
normalization, embeddings, attention, recurrent layers, custom ``forward`` methods):

1. Once per input shape, dtype, device and training mode it traces (``make_fx`` on fake
   tensors) the function ``(theta, v, buffers, inputs, targets) -> (loss, g, G v)``: one
   forward pass carrying the tangent ``v`` (forward-mode AD gives ``z = f(theta)`` and
   ``J v`` together), the loss and its output gradient, ``g = J^T dz`` and ``G v = J^T H J v``
   through the reverse pass of that same forward pass.
2. It splits the graph at the operators that depend on ``v``. The rest (the forward pass, the
   loss, the gradient, the loss's Hessian factors and every quantity the tangent formulas need
   that does not involve ``v``) runs **once per step**; the part that depends on ``v`` (the
   tangent pass and one reverse pass) runs at every CG iteration, reading what the first part
   left behind. An activation's derivative (GELU's, SiLU's, ...) is one such quantity: the
   products multiply by it where they would evaluate it twice (:data:`HOIST_DERIVATIVES`).
   A matrix product of embedding rows is taken on the embedding table where the table has
   fewer rows than the batch has tokens (:data:`EMBEDDING_PRODUCTS`).

Training-mode batch normalization stays exact (its batch statistics are differentiated, so the
samples are coupled as in the gradient), its running statistics are updated once per step into
``buffers_out``; random numbers (dropout) are drawn once per step, with the random state the
step replays (:meth:`~torch_sgn.model.flat_model.FunctionalModel.consistent`). Where an operator has
no forward-mode rule, ``J v`` is traced through the reverse pass instead
(``J v = d/du [(J^T u) . v]``). While tracing, attention uses PyTorch's math kernel and
recurrent layers their non-mkldnn kernels: the fused kernels have no forward-mode rules, the
math is the same.

With ``cuda_graphs=True`` (:class:`_Replayed`) the set-up, the product and the loss at a trial
point (traced once more) are captured as CUDA graphs and replayed: on a GPU a small or
recurrent model's step then costs its kernels, not their launches. With ``compile=True`` the
set-up and the product run compiled by ``torch.compile`` (:func:`_compiled`), which fuses
the tangent and reverse passes' elementwise operations.

A model that cannot be traced (control flow that depends on the values of tensors, ``.item()``
in ``forward``, an output that is not one tensor) falls back to the functional engine, with the
reason in a one-time warning; ``strict`` raises instead. Python state that ``forward`` reads
other than the modules' ``training`` flags and the shapes of its inputs is fixed at tracing.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, fx, nn
from torch.func import functional_call

from ...diagnostics import warn
from ...linearization import Batch, Linearization
from ...losses import OutputLoss
from ...model.attributes import (
    changed_attributes,
    model_attributes,
    module_state,
    restore_module_state,
)
from ...model.flat_model import ConstantOutputError, FunctionalModel, check_depends
from ...model.forward_mode import (
    NESTED_FORWARD,
    backward_hook_handles,
    gradient_stop_notice,
    missing_rule,
)
from .. import cuda_graphs as graphs
from ..functional import FunctionalEngine
from .jvp_rules import TangentRules

__all__ = ["TracedEngine", "Untraceable"]

_aten = torch.ops.aten

#: traces kept per engine (one per input shape, dtype, device and training mode); the oldest
#: is dropped beyond this
CACHE_SIZE = 8

#: record the products with the tangent formulas of :mod:`torch_sgn.engines.traced.jvp_rules` (PyTor
#: own forward-mode rules where False; the products are the same)
TANGENT_RULES = True

#: rewrite the recorded graphs: ``add`` of a matrix product into ``addmm`` / ``baddbmm``, and
#: one node for operations repeated on the same arguments (the results are the same)
GRAPH_PASSES = True

#: an activation's derivative (``gelu_backward(grad, x)``, :data:`DERIVATIVES`) taken once per
#: step as a factor, ``gelu_backward(1, x)``, where ``x`` does not depend on the product's
#: vector: a tangent and a reverse pass then multiply by it (the results agree to rounding)
HOIST_DERIVATIVES = True

#: a matrix product added to a temporary that nothing else reads (``addmm(c, a, b)``, as a
#: linear layer's tangent ``x dW^T + dx W^T`` has it) accumulates into that temporary in place
#: instead of copying it first (the results are the same)
ACCUMULATE_IN_PLACE = True

#: a matrix product of looked-up embedding rows, ``E[idx] @ B``, taken as ``(E @ B)[idx]``, and
#: the reverse pass's ``embedding_backward(G @ W)`` as ``embedding_backward(G) @ W``, where the
#: table has fewer rows than the lookup (an embedding that feeds a linear or recurrent layer
#: directly): the product then has the table's rows, not the batch's tokens (the results agree
#: to rounding)
EMBEDDING_PRODUCTS = True

#: a model attribute (a plain Python value a module holds, read by ``forward``: a temperature,
#: a flag) that changed this many times, each time calling for a new trace, hands the model to
#: the functional engine, with a warning that names it
RETRACES_PER_ATTRIBUTE = 3


class Untraceable(Exception):
    """The model cannot be traced into one graph; the message says why."""


@dataclass
class _Traced:
    """A product split in two graphs, with what it needs to be called."""

    setup: fx.GraphModule  # (theta, buffers, frozen, inputs, targets) -> (loss, g, z, *saved)
    product: fx.GraphModule  # (v, *saved) -> G v
    double_backward: bool  # J v through the reverse pass (an operator has no forward rule)
    declined: Optional[str] = None  # why the tangent rules were not used, where they failed
    missing: Optional[str] = None  # the operator without a forward-mode rule (double backward)
    replayed: Optional[_Replayed] = None  # the graphs captured (cuda_graphs=True)
    compiled: Optional[Tuple[Callable, Callable]] = None  # set-up and product (compile=True)
    not_captured: Optional[str] = None  # why graphs do not apply ("": they do; None: not asked)
    route: str = "forward"  # how J v was traced (one of ROUTES)


class TracedEngine:
    """The :class:`~torch_sgn.linearization.Engine` of traced, split products.

    Args:
        fmodel: the model as a function of its flat parameters.
        loss: the loss in output space.
        strict: raise ``ValueError`` where the model cannot be traced; otherwise use the
            functional engine for it, with a warning the first time.
        cuda_graphs: capture the set-up, the product and the trial-point loss of each trace
            as CUDA graphs and replay them (see :class:`_Replayed`); where they cannot apply
            (not a CUDA model, random numbers other than dropout's drawn in the forward pass,
            a failed capture; :func:`_capture_obstacle`) the engine runs eagerly after a
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
        self._functional = FunctionalEngine(fmodel, loss)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._warned: set = set()
        self._capture_failed: Optional[str] = None
        self._attributes: Optional[tuple] = None  # the model's attributes at the last call
        self._retraces: Dict[str, int] = {}  # traces each attribute's change called for
        self._changing: Optional[str] = None  # the attribute that keeps changing, if one does

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        fmodel, model = self.fmodel, self.fmodel.model
        args, targets = batch.args, batch.targets
        if self._changing is not None:
            return self._functional(flat, batch, buffers_out)
        attributes = self._attributes_now()
        key = (_key(model, flat, args, targets), attributes)
        traced = self._cache.get(key)
        if traced is None and self._retrace_for_attributes(attributes):
            name, owner = self._changing, "the model"
            if name.startswith("loss."):
                name, owner = name[len("loss.") :], "the loss"
            self._warn(
                f"{owner}'s attribute {name} changed at {RETRACES_PER_ATTRIBUTE} "
                "steps, and a trace takes such values as constants: the traced engine hands "
                "the model to the functional engine, which re-runs the forward pass at every "
                "G v product. Hold a value that changes during training in a buffer "
                "(register_buffer) updated in place (fill_, copy_), or pass it to forward: "
                "traces read both anew at every step"
            )
            return self._functional(flat, batch, buffers_out)
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
                raise ValueError(f"engine='traced' cannot trace this model: {traced}") from None
            if after != attributes:  # written by the forward pass itself: not a setting
                fmodel.written.update(changed_attributes(attributes, after))
                self._attributes = attributes = self._attributes_now()
                key = (key[0], attributes)
            self._cache[key] = traced
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(traced, Untraceable):
            # the functional engine first: where the trace failed on bad input (targets of the
            # wrong shape) its error is the one to read, without a warning about the trace
            lin = self._functional(flat, batch, buffers_out)
            self._warn(
                f"the traced curvature engine cannot trace this model ({traced}); using the "
                "functional engine, which re-runs the forward pass at every G v product"
            )
            if self.cuda_graphs:
                self._warn(
                    "cuda_graphs=True does not apply (the functional engine captures no "
                    "CUDA graphs); running eagerly"
                )
            return lin
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
        buffers, frozen = _inputs_of(model)
        self.loss.check_targets(_shaped_like(traced, flat), targets)  # reads targets eagerly
        inputs = (flat, buffers, frozen, args, targets)
        replayed = self._replayed(traced, inputs)
        if replayed is not None:
            value, grad, outputs, after = replayed.set_up(inputs)
            if buffers_out is not None and after:  # (training mode: see _capture_obstacle)
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

    def _compile(self, traced: _Traced) -> None:
        """Sets ``traced.compiled`` where ``compile=True`` applies to the trace."""
        if not self.compile:
            return

        def failed(reason: str) -> None:
            self._warn(
                f"torch.compile failed on the traced engine's graphs ({reason}); they run "
                "uncompiled"
            )

        traced.compiled = (_compiled(traced.setup, failed), _compiled(traced.product, failed))

    def _replayed(self, traced: _Traced, inputs: tuple) -> Optional[_Replayed]:
        """The trace's captured graphs, captured now if new; ``None``: run eagerly."""
        flat, buffers, frozen, args, targets = inputs
        if not self.cuda_graphs or self._capture_failed is not None:  # (reported when it failed)
            return None
        if traced.replayed is not None:
            return traced.replayed
        if traced.not_captured is None:  # decided once per trace: it reads the whole graph
            training = self.fmodel.model.training
            why = graphs.device_obstacle(flat.device) or _capture_obstacle(traced, inputs, training)
            traced.not_captured = why or ""
        if traced.not_captured:
            self._warn(
                f"cuda_graphs=True does not apply ({traced.not_captured}); the traced engine "
                "runs eagerly"
            )
            return None
        try:
            value = _trace_value(self.fmodel, self.loss, inputs)
            traced.replayed = _Replayed(traced, value, inputs, self.fmodel)
        except (RuntimeError, Untraceable) as error:  # an operation that cannot be captured
            self._capture_failed = _reason(error)
            for other in self._cache.values():  # frees the graphs captured before
                if isinstance(other, _Traced):
                    other.replayed = None
            self._warn(
                f"capturing the traced engine's work as CUDA graphs failed "
                f"({self._capture_failed}); running eagerly from now on"
            )
            return None
        return traced.replayed

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

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warn(message)


def _capture_obstacle(traced: _Traced, inputs: tuple, training: bool) -> Optional[str]:
    """Why a trace's graphs cannot be captured; ``None`` if they can be tried."""
    flat, buffers, frozen, args, targets = inputs
    if not all(isinstance(a, Tensor) for a in args):
        return "the model takes inputs that are not tensors"
    written = _written_inputs(traced.setup)
    if any(not 1 <= i <= len(buffers) for i in written):
        return (
            "the forward pass writes into its inputs or parameters, which a replayed graph "
            "would write into its own copies of them"
        )
    if written and not training:  # eager passes write into the model's own buffers then
        return (
            "the forward pass writes into the model's buffers in evaluation mode, which a "
            "replayed graph would write into its own copies of them"
        )
    try:
        _, draws = _draws_as_inputs(traced.setup)
    except Untraceable as why:
        return (
            "the forward pass draws random numbers that a replayed graph would not draw as the "
            f"trial points do ({why}; dropout's masks are taken out of the graphs)"
        )
    if draws and not training:  # eager steps freeze no random state then: each pass draws anew
        return (
            "the forward pass draws random numbers in evaluation mode (dropout kept on), "
            "which eager steps draw anew at every trial point and replayed graphs would not"
        )
    return None


def _written_inputs(graph: fx.GraphModule) -> List[int]:
    """The positions of the inputs of ``graph`` that an operator of it writes into, running
    statistics included (:func:`_statistics_written`)."""
    nodes = graph.graph.nodes
    written = _written_memory(graph.graph)
    written |= {_memory_of(w) for n in nodes for w in _statistics_written(n)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    return [i for i, node in enumerate(placeholders) if node in written]


def _copies_of_written(
    tensors: List[Tensor], written: List[int]
) -> Tuple[List[Tensor], Dict[int, Tensor]]:
    """``tensors`` with those at the positions ``written`` replaced by copies, and the copies by
    position (a graph that writes into them is replayed after copying the originals in)."""
    copies = {i: tensors[i].clone() for i in written}
    return [copies.get(i, t) for i, t in enumerate(tensors)], copies


def _random_draw(graph: fx.GraphModule) -> Optional[str]:
    """The name of an operator of ``graph`` that draws random numbers; ``None`` if none does."""
    return next((n.target.name() for n in graph.graph.nodes if _draws_random(n)), None)


def _compiled(graph: fx.GraphModule, failed: Callable[[str], None]) -> Callable:
    """``graph`` compiled by ``torch.compile`` (at its first call, for the shapes it was
    traced at); where compiling or the compiled code fails, ``graph`` itself from then on,
    after ``failed(reason)``. A graph that draws random numbers (the set-up's dropout masks)
    draws them with PyTorch's own operators in the graph's order (Inductor's
    ``fallback_random``), as the trial points' eager passes draw them."""
    options = {"fallback_random": True} if _random_draw(graph) is not None else None
    compiled = torch.compile(graph, dynamic=False, options=options)
    broken = False

    def call(*args: Tensor) -> object:
        nonlocal broken
        if broken:
            return graph(*args)
        try:
            return compiled(*args)
        except Exception as error:  # noqa: BLE001 - any failure of the compiler: run uncompiled
            broken = True
            failed(_reason(error))
            return graph(*args)

    return call


class _Replayed:
    """A trace's set-up, product and trial-point loss captured as CUDA graphs over static
    inputs.

    A step copies the parameters, buffers, frozen parameters, inputs and targets into the
    static inputs and replays the set-up, whose outputs (the loss, the gradient, the outputs
    and what the products read) stay where the capture put them; each product copies its
    vector in and replays the product's graph, each trial point its parameters and the loss's
    graph (a forward pass and the loss, traced apart). They run hundreds of kernels where a
    model is small or recurrent, each launched once per replay instead of once per operator
    call. Buffers that a training-mode pass writes into (batch normalization's running
    statistics) are copied inside the set-up's and the loss's graphs first, as an eager pass
    writes into copies of the model's: the set-up's copies are the step's buffers afterwards,
    the loss's are dropped. Dropout's masks are inputs of both graphs, drawn eagerly before
    each set-up from the step's random state (:func:`_draws_as_inputs`). A linearization's
    products and losses are valid until the next set-up of the same trace replaces what they
    read; one called later raises.
    """

    def __init__(self, traced: _Traced, value: fx.GraphModule, inputs, fmodel: FunctionalModel):
        flat, buffers, frozen, args, targets = inputs
        self.fmodel = fmodel
        self.static = [t.detach().clone() for t in (flat, *buffers, *frozen, *args, targets)]
        self.v, self.point = torch.zeros_like(self.static[0]), self.static[0].clone()
        # Random draws (dropout's masks) become inputs that each set-up draws eagerly, so that
        # the set-up and the trial points see the same ones, as eager passes do.
        layouts = _drawn_layouts(traced.setup, self.static, fmodel)
        setup, self.draws = _draws_as_inputs(traced.setup, layouts)
        value, trial_draws = _draws_as_inputs(value, layouts)
        if trial_draws != self.draws:
            raise Untraceable("the loss's trace draws other random numbers than the set-up's")
        self.drawn = [d.empty(flat.device) for d in self.draws]
        # Each graph's inputs: the static ones and the draws, those it writes into replaced by
        # copies, into which each run copies its sources first.
        setup_from = [*self.static, *self.drawn]
        trial_from = [self.point, *self.static[1:], *self.drawn]
        setup_in, setup_copies = _copies_of_written(setup_from, _written_inputs(setup))
        trial_in, trial_copies = _copies_of_written(trial_from, _written_inputs(value))
        # the buffers' copies, by position among the buffers: the step's buffers afterwards
        self.buffers_after = {i - 1: c for i, c in setup_copies.items() if 1 <= i <= len(buffers)}
        self.generation = 0
        self.out: List[Tensor] = []
        self.gv: Optional[Tensor] = None
        self.value: Optional[Tensor] = None

        # Each drops the last run's outputs first: the capture runs each function after an
        # uncaptured run, whose outputs would otherwise stay alive through it.
        def set_up() -> None:
            self.out, self.gv = [], None
            for i, into in setup_copies.items():
                into.copy_(setup_from[i])
            self.out = setup(*setup_in)

        def product() -> None:
            self.gv = None
            self.gv = traced.product(self.v, *self.out[3:])

        def trial() -> None:
            self.value = None
            for i, into in trial_copies.items():
                into.copy_(trial_from[i])
            out = value(*trial_in)  # (a list of one where make_fx flattened its outputs)
            self.value = out[0] if isinstance(out, (list, tuple)) else out

        with torch.no_grad():
            replays = graphs.capture([set_up, product, trial], flat.device)
        self._set_up, self._product, self._trial = replays

    def set_up(self, inputs) -> Tuple[Tensor, Tensor, Tensor, Dict[int, Tensor]]:
        """Replays the set-up at ``inputs`` (flat parameters, buffers, frozen parameters,
        inputs, targets): ``(loss, grad, outputs, buffers)``, copies that the next replay does
        not overwrite; ``buffers`` maps the position in ``inputs``' buffers of each buffer the
        pass wrote into to its value afterwards."""
        flat, buffers, frozen, args, targets = inputs
        with torch.no_grad():
            with self.fmodel.replay_rng():  # the random state the step's passes replay
                for drawn, draw in zip(self.drawn, self.draws):
                    drawn.copy_(draw(drawn.device))
            for static, t in zip(self.static, (flat, *buffers, *frozen, *args, targets)):
                static.copy_(t)
            self._set_up()
        self.generation += 1
        value, grad, outputs = (t.clone() for t in self.out[:3])
        return value, grad, outputs, {i: t.clone() for i, t in self.buffers_after.items()}

    def _check(self, generation: int) -> None:
        if self.generation != generation:
            raise RuntimeError(
                "this linearization's G v products and losses were captured as CUDA graphs and "
                "a later step on the same batch shape has replaced the point they read; take "
                "them before the next step, or build SGN with cuda_graphs=False"
            )

    def ggn_vp(self) -> Callable[[Tensor], Tensor]:
        """``v -> G v`` at the last set-up."""
        return self._replayer(self.v, self._product, lambda: self.gv)

    def value_at(self) -> Callable[[Tensor], Tensor]:
        """``flat -> loss`` on the last set-up's batch."""
        return self._replayer(self.point, self._trial, lambda: self.value)

    def _replayer(
        self, static_in: Tensor, replay: Callable[[], None], output: Callable[[], Tensor]
    ) -> Callable[[Tensor], Tensor]:
        """``x -> f(x)`` by one graph: ``x`` copied into its static input, the graph replayed,
        a copy of ``output()`` returned (read after the replay: the CPU stand-in of a replay
        sets it anew); valid until the next set-up."""
        generation = self.generation

        def replayed(x: Tensor) -> Tensor:
            self._check(generation)
            with torch.no_grad():
                static_in.copy_(x)
                replay()
                return output().clone()

        return replayed


@dataclass(frozen=True)
class _Draw:
    """One random draw of a graph, taken out of it (:func:`_draws_as_inputs`): dropout's mask
    (``native_dropout``, as CUDA's dropout records it) or a Bernoulli sample (``bernoulli_``
    into a new tensor, as the CPU's does)."""

    op: str  # "native_dropout" or "bernoulli_"
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]  # (random numbers are taken in the order of memory)
    dtype: torch.dtype  # of the dropped tensor (native_dropout) or of the sample
    p: float  # the drop probability (native_dropout), the probability of a one (bernoulli_)

    def empty(self, device: torch.device) -> Tensor:
        """A tensor to hold the draw (the mask, or the sample), zeros until drawn."""
        dtype = torch.bool if self.op == "native_dropout" else self.dtype
        held = torch.empty_strided(self.shape, self.stride, dtype=dtype, device=device)
        return held.zero_()

    def __call__(self, device: torch.device) -> Tensor:
        """The draw, from the random numbers the graph's operator would have taken here (the
        same where the dropped tensor's memory is aligned as a new tensor's is)."""
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        if self.op == "native_dropout":  # its mask does not depend on the values
            return _aten.native_dropout.default(out.fill_(1), self.p, True)[1]
        return out.bernoulli_(self.p)


#: operators that make a new tensor without reading any (its values are not set)
_NEW_TENSORS = (
    _aten.empty_like.default,
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
)


def _is_new_tensor(node: object, filled_by: fx.Node) -> bool:
    """Whether ``node`` makes a new tensor that nothing reads before ``filled_by`` fills it."""
    if not (
        isinstance(node, fx.Node) and node.op == "call_function" and node.target in _NEW_TENSORS
    ):
        return False
    between = node.next
    while between is not filled_by:
        if between in node.users:
            return False
        between = between.next
    return True


def _draws_for_real(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (``native_dropout`` in evaluation mode does not,
    though tagged as random)."""
    if not _draws_random(node) or not node.args:
        return False
    if node.target is not _aten.native_dropout.default:
        return True
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return train is not False


def _layout(t: Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    return tuple(t.shape), tuple(t.stride())


def _drawn_layouts(
    gm: fx.GraphModule, inputs: Sequence[Tensor], fmodel: FunctionalModel
) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """The shapes and strides of the tensors that ``gm``'s random operators draw for (the
    dropped tensor, the sample's tensor), in the graph's order, as the real kernels lay them
    out: ``gm`` run once on ``inputs`` (a fake tensor's strides may differ from the real one's,
    and random numbers are taken in the order of memory). The random state is left as it was;
    what the run writes into ``inputs`` is the caller's to refresh."""
    layouts = []
    if not any(_draws_for_real(n) for n in gm.graph.nodes):
        return layouts

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> object:
            if _draws_for_real(node) and isinstance(node.args[0], fx.Node):
                layouts.append(_layout(self.env[node.args[0]]))
            return super().run_node(node)

    devices = [inputs[0].device] if inputs[0].device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices), fmodel.replay_rng():
        Recorder(gm).run(*inputs)
    return layouts


def _draws_as_inputs(
    gm: fx.GraphModule, layouts: Optional[Sequence[tuple]] = None
) -> Tuple[fx.GraphModule, List[_Draw]]:
    """A copy of ``gm`` (with flat inputs) whose random draws are inputs appended to its own,
    and the draws in the graph's order (laid out as ``layouts`` says, by default as the fake
    tensors of the trace are). ``native_dropout(x, p)`` becomes
    ``native_dropout_backward(x, mask, 1 / (1 - p))``, which computes its output from its mask
    as the kernel does; ``bernoulli_(empty, p)`` the sample. Raises :class:`Untraceable` for
    another random operator, or an unexpected use of one."""
    graph = fx.Graph()  # a copy with flat inputs and outputs (make_fx's take pytrees)
    graph.output(graph.graph_copy(gm.graph, {}))
    draws: List[_Draw] = []
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for node in list(graph.nodes):
        if not _draws_for_real(node):
            continue
        dropout = node.target is _aten.native_dropout.default
        bernoulli = node.target is _aten.bernoulli_.float and not node.kwargs.get("generator")
        into = node.args[0] if bernoulli else None
        if not (dropout or (bernoulli and _is_new_tensor(into, node))):
            raise Untraceable(f"a random operator that stays in the graph ({node.target})")
        val = node.meta.get("val")
        with graph.inserting_after(last):
            last = graph.placeholder(f"drawn_{len(draws)}")
        if dropout:
            x, p = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["p"]
            x_val = x.meta["val"]
            layout = layouts[len(draws)] if layouts else _layout(x_val)
            draws.append(_Draw("native_dropout", *layout, x_val.dtype, float(p)))
            scale = 1.0 / (1.0 - p) if p < 1 else 0.0
            with graph.inserting_before(node):
                out = graph.call_function(_aten.native_dropout_backward.default, (x, last, scale))
            for user in list(node.users):
                if user.target is not operator.getitem or user.args[1] not in (0, 1):
                    raise Untraceable(f"an unexpected use of {node.target}")
                user.replace_all_uses_with(out if user.args[1] == 0 else last)
                graph.erase_node(user)
            graph.erase_node(node)
        else:
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            layout = layouts[len(draws)] if layouts else _layout(val)
            draws.append(_Draw("bernoulli_", *layout, val.dtype, float(p)))
            node.replace_all_uses_with(last)
            into.replace_all_uses_with(last)  # (a new tensor: it held nothing before the draw)
            graph.erase_node(node)
            if not into.users:
                graph.erase_node(into)
    graph.lint()
    return fx.GraphModule(gm, graph), draws


def _shaped_like(traced: _Traced, flat: Tensor) -> Tensor:
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


# --- tracing -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _plain_kernels() -> object:
    """Kernels with forward-mode rules: the math attention kernel, recurrent layers without
    oneDNN and cuDNN (cuDNN's also reads its weights' data pointers, which the tracer's fake
    tensors do not have). Only the tracing runs under it: convolutions are recorded as
    ``aten.convolution``, which picks cuDNN again when the graph runs."""
    mkldnn, cudnn = torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled
    torch.backends.mkldnn.enabled = False
    torch.backends.cudnn.enabled = False
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, torch.backends.mkldnn, "enabled", mkldnn)
        stack.callback(setattr, torch.backends.cudnn, "enabled", cudnn)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # torch >= 2.3

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        except ImportError:  # pragma: no cover - older torch
            stack.enter_context(
                torch.backends.cuda.sdp_kernel(
                    enable_flash=False, enable_math=True, enable_mem_efficient=False
                )
            )
        yield


@contextlib.contextmanager
def _plain_checkpoints() -> object:
    """Non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint`` with
    ``use_reentrant=False``) runs the checkpointed function plainly: its saved-tensor hooks
    cannot be traced, and a trace's set-up keeps what the products read anyway, so recomputing
    would save no memory. (Its private generator is replaced while tracing; a torch without it
    traces as before.)"""
    from torch.utils import checkpoint

    name = "_checkpoint_without_reentrant_generator"
    original = getattr(checkpoint, name, None)
    if original is None:  # pragma: no cover - another torch
        yield
        return

    def plain(*args: object, **kwargs: object):
        yield  # no hooks: the function runs once, as written

    setattr(checkpoint, name, plain)
    try:
        yield
    finally:
        setattr(checkpoint, name, original)


def _slots(model: nn.Module, buffers: bool) -> List[Tuple[str, Tensor]]:
    """``(name, tensor)`` for every parameter (or buffer) slot of every module, each module
    once under its first name. ``functional_call`` swaps tensors in by name and back; a module
    reachable by two names would be swapped twice and keep the swapped-in tensor, so every
    slot is named once and tied tensors are passed under each of their slots."""
    out = []
    for prefix, module in model.named_modules():
        own = module.named_buffers if buffers else module.named_parameters
        for name, tensor in own(prefix=prefix, recurse=False, remove_duplicate=False):
            out.append((name, tensor))
    return out


def _inputs_of(model: nn.Module) -> Tuple[List[Tensor], List[Tensor]]:
    """The buffers and frozen parameters the traced function takes, each tensor once."""
    buffers = list({id(b): b for _, b in _slots(model, buffers=True)}.values())
    frozen = {id(p): p for _, p in _slots(model, buffers=False) if not p.requires_grad}
    return buffers, list(frozen.values())


def _forward(fmodel: FunctionalModel) -> Callable:
    """``(theta, buffers, frozen, inputs) -> outputs``: the model as a function of its flat
    trainable parameters, its buffers and frozen parameters (each tensor once), to be traced."""
    model = fmodel.model
    buffers_in, frozen_in = _inputs_of(model)
    buffer_at = {id(b): i for i, b in enumerate(buffers_in)}
    frozen_at = {id(p): i for i, p in enumerate(frozen_in)}
    trainable_at = {id(p): i for i, p in enumerate(fmodel.params)}
    buffer_slots = [(name, buffer_at[id(b)]) for name, b in _slots(model, buffers=True)]
    param_slots = [
        (name, id(p) in trainable_at, trainable_at.get(id(p), frozen_at.get(id(p))))
        for name, p in _slots(model, buffers=False)
    ]

    def forward(theta: Tensor, buffers: List[Tensor], frozen: List[Tensor], inputs) -> Tensor:
        chunks = [c.view(s) for c, s in zip(theta.split(fmodel.numels), fmodel.shapes)]
        tensors = {name: buffers[i] for name, i in buffer_slots}
        tensors.update((name, chunks[i] if t else frozen[i]) for name, t, i in param_slots)
        with fmodel.composites(), fmodel.eager_compiled():
            out = functional_call(model, tensors, tuple(inputs), tie_weights=False)
        if not isinstance(out, Tensor):
            raise Untraceable(
                f"the model's forward returns {type(out).__name__}, not one tensor; wrap the "
                "model to select the output the loss uses"
            )
        return out

    return forward


def _value(fmodel: FunctionalModel, loss: OutputLoss) -> Callable:
    """``(theta, buffers, frozen, inputs, targets) -> loss``, to be traced."""
    forward = _forward(fmodel)

    def value(theta, buffers, frozen, inputs, targets):
        with torch.enable_grad() if fmodel.calls_autograd else torch.no_grad():
            return loss.value(forward(theta, buffers, frozen, inputs), targets).detach()

    return value


#: How the traced function takes ``J v``: ``"forward"`` with the dual tensors of
#: ``torch.autograd.forward_ad``; ``"transform"`` with ``torch.func.jvp``, where forward itself
#: takes forward-mode derivatives (``torch.func.hessian``, ``jacfwd``: functorch's forward
#: mode nests, forward_ad's does not); ``"reverse"`` through the reverse pass,
#: ``J v = d/du [(J^T u) . v]``, where an operator has no forward-mode rule or the gradient
#: stops.
ROUTES = ("forward", "transform", "reverse")


def _whole(fmodel: FunctionalModel, loss: OutputLoss, route: str, rules: bool = True) -> Callable:
    """``(theta, v, buffers, frozen, inputs, targets) -> (loss, g, z, G v)``, to be traced,
    with ``J v`` by ``route`` (one of :data:`ROUTES`)."""
    forward = _forward(fmodel)

    def whole(theta, v, buffers, frozen, inputs, targets):
        theta = theta.detach().requires_grad_(True)
        with torch.enable_grad():
            if route == "reverse":
                out = forward(theta, buffers, frozen, inputs)
                u = torch.zeros_like(out, requires_grad=True)
                (vjp,) = torch.autograd.grad(out, theta, u, create_graph=True)
                (jv,) = torch.autograd.grad(vjp, u, v)
            elif route == "transform":
                return _whole_by_transforms(
                    forward, loss, theta, v, buffers, frozen, inputs, targets
                )
            else:
                mode = TangentRules() if rules else contextlib.nullcontext()
                with fwAD.dual_level(), mode:
                    out, jv = fwAD.unpack_dual(
                        forward(fwAD.make_dual(theta, v), buffers, frozen, inputs)
                    )
            check_depends(out)
            z = out.detach().requires_grad_(True)
            value = loss.value(z, targets)
            (dz,) = torch.autograd.grad(value, z)
            hjv = loss.hessian(out.detach(), targets)(jv)
            (grad,) = torch.autograd.grad(out, theta, dz, retain_graph=True, allow_unused=True)
            check_depends(out, grad)
            (gv,) = torch.autograd.grad(out, theta, hjv)
        return value.detach(), grad, out.detach(), gv

    return whole


def _whole_by_transforms(forward, loss, theta, v, buffers, frozen, inputs, targets):
    """``whole``'s results by ``torch.func`` alone (:data:`ROUTES`: ``"transform"``); autograd's
    reverse pass through ``torch.func.jvp``'s outputs does not trace on fake tensors."""

    def f(t: Tensor) -> Tensor:
        return forward(t, buffers, frozen, inputs)

    theta = theta.detach()
    out, pullback = torch.func.vjp(f, theta)
    _, jv = torch.func.jvp(f, (theta,), (v,))  # (its primal pass is the set-up's: no v)
    z = out.detach().requires_grad_(True)
    value = loss.value(z, targets)
    (dz,) = torch.autograd.grad(value, z)
    hjv = loss.hessian(out.detach(), targets)(jv)
    (grad,) = pullback(dz)
    (gv,) = pullback(hjv)
    return value.detach(), grad, out.detach(), gv


def _make_fx(fn: Callable, *example: object, stateless: bool = False) -> fx.GraphModule:
    """``fn`` traced on fake tensors; where that fails on torch.func's transforms inside forward
    and the model has no buffers (``stateless``), on the real tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*example)
    except TypeError as error:  # pragma: no cover - a torch without the keyword
        if "_allow_non_fake_inputs" not in str(error):
            raise
        return make_fx(fn, tracing_mode="fake")(*example)
    except RuntimeError as error:
        if not _meta_leak(error):
            raise
        if not stateless:
            raise Untraceable(
                "torch.func's transforms inside forward (hessian, jacfwd, jacrev) under "
                "autograd's reverse pass cannot be traced on fake tensors, and a real trace "
                "would write into this model's buffers; Taylor-mode operators that avoid nested "
                f"AD (torch_sgn.pinn.operators.laplacian(u, x)) trace ({_reason(error)})"
            ) from error
    # torch.func's transforms in forward (vmap(hessian(u))) under autograd's reverse pass leak
    # meta tensors out of the fake ones (torch 2.13): traced on the real tensors instead, which
    # costs one real pass and writes into nothing where the model has no buffers
    return make_fx(fn, tracing_mode="real")(*example)


def _meta_leak(error: BaseException) -> bool:
    """Whether ``error`` is a fake-tensor trace that met a meta tensor it did not make."""
    message = str(error)
    return "meta" in message and "device" in message


def _trace(
    fmodel: FunctionalModel, loss: OutputLoss, flat: Tensor, args: Sequence, targets: Tensor
) -> _Traced:
    """Traces the product at these shapes and splits it; raises :class:`Untraceable`."""
    buffers, frozen = _inputs_of(fmodel.model)
    example = (flat.detach(), torch.zeros_like(flat), buffers, frozen, list(args), targets)
    errors: List[BaseException] = []
    declined = None  # why the tangent rules could not be used, if they could not
    # where the gradient stops (torch.no_grad) forward mode does not: reverse mode alone
    stops = fmodel.gradient_stop(flat, args) is not None
    for route in ("reverse",) if stops else ROUTES:
        if route == "transform" and not (errors and _nests(errors[-1])):
            continue  # (only where forward_ad's forward mode would nest)
        try:
            with _plain_kernels(), _plain_checkpoints():
                if TANGENT_RULES and route == "forward":
                    try:
                        whole = _whole(fmodel, loss, route, rules=True)
                        graph = _make_fx(whole, *example, stateless=not buffers)
                        break
                    except (Untraceable, ConstantOutputError):
                        raise
                    except Exception as error:  # noqa: BLE001 - PyTorch's own rules may work
                        if _nests(error):
                            raise
                        declined = _reason(error)
                whole = _whole(fmodel, loss, route, rules=False)
                graph = _make_fx(whole, *example, stateless=not buffers)
            break
        except (Untraceable, ConstantOutputError):
            raise
        except (NotImplementedError, RuntimeError) as error:
            if not (isinstance(error, NotImplementedError) or _nests(error)):
                raise Untraceable(_reason(error)) from error
            # a forward-mode rule is missing, or forward mode nests: the next route
            errors.append(error)
            declined = None  # the other routes record no tangent rules: nothing to report
            continue
        except Exception as error:  # noqa: BLE001 - any failure to trace means: not traceable
            raise Untraceable(_reason(error)) from error
    else:
        raise Untraceable(_reason(errors[-1]))
    if HOIST_DERIVATIVES:
        _hoist_derivatives(graph.graph)
    if EMBEDDING_PRODUCTS:
        _reorder_embedding_products(graph.graph)
    _views_as_reshapes(graph.graph)
    setup, product = _split(graph)
    missing = missing_rule(errors[-1]) if route == "reverse" and errors else None
    return _Traced(setup, product, route == "reverse", declined, missing, route=route)


def _nests(error: BaseException) -> bool:
    """Whether ``error`` says forward_ad's forward mode would nest in the model's own."""
    return missing_rule(error) == NESTED_FORWARD


def _trace_value(fmodel: FunctionalModel, loss: OutputLoss, inputs: tuple) -> fx.GraphModule:
    """The loss at other parameters on the same batch, traced as the product was (the math
    attention kernel, recurrent layers without oneDNN and cuDNN); raises :class:`Untraceable`."""
    flat, buffers, frozen, args, targets = inputs
    try:
        with _plain_kernels(), _plain_checkpoints():
            graph = _make_fx(
                _value(fmodel, loss),
                *(flat.detach(), buffers, frozen, list(args), targets),
                stateless=not buffers,
            )
    except Exception as error:  # noqa: BLE001 - the product's trace worked, so this is rare
        raise Untraceable(_reason(error)) from error
    _views_as_reshapes(graph.graph)  # (a real kernel's layout may differ: see there)
    graph.recompile()
    return graph


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:300] + "..."
    return f"{type(error).__name__}: {first}"


# --- splitting ---------------------------------------------------------------------------------
def _is_impure(node: fx.Node) -> bool:
    """Operators that must run even when their result is unused: writes into their arguments
    (running statistics) and random draws (later draws must see the same random state)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target._schema.is_mutable or _draws_random(node)


def _draws_random(node: fx.Node) -> bool:
    """Whether ``node`` is an operator that draws random numbers (dropout's masks)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in target.tags
    )


#: Operators that update running statistics in place although their schemas do not mark those
#: arguments as written: the arguments' positions, and the position of the flag that says
#: whether they are updated (``None``: always).
_UNMARKED_WRITES = {
    _aten.native_batch_norm.default: ((3, 4), 5),
    _aten.cudnn_batch_norm.default: ((3, 4), 5),
    _aten.miopen_batch_norm.default: ((3, 4), 5),
    _aten.batch_norm_update_stats.default: ((1, 2), None),
}


def _statistics_written(node: fx.Node) -> List[fx.Node]:
    """The argument nodes that ``node`` writes running statistics into where its schema does
    not say so (:data:`_UNMARKED_WRITES`; :func:`_written` reads the schemas).

    Only :func:`_written_inputs` (which inputs a captured graph must copy) counts these writes.
    :func:`_written` leaves them out because :func:`_split` refuses a set-up that writes into
    an input the product reads, and PyTorch's tangent formula for batch norm takes the running
    statistics as arguments of the product without reading them in training mode: counted
    there, every training-mode batch norm would be refused."""
    if node.op != "call_function" or node.target not in _UNMARKED_WRITES:
        return []
    positions, flag = _UNMARKED_WRITES[node.target]
    if flag is not None and (len(node.args) <= flag or node.args[flag] is False):
        return []
    return [n for i in positions if i < len(node.args) for n in _flat_nodes(node.args[i])]


def _written(node: fx.Node) -> List[fx.Node]:
    """The argument nodes that ``node`` writes into."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for arg, value in zip(target._schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += [n for n in _flat_nodes(value)]
    for name, value in node.kwargs.items():
        for arg in target._schema.arguments:
            if arg.name == name and arg.alias_info is not None and arg.alias_info.is_write:
                out += _flat_nodes(value)
    return out


def _flat_nodes(value: object) -> List[fx.Node]:
    nodes: List[fx.Node] = []
    fx.map_arg(value, nodes.append)
    return nodes


def _depending_on(v: fx.Node, nodes: Sequence[fx.Node]) -> set:
    """``v`` and the nodes that depend on it (``nodes`` in graph order)."""
    depends = {v}
    for n in nodes:
        if n.op != "placeholder" and any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    return depends


def _needed(roots: Sequence[fx.Node], keep: Callable[[fx.Node], bool], nodes) -> set:
    """The nodes the ``roots`` depend on, among those ``keep`` admits, plus impure ones."""
    needed = set()
    stack = list(roots) + [n for n in nodes if keep(n) and _is_impure(n)]
    while stack:
        n = stack.pop()
        if n in needed or not keep(n):
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    return needed


def _split(gm: fx.GraphModule) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """Splits ``(theta, v, ...) -> (loss, g, z, G v)`` into the set-up (no ``v``) and the
    product (``v`` and what the set-up saved for it)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    (output,) = [n for n in nodes if n.op == "output"]
    value, grad, outputs, gv = output.args[0]
    # The placeholders in order: theta, v, then the buffers, frozen parameters, inputs and
    # targets, flattened by make_fx.
    v = placeholders[1]
    depends = _depending_on(v, nodes)
    if any(n in depends for n in (value, grad, outputs)):
        raise Untraceable("the loss or the gradient depends on the product's vector")
    per_product = _needed([gv], lambda n: n in depends, nodes)
    once_roots = [value, grad, outputs]
    saved = []
    for n in nodes:
        if n in depends or n.op == "output" or n is v:
            continue
        if any(u in per_product for u in n.users):
            saved.append(n)
    if gv not in depends:  # H = 0 (a loss linear in the outputs): G v is a constant, zero
        saved.append(gv)
    once = _needed(once_roots + saved, lambda n: n not in depends and n.op != "output", nodes)
    for n in per_product:  # a product must not write into what the next product reads
        if any(w not in depends for w in _written(n)):
            raise Untraceable(f"the product writes into a tensor of the set-up ({n.target})")
    read_by_product = set(saved)
    for n in once:  # the set-up runs first: it must not overwrite what a product reads
        if any(w in read_by_product and w.op == "placeholder" for w in _written(n)):
            raise Untraceable(f"the set-up overwrites an input the product reads ({n.target})")

    setup = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder" and n is not v:
            env[n] = setup.placeholder(n.name)
        elif n in once and n.op != "placeholder":
            env[n] = setup.node_copy(n, lambda a: env[a])
    setup.output(tuple(env[n] for n in [value, grad, outputs, *saved]))

    product = fx.Graph()
    penv: Dict[fx.Node, fx.Node] = {v: product.placeholder("v")}
    for i, n in enumerate(saved):
        penv[n] = product.placeholder(f"saved_{i}")
    for n in nodes:
        if n in per_product and n is not v:
            penv[n] = product.node_copy(n, lambda a: penv[a])
    if gv in depends:
        product.output(penv[gv])
    else:  # every product is a fresh tensor (the optimizer adds the damping in place)
        product.output(product.call_function(_aten.clone.default, (penv[gv],)))

    if GRAPH_PASSES:
        for graph in (setup, product):
            _fuse_matmul_adds(graph)
            _eliminate_common_subexpressions(graph)
    if ACCUMULATE_IN_PLACE:  # after the elimination, which only runs on graphs without writes
        for graph in (setup, product):
            _accumulate_in_place(graph)
    setup_module = fx.GraphModule(gm, setup)
    product_module = fx.GraphModule(gm, product)
    meta = outputs.meta.get("val")
    setup_module.output_shape = tuple(meta.shape)
    setup_module.output_dtype = meta.dtype
    return setup_module, product_module


# --- rewriting ---------------------------------------------------------------------------------
def _fuse_matmul_adds(graph: fx.Graph) -> None:
    """``add(c, mm(a, b))`` into ``addmm(c, a, b)`` (and ``bmm`` into ``baddbmm``): a linear
    layer's tangent ``dx W^T + x dW^T + db`` then takes no separate full-size additions. The
    product moves to the addition: not where an operator of the graph writes into ``a`` or
    ``b``, which the product would then read after the write."""
    fused = {_aten.mm.default: _aten.addmm.default, _aten.bmm.default: _aten.baddbmm.default}
    written = _written_memory(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.add.Tensor or node.kwargs:
            continue
        if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
            continue
        for mm, other in ((node.args[1], node.args[0]), (node.args[0], node.args[1])):
            if mm.op != "call_function" or mm.target not in fused or len(mm.users) != 1:
                continue
            if any(_memory_of(a) in written for a in mm.args):
                continue
            out, prod, addend = (n.meta.get("val") for n in (node, mm, other))
            if not all(isinstance(t, Tensor) for t in (out, prod, addend)):
                continue
            # the sum must have the product's shape and dtype (no broadcasting of the product,
            # no type promotion), which addmm's input then broadcasts to
            if out.shape != prod.shape or not out.dtype == prod.dtype == addend.dtype:
                continue
            with graph.inserting_before(node):
                new = graph.call_function(fused[mm.target], (other, *mm.args))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            graph.erase_node(mm)
            break


#: operators ``op(grad, *rest)``, linear in ``grad`` and elementwise, whose factor
#: ``op(1, *rest)`` costs transcendental functions (erf, exp, log): the activations' derivatives
#: that both a forward-mode rule and a reverse pass call
DERIVATIVES = (
    _aten.gelu_backward.default,
    _aten.silu_backward.default,
    _aten.mish_backward.default,
    _aten.elu_backward.default,
    _aten.softplus_backward.default,
)


def _hoist_derivatives(graph: fx.Graph) -> None:
    """``gelu_backward(grad, x)`` into ``grad * gelu_backward(1, x)`` (and the like,
    :data:`DERIVATIVES`) for every ``x`` that does not depend on the product's vector and that
    a tangent or reverse pass of the product reads: the split moves the factor to the set-up,
    so a product multiplies where it evaluated the derivative (two per activation, one in each
    pass); the set-up's own reverse pass multiplies by the same factor."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    depends = _depending_on(placeholders[1], nodes)

    def candidate(n: fx.Node) -> Optional[tuple]:
        if n.op != "call_function" or n.target not in DERIVATIVES:
            return None
        grad, rest = n.args[0], (n.args[1:], n.kwargs)
        if not isinstance(grad, fx.Node) or any(a in depends for a in _flat_nodes(rest)):
            return None
        mine, result = grad.meta.get("val"), n.meta.get("val")
        if not (isinstance(mine, Tensor) and isinstance(result, Tensor)):
            return None
        if mine.shape != result.shape or mine.dtype != result.dtype:
            return None  # the gradient is broadcast or converted: leave it
        args = tuple(_unaliased(a) for a in n.args[1:])
        return (n.target, _hashable(args), _hashable(n.kwargs))

    found = [(n, key) for n in nodes for key in (candidate(n),) if key is not None]
    keys = {key for n, key in found if n.args[0] in depends}  # the products read these
    factors: Dict[tuple, fx.Node] = {}
    for n, key in found:
        if key not in keys:
            continue
        result = n.meta["val"]
        if key not in factors:
            with graph.inserting_before(n):
                ones = graph.call_function(
                    _aten.full.default,
                    (list(result.shape), 1.0),
                    {"dtype": result.dtype, "device": result.device, "pin_memory": False},
                )
                factor = graph.call_function(n.target, (ones, *n.args[1:]), dict(n.kwargs))
            ones.meta = {"val": result}
            factor.meta = {"val": result}
            factors[key] = factor
        with graph.inserting_before(n):
            product = graph.call_function(_aten.mul.Tensor, (n.args[0], factors[key]))
        product.meta = dict(n.meta)
        n.replace_all_uses_with(product)
        graph.erase_node(n)


#: operators that rearrange the rows of a tensor and keep its last dimension (checked on the
#: shapes): a lookup's rows through them are still the lookup of rearranged indices
_ROW_OPS = {
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.clone.default,
    _aten.alias.default,
    _aten.detach.default,
}


def _rows_op(node: object) -> bool:
    """Whether ``node`` is one of :data:`_ROW_OPS` that keeps the last dimension in place."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _ROW_OPS:
        return False
    source, result = node.args[0], node.meta.get("val")
    mine = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not (isinstance(mine, Tensor) and isinstance(result, Tensor)) or mine.dim() < 1:
        return False
    last = mine.dim() - 1
    if node.target is _aten.transpose.int:
        return all(d % mine.dim() != last for d in node.args[1:3])
    if node.target is _aten.permute.default:
        return node.args[1][-1] % mine.dim() == last
    return result.dim() >= 1 and result.shape[-1] == mine.shape[-1]


def _replay_on_indices(graph: fx.Graph, chain: Sequence[fx.Node], idx: fx.Node, inverse: bool):
    """The indices rearranged as ``chain`` (:func:`_rows_op` nodes in the order they run)
    rearranges the rows of their lookup, or back where ``inverse``: ``chain`` without its last
    dimension."""
    for node in reversed(chain) if inverse else chain:
        source, result = node.args[0].meta["val"], node.meta["val"]
        if node.target is _aten.transpose.int:
            dims = [d % source.dim() for d in node.args[1:3]]
            idx = _with_meta(graph.call_function(_aten.transpose.int, (idx, *dims)))
        elif node.target is _aten.permute.default:
            dims = [d % source.dim() for d in node.args[1]][:-1]
            if inverse:
                dims = sorted(range(len(dims)), key=dims.__getitem__)
            idx = _with_meta(graph.call_function(_aten.permute.default, (idx, dims)))
        elif node.target in (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default):
            shape = (source if inverse else result).shape[:-1]
            idx = _with_meta(graph.call_function(_aten.reshape.default, (idx, list(shape))))
    return idx


def _with_meta(node: fx.Node) -> fx.Node:
    """``node`` with ``meta["val"]`` from its arguments' (fake) values."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
    node.meta["val"] = node.target(*args, **kwargs)
    return node


def _rows_fewer(table: object, lookup: fx.Node) -> bool:
    """Whether ``table`` (a node, or its number of rows) has fewer rows than ``lookup``."""
    if isinstance(table, fx.Node):
        table = getattr(table.meta.get("val"), "shape", (None,))[0]
    rows = getattr(lookup.meta.get("val"), "shape", (None,))[0]
    return isinstance(table, int) and isinstance(rows, int) and table < rows


def _is_row_vector(value: object) -> bool:
    """Whether ``value`` is a node of one dimension (a bias, added to every row)."""
    return isinstance(value, fx.Node) and getattr(value.meta.get("val"), "dim", lambda: 0)() == 1


def _sole_product_of(value: object, user: fx.Node) -> bool:
    """Whether ``value`` is a matrix product (``mm``, ``addmm``) without keywords, of ``user``'s
    shape, that only ``user`` reads."""
    return (
        isinstance(value, fx.Node)
        and value.op == "call_function"
        and value.target in (_aten.mm.default, _aten.addmm.default)
        and not value.kwargs
        and list(value.users) == [user]
        and getattr(value.meta.get("val"), "shape", None) == user.meta["val"].shape
    )


def _is_view(target: object) -> bool:
    """Whether an operator's result shares its (first) argument's memory."""
    if target is _aten._unsafe_view.default:  # a view, though its schema says otherwise
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return any(r.alias_info is not None for r in target._schema.returns)


def _memory_of(node: object) -> object:
    """The node whose memory ``node``'s tensor is, through views (and the items of an
    operator's several results, which count as one memory)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is not operator.getitem and not _is_view(node.target):
            break
        node = node.args[0]
    return node


def _written_memory(graph: fx.Graph) -> set:
    """The memory (:func:`_memory_of`) that an operator of ``graph`` writes into."""
    return {_memory_of(w) for n in graph.nodes for w in _written(n)}


def _views_as_reshapes(graph: fx.Graph) -> None:
    """``view`` (and ``_unsafe_view``) into ``reshape`` where no operator of the graph writes
    into the memory viewed. Tracing records a ``view`` where the fake tensor's strides allow
    one; a real kernel may return another memory layout than its fake counterpart
    (``mse_loss_backward`` of a transposed input returns a contiguous tensor), and ``view``
    then fails where ``reshape`` copies."""
    written = _written_memory(graph)
    views = (_aten.view.default, _aten._unsafe_view.default)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in views and not node.kwargs:
            if _memory_of(node) not in written:
                node.target = _aten.reshape.default


def _reorder_embedding_products(graph: fx.Graph) -> None:
    """``mm(rows(embedding(E, idx)), B)`` into ``embedding(mm(E, B), rows(idx))``, and
    ``embedding_dense_backward(rows(mm(G, W)), idx, ...)`` into
    ``mm(embedding_dense_backward(G, rows^-1(idx), ...), W)``, where ``rows`` is a chain of
    :func:`_rows_op` nodes and the table has fewer rows than the lookup. A lookup is a selection
    of the table's rows, and a row-wise scatter-add commutes with a matrix product on the
    right: both forms are the same products, of the table's size instead of the batch's.

    In ``addmm(c, rows(...), B)``, a bias ``c`` (one dimension) joins the table's product,
    ``addmm(E, B)``; a matrix product ``c = mm(a, b)`` (or ``addmm`` of a bias) that only this
    sum reads becomes ``addmm(embedding(...), a, b)``, which :func:`_accumulate_in_place` then
    accumulates into the looked-up rows; any other ``c`` is added."""
    aten = _aten
    # memory that an operator of the graph writes into (an in-place scaling of the looked-up
    # rows, say): a lookup or product that reads it is left as it is, since the rewrite moves
    # where its operands are read
    written = _written_memory(graph)

    def clean(*nodes: object) -> bool:
        return all(_memory_of(n) not in written for n in nodes)

    for node in list(graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        if node.target in (aten.mm.default, aten.addmm.default):
            a, b = node.args[-2:]
            chain = []
            while _rows_op(a):
                chain.append(a)
                a = a.args[0]
            if not (isinstance(a, fx.Node) and a.op == "call_function"):
                continue
            if a.target is not aten.embedding.default or a.kwargs:
                continue
            table, idx = a.args[:2]
            if not _rows_fewer(table, node) or not clean(a, *chain, table, idx):
                continue
            # The sum's other term, ``c`` of addmm: a bias joins the table's product; a
            # matrix product that only this sum reads (``mm(a2, b2)``, or ``addmm`` of a bias)
            # accumulates into the looked-up rows; anything else is added to them.
            addend = node.args[0] if node.target is aten.addmm.default else None
            bias = factors = other = None
            if _is_row_vector(addend):
                bias = addend
            elif _sole_product_of(addend, node) and addend.target is aten.mm.default:
                factors = addend.args
            elif _sole_product_of(addend, node) and _is_row_vector(addend.args[0]):
                bias, factors = addend.args[0], addend.args[1:]
            else:
                other = addend
            with graph.inserting_before(node):
                if bias is None:
                    projected = graph.call_function(aten.mm.default, (table, b))
                else:
                    projected = graph.call_function(aten.addmm.default, (bias, table, b))
                order = _replay_on_indices(graph, chain[::-1], idx, inverse=False)
                new = graph.call_function(aten.embedding.default, (_with_meta(projected), order))
                if factors is not None:
                    new = graph.call_function(aten.addmm.default, (_with_meta(new), *factors))
                elif other is not None:
                    new = graph.call_function(aten.add.Tensor, (other, _with_meta(new)))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            if isinstance(addend, fx.Node) and not addend.users:
                graph.erase_node(addend)
            # the lookup and its row operations may now be unread: _split keeps only what the
            # graph's outputs need
        elif node.target is aten.embedding_dense_backward.default:
            grad, idx, *rest = node.args
            chain = []
            while _rows_op(grad) and len(grad.users) == 1:
                chain.append(grad)
                grad = grad.args[0]
            if not (isinstance(grad, fx.Node) and grad.op == "call_function"):
                continue
            if grad.target is not aten.mm.default or len(grad.users) != 1 or grad.kwargs:
                continue
            g, w = grad.args
            if not _rows_fewer(rest[0], grad) or not clean(g, w, idx):  # rest[0]: num_weights
                continue
            with graph.inserting_before(node):
                order = _replay_on_indices(graph, chain[::-1], idx, inverse=True)
                scattered = graph.call_function(node.target, (g, order, *rest))
                new = graph.call_function(aten.mm.default, (_with_meta(scattered), w))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            for dead in [*chain, grad]:
                graph.erase_node(dead)


def _unaliased(value: object) -> object:
    """The node whose tensor ``value`` is, through ``alias`` and ``detach`` nodes (a forward-mode
    rule reads its input through such a node, the reverse pass the input itself)."""
    while (
        isinstance(value, fx.Node)
        and value.op == "call_function"
        and value.target in (_aten.alias.default, _aten.detach.default)
    ):
        value = value.args[0]
    return value


#: sums into their first argument (matrix products that add it, and additions), and their
#: in-place forms
_ACCUMULATING = {
    _aten.addmm.default: _aten.addmm_.default,
    _aten.baddbmm.default: _aten.baddbmm_.default,
    _aten.add.Tensor: _aten.add_.Tensor,
}

#: operators whose result is memory of its own
_FRESH = {_aten.mm.default, _aten.bmm.default, _aten.embedding.default, *_ACCUMULATING}


def _accumulate_in_place(graph: fx.Graph) -> None:
    """``addmm(c, a, b)`` into ``addmm_(c, a, b)`` (``baddbmm`` and ``add`` likewise) where
    ``c`` is a result of its own memory (:data:`_FRESH`, or a sum this pass made in place into
    such a result), of the sum's shape and dtype, that nothing else reads, the sum's other
    operands included: the sum accumulates into ``c`` instead of copying it into new memory
    first. An in-place operator of the graph as traced (a running statistic's update) may
    write into an input: its result never counts as fresh."""
    in_place = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _ACCUMULATING or node.kwargs:
            continue
        c = node.args[0]
        if not isinstance(c, fx.Node) or c.op != "call_function" or len(c.users) != 1:
            continue
        if c.target not in _FRESH and c not in in_place:
            continue
        if c in _flat_nodes(node.args[1:]):  # addmm(c, a, c): a product must not read its output
            continue
        mine, result = c.meta.get("val"), node.meta.get("val")
        if not (isinstance(mine, Tensor) and isinstance(result, Tensor)):
            continue
        if mine.shape == result.shape and mine.dtype == result.dtype:
            node.target = _ACCUMULATING[node.target]
            in_place.add(node)


def _eliminate_common_subexpressions(graph: fx.Graph) -> None:
    """One node for each operator applied twice to the same arguments. Only in graphs that
    write into no tensor (an in-place write would make two equal-looking nodes differ)."""
    nodes = list(graph.nodes)
    if any(
        n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target._schema.is_mutable
        for n in nodes
    ):
        return
    seen: Dict[tuple, fx.Node] = {}
    for node in nodes:
        if node.op != "call_function" or _is_impure(node):
            continue
        try:
            key = (node.target, _hashable(node.args), _hashable(node.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


def _hashable(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_hashable(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _hashable(v)) for k, v in value.items())))
    if isinstance(value, (Tensor, slice)):  # a constant tensor: compare by identity
        return ("id", id(value))
    return (type(value).__name__, value)
