"""The split of a traced product at ``v``: the set-up, which runs once per step (the forward
pass, the loss, the gradient and what the products read), and the product, which runs at every
CG iteration (the tangent pass and one reverse pass)."""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

import torch
from torch import fx

from .nodes import depending_on, is_impure, written_by
from .passes import rewrite_part
from .trace import Untraceable

__all__ = ["split"]

_aten = torch.ops.aten


def split(gm: fx.GraphModule) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """Splits ``(theta, v, ...) -> (loss, g, z, G v)`` into the set-up (no ``v``) and the
    product (``v`` and what the set-up saved for it), each rewritten by
    :func:`~.passes.rewrite_part`; raises :class:`~.trace.Untraceable` where a part would write
    into what the other reads."""
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    (output,) = [n for n in nodes if n.op == "output"]
    value, grad, outputs, gv = output.args[0]
    # The placeholders in order: theta, v, then the buffers, frozen parameters, inputs and
    # targets, flattened by make_fx.
    v = placeholders[1]
    depends = depending_on(v, nodes)
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
        if any(w not in depends for w in written_by(n)):
            raise Untraceable(f"the product writes into a tensor of the set-up ({n.target})")
    read_by_product = set(saved)
    for n in once:  # the set-up runs first: it must not overwrite what a product reads
        if any(w in read_by_product and w.op == "placeholder" for w in written_by(n)):
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

    for graph in (setup, product):
        rewrite_part(graph)
    setup_module = fx.GraphModule(gm, setup)
    product_module = fx.GraphModule(gm, product)
    meta = outputs.meta.get("val")
    setup_module.output_shape = tuple(meta.shape)
    setup_module.output_dtype = meta.dtype
    return setup_module, product_module


def _needed(roots: Sequence[fx.Node], keep: Callable[[fx.Node], bool], nodes) -> set:
    """The nodes the ``roots`` depend on, among those ``keep`` admits, plus impure ones."""
    needed = set()
    stack = list(roots) + [n for n in nodes if keep(n) and is_impure(n)]
    while stack:
        n = stack.pop()
        if n in needed or not keep(n):
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    return needed
