"""Running a trace's graphs other than eagerly: captured as CUDA graphs and replayed
(:class:`Replayed`, ``cuda_graphs=True``), or compiled by ``torch.compile``
(:func:`compiled_graph`, ``compile=True``). Random draws (dropout's masks) are taken out of the
captured graphs and drawn eagerly before each replay (:func:`draws_as_inputs`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx

from ...model.flat_model import FunctionalModel
from .. import cuda_graphs as graphs
from .nodes import draws_random, memory_of, statistics_written, written_memory
from .opaque_loss import calls_opaque_loss
from .trace import Traced, Untraceable, reason

__all__ = ["Replayed", "capture_obstacle", "compiled_graph", "drawn_layouts", "draws_as_inputs"]

_aten = torch.ops.aten


def capture_obstacle(traced: Traced, inputs: tuple, training: bool) -> Optional[str]:
    """Why a trace's graphs cannot be captured; ``None`` if they can be tried."""
    flat, buffers, frozen, args, targets = inputs
    if not all(isinstance(a, Tensor) for a in args):
        return "the model takes inputs that are not tensors"
    if calls_opaque_loss(traced.setup):
        return "the loss is called as it is from the graphs, its Python at every call"
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
        _, draws = draws_as_inputs(traced.setup)
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
    statistics included (:func:`statistics_written`)."""
    nodes = graph.graph.nodes
    written = written_memory(graph.graph)
    written |= {memory_of(w) for n in nodes for w in statistics_written(n)}
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
    return next((n.target.name() for n in graph.graph.nodes if draws_random(n)), None)


def compiled_graph(graph: fx.GraphModule, failed: Callable[[str], None]) -> Callable:
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
            failed(reason(error))
            return graph(*args)

    return call


class Replayed:
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
    each set-up from the step's random state (:func:`draws_as_inputs`). A linearization's
    products and losses are valid until the next set-up of the same trace replaces what they
    read; one called later raises.
    """

    def __init__(self, traced: Traced, value: fx.GraphModule, inputs, fmodel: FunctionalModel):
        flat, buffers, frozen, args, targets = inputs
        self.fmodel = fmodel
        self.static = [t.detach().clone() for t in (flat, *buffers, *frozen, *args, targets)]
        self.v, self.point = torch.zeros_like(self.static[0]), self.static[0].clone()
        # Random draws (dropout's masks) become inputs that each set-up draws eagerly, so that
        # the set-up and the trial points see the same ones, as eager passes do.
        layouts = drawn_layouts(traced.setup, self.static, fmodel)
        setup, self.draws = draws_as_inputs(traced.setup, layouts)
        value, trial_draws = draws_as_inputs(value, layouts)
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
    """One random draw of a graph, taken out of it (:func:`draws_as_inputs`): dropout's mask
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
    if not draws_random(node) or not node.args:
        return False
    if node.target is not _aten.native_dropout.default:
        return True
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return train is not False


def _layout(t: Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    return tuple(t.shape), tuple(t.stride())


def drawn_layouts(
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


def draws_as_inputs(
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
