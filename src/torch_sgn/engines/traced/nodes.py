"""What an operator node of a traced graph writes into, draws and depends on: the questions
that the split (:mod:`.split`), the rewrites (:mod:`.passes`) and the capture as CUDA graphs
(:mod:`.replay`) ask of a graph's nodes."""

from __future__ import annotations

import operator
from typing import List, Sequence

import torch
from torch import fx

__all__ = [
    "depending_on",
    "draws_random",
    "flat_nodes",
    "is_impure",
    "memory_of",
    "statistics_written",
    "written_by",
    "written_memory",
]

_aten = torch.ops.aten


def is_impure(node: fx.Node) -> bool:
    """Operators that must run even when their result is unused: writes into their arguments
    (running statistics) and random draws (later draws must see the same random state)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return target._schema.is_mutable or draws_random(node)


def draws_random(node: fx.Node) -> bool:
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


def statistics_written(node: fx.Node) -> List[fx.Node]:
    """The argument nodes that ``node`` writes running statistics into where its schema does
    not say so (:data:`_UNMARKED_WRITES`; :func:`written_by` reads the schemas).

    Only :func:`_written_inputs` (which inputs a captured graph must copy) counts these writes.
    :func:`written_by` leaves them out because :func:`split` refuses a set-up that writes into
    an input the product reads, and PyTorch's tangent formula for batch norm takes the running
    statistics as arguments of the product without reading them in training mode: counted
    there, every training-mode batch norm would be refused."""
    if node.op != "call_function" or node.target not in _UNMARKED_WRITES:
        return []
    positions, flag = _UNMARKED_WRITES[node.target]
    if flag is not None and (len(node.args) <= flag or node.args[flag] is False):
        return []
    return [n for i in positions if i < len(node.args) for n in flat_nodes(node.args[i])]


def written_by(node: fx.Node) -> List[fx.Node]:
    """The argument nodes that ``node`` writes into."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for arg, value in zip(target._schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += [n for n in flat_nodes(value)]
    for name, value in node.kwargs.items():
        for arg in target._schema.arguments:
            if arg.name == name and arg.alias_info is not None and arg.alias_info.is_write:
                out += flat_nodes(value)
    return out


def flat_nodes(value: object) -> List[fx.Node]:
    nodes: List[fx.Node] = []
    fx.map_arg(value, nodes.append)
    return nodes


def depending_on(v: fx.Node, nodes: Sequence[fx.Node]) -> set:
    """``v`` and the nodes that depend on it (``nodes`` in graph order)."""
    depends = {v}
    for n in nodes:
        if n.op != "placeholder" and any(a in depends for a in n.all_input_nodes):
            depends.add(n)
    return depends


def _is_view(target: object) -> bool:
    """Whether an operator's result shares its (first) argument's memory."""
    if target is _aten._unsafe_view.default:  # a view, though its schema says otherwise
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return any(r.alias_info is not None for r in target._schema.returns)


def memory_of(node: object) -> object:
    """The node whose memory ``node``'s tensor is, through views (and the items of an
    operator's several results, which count as one memory)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is not operator.getitem and not _is_view(node.target):
            break
        node = node.args[0]
    return node


def written_memory(graph: fx.Graph) -> set:
    """The memory (:func:`memory_of`) that an operator of ``graph`` writes into."""
    return {memory_of(w) for n in graph.nodes for w in written_by(n)}
