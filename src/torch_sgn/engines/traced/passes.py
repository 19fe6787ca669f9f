"""The rewrites of the traced graphs. Each keeps the products exact: the results are the same,
or agree to rounding where the order of the floating-point operations changes.

:func:`rewrite_whole` runs on the whole product before the split (an activation's derivative
as a factor, products of embedding rows on the table, views as reshapes), :func:`rewrite_part`
on the set-up and on the product after it (matrix products fused with their additions, one node
for repeated operations, sums accumulated in place). Each rewrite has a switch below, read when
a model is traced.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import Tensor, fx

from .nodes import depending_on, flat_nodes, is_impure, memory_of, written_memory

__all__ = [
    "ACCUMULATE_IN_PLACE",
    "DERIVATIVES",
    "EMBEDDING_PRODUCTS",
    "GRAPH_PASSES",
    "HOIST_DERIVATIVES",
    "accumulate_in_place",
    "eliminate_common_subexpressions",
    "fuse_matmul_adds",
    "rewrite_part",
    "rewrite_whole",
    "views_as_reshapes",
]

_aten = torch.ops.aten


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


def rewrite_whole(graph: fx.Graph) -> None:
    """The rewrites of the whole product's graph, before the split: an activation's derivative
    as a factor (:data:`HOIST_DERIVATIVES`), products of embedding rows on the table
    (:data:`EMBEDDING_PRODUCTS`), views as reshapes (:func:`views_as_reshapes`)."""
    if HOIST_DERIVATIVES:
        _hoist_derivatives(graph)
    if EMBEDDING_PRODUCTS:
        _reorder_embedding_products(graph)
    views_as_reshapes(graph)


def rewrite_part(graph: fx.Graph) -> None:
    """The rewrites of the set-up's or the product's graph, after the split: matrix products
    fused with their additions and one node for repeated operations (:data:`GRAPH_PASSES`),
    then sums accumulated in place (:data:`ACCUMULATE_IN_PLACE`)."""
    if GRAPH_PASSES:
        fuse_matmul_adds(graph)
        eliminate_common_subexpressions(graph)
    if ACCUMULATE_IN_PLACE:  # after the elimination, which only runs on graphs without writes
        accumulate_in_place(graph)


def fuse_matmul_adds(graph: fx.Graph) -> None:
    """``add(c, mm(a, b))`` into ``addmm(c, a, b)`` (and ``bmm`` into ``baddbmm``): a linear
    layer's tangent ``dx W^T + x dW^T + db`` then takes no separate full-size additions. The
    product moves to the addition: not where an operator of the graph writes into ``a`` or
    ``b``, which the product would then read after the write."""
    fused = {_aten.mm.default: _aten.addmm.default, _aten.bmm.default: _aten.baddbmm.default}
    written = written_memory(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.add.Tensor or node.kwargs:
            continue
        if len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
            continue
        for mm, other in ((node.args[1], node.args[0]), (node.args[0], node.args[1])):
            if mm.op != "call_function" or mm.target not in fused or len(mm.users) != 1:
                continue
            if any(memory_of(a) in written for a in mm.args):
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
    depends = depending_on(placeholders[1], nodes)

    def candidate(n: fx.Node) -> Optional[tuple]:
        if n.op != "call_function" or n.target not in DERIVATIVES:
            return None
        grad, rest = n.args[0], (n.args[1:], n.kwargs)
        if not isinstance(grad, fx.Node) or any(a in depends for a in flat_nodes(rest)):
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


def views_as_reshapes(graph: fx.Graph) -> None:
    """``view`` (and ``_unsafe_view``) into ``reshape`` where no operator of the graph writes
    into the memory viewed. Tracing records a ``view`` where the fake tensor's strides allow
    one; a real kernel may return another memory layout than its fake counterpart
    (``mse_loss_backward`` of a transposed input returns a contiguous tensor), and ``view``
    then fails where ``reshape`` copies."""
    written = written_memory(graph)
    views = (_aten.view.default, _aten._unsafe_view.default)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in views and not node.kwargs:
            if memory_of(node) not in written:
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
    sum reads becomes ``addmm(embedding(...), a, b)``, which :func:`accumulate_in_place` then
    accumulates into the looked-up rows; any other ``c`` is added."""
    aten = _aten
    # memory that an operator of the graph writes into (an in-place scaling of the looked-up
    # rows, say): a lookup or product that reads it is left as it is, since the rewrite moves
    # where its operands are read
    written = written_memory(graph)

    def clean(*nodes: object) -> bool:
        return all(memory_of(n) not in written for n in nodes)

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
            # the lookup and its row operations may now be unread: split keeps only what the
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


def accumulate_in_place(graph: fx.Graph) -> None:
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
        if c in flat_nodes(node.args[1:]):  # addmm(c, a, c): a product must not read its output
            continue
        mine, result = c.meta.get("val"), node.meta.get("val")
        if not (isinstance(mine, Tensor) and isinstance(result, Tensor)):
            continue
        if mine.shape == result.shape and mine.dtype == result.dtype:
            node.target = _ACCUMULATING[node.target]
            in_place.add(node)


def eliminate_common_subexpressions(graph: fx.Graph) -> None:
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
        if node.op != "call_function" or is_impure(node):
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
