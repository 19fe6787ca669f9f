r"""The residual Gram matrix ``J J^T`` of a physics-informed network from its layers' factors.

Exact Gauss-Newton steps on ``R`` residuals and ``P > R`` parameters solve through the ``R x R``
matrix ``J J^T`` (:func:`~torch_sgn.solve.direct.solve_in_sample_space`). Formed from ``J``
itself (:mod:`torch_sgn.engines.functional`), it costs ``2 R^2 P`` flops and ``R P`` memory:
for a 116,097-parameter network and 1,020 points, 2.4e11 flops and a 1 GB ``J``. The layers'
structure gives it for far less.

A linear layer ``z = W a + b`` is applied, in a forward-propagated derivative
(:mod:`torch_sgn.pinn.operators`), to several *channels* of one point: the value (which takes
the bias), the input-gradient directions and the Laplacian, ``z_c = W a_c (+ b)``. A residual
``r_n`` of point ``n`` then has the weight gradient

.. math::
    \frac{\partial r_n}{\partial W} = \sum_c \delta_{n,c}\, a_{n,c}^\top,
    \qquad \delta_{n,c} = \frac{\partial r_n}{\partial z_{n,c}},

and two residuals' inner product over ``W`` is

.. math::
    \Big\langle \frac{\partial r_n}{\partial W}, \frac{\partial r_m}{\partial W} \Big\rangle
    = \sum_{c, c'} (\delta_{n,c}^\top \delta_{m,c'})\, (a_{n,c}^\top a_{m,c'}),

so the layer's block of ``J J^T`` is :math:`\sum_{c,c'} (\Delta_c \Delta_{c'}^\top) \circ (A_c
A_{c'}^\top)`: ``2 C^2 R^2 (\text{in} + \text{out})`` flops for ``C`` channels instead of
``2 R^2\, \text{in} \cdot \text{out}`` (the bias: a column of ones in the value channel's
``A``). Because a point's residual depends on that point alone, one backward pass of the
summed residuals gives every :math:`\delta_{n,c}`. The same factors give ``J^T u`` without
``J``. Where the channels are many and the layers narrow, the factors give ``J`` itself
(:math:`\sum_c \Delta_c \otimes A_c`, one batched product) and ``J J^T`` is formed from it.

Nothing is assumed: a network whose parameters are not all in linear layers seen here, or
residuals that use a layer another way, are caught by comparing a few rows with ``vmap`` of
``jacrev`` (:func:`checked`), and the route is not taken (``J`` is formed row by row instead).

This is the kernel form of Gauss-Newton in function space used for PINNs by energy natural
gradient descent (Mueller and Zeinhofer, ICML 2023) and of the Gram-Gauss-Newton method (Cai
et al., 2019), with the channels of forward-propagated derivatives (Dangel, Mueller,
Zeinhofer, NeurIPS 2024, on the forward Laplacian's structure).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import accumulate
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["LayerFactors", "TILE", "TILED_ABOVE", "agreement", "checked", "layer_factors", "record"]

#: On the CPU, ``J J^T`` between two blocks of which one has more than this many points is
#: formed by tiles (:meth:`LayerFactors.kernel`): the 2,048- and 4,000-point samples of many
#: points' steps (``torch_sgn.solve.sampled``), not the published PINN set-ups' 900 points.
TILED_ABOVE = 1024

#: The points of each block in one tile: its ``TILE x TILE`` terms stay in the cache (256: a
#: 3,600 + 400-point sample's kernel 4.2 times faster than untiled on one CPU thread,
#: ``benchmarks/results/2026-11-28_cpu_pinn_tiled_kernel``).
TILE = 256


@dataclass
class _Use:
    """One application of a linear layer: its input channels and output channels (tensors of
    shape ``(k, n, width)`` or ``(n, width)``, as the pass computed them) and which of them
    took the bias."""

    layer: nn.Linear
    inputs: List[Tensor]
    outputs: List[Tensor]
    biased: List[bool]


_TAPE: ContextVar[Optional[List[_Use]]] = ContextVar("torch_sgn_layer_tape", default=None)


def record(
    layer: nn.Linear, inputs: Sequence[Tensor], outputs: Sequence[Tensor], biased: Sequence[bool]
) -> None:
    """Notes one application of ``layer`` to channels while :func:`_recording` is on (a no-op
    otherwise): called by the forward-propagated derivatives of :mod:`torch_sgn.pinn.operators`."""
    tape = _TAPE.get()
    if tape is not None:
        tape.append(_Use(layer, list(inputs), list(outputs), list(biased)))


@contextmanager
def _recording(network: nn.Module) -> Iterator[List[_Use]]:
    """Records every linear layer's application: through :func:`record`, and plain calls of the
    network's ``nn.Linear`` modules by forward hooks."""
    tape: List[_Use] = []
    token = _TAPE.set(tape)

    def hook(layer: nn.Module, args: tuple, output: Tensor) -> None:
        tape.append(_Use(layer, [args[0]], [output], [True]))  # type: ignore[arg-type]

    handles = [m.register_forward_hook(hook) for m in network.modules() if type(m) is nn.Linear]
    try:
        yield tape
    finally:
        for h in handles:
            h.remove()
        _TAPE.reset(token)


@dataclass
class _Block:
    """One residual block's factors: per layer, the channels ``A`` (``C x n x in'``, the bias
    column appended where the bias is trained) and per residual component ``j`` the
    sensitivities ``Delta_j`` (``C x n x out``)."""

    n: int
    m: int
    inputs: Dict[nn.Linear, Tensor]
    deltas: Dict[nn.Linear, List[Tensor]]


@dataclass
class LayerFactors:
    """``J J^T`` and ``u -> J^T u`` of a residual problem, from its layers' factors.

    ``slots[layer] = (weight offset or None, bias offset or None)`` in the flat parameters;
    ``values``: the weighted residuals themselves (flat, in the order of ``J``'s rows), where
    the pass that formed the factors kept them."""

    blocks: List[_Block]
    slots: Dict[nn.Linear, Tuple[Optional[int], Optional[int]]]
    numel: int
    dtype: torch.dtype
    values: Optional[Tensor] = None

    @property
    def rows(self) -> int:
        return sum(b.n * b.m for b in self.blocks)

    @property
    def points(self) -> List[int]:
        """The number of points of each block (its rows are ``points * m``)."""
        return [b.n for b in self.blocks]

    def subset(self, index: Sequence[Tensor]) -> LayerFactors:
        """The factors of the rows of the points ``index[b]`` of each block ``b`` (a block
        with an empty index is left out): ``J``'s rows at those points, unscaled."""
        blocks = []
        for b, idx in zip(self.blocks, index):
            if idx.numel() == 0:
                continue
            blocks.append(
                _Block(
                    idx.numel(),
                    b.m,
                    {layer: a[:, idx] for layer, a in b.inputs.items()},
                    {layer: [d[:, idx] for d in ds] for layer, ds in b.deltas.items()},
                )
            )
        return LayerFactors(blocks, self.slots, self.numel, self.dtype)

    def kernel(self, symmetric: bool = False) -> Tensor:
        """``J J^T`` (``R x R``, float64), rows in the order of the residuals. ``symmetric``:
        exactly symmetric, each block of it within a residual block ``K_bb`` replaced by
        ``(K_bb + K_bb^T) / 2`` where it is formed whole (the tiled blocks, and the blocks
        between two residual blocks, are so already); else those untiled blocks as summed."""
        rows = [b.n * b.m for b in self.blocks]
        starts = [sum(rows[:i]) for i in range(len(rows))]
        like = next(iter(self.blocks[0].inputs.values()))
        k = torch.zeros(sum(rows), sum(rows), dtype=torch.float64, device=like.device)
        for i, bi in enumerate(self.blocks):
            for j in range(i, len(self.blocks)):
                bj = self.blocks[j]
                block = k[starts[i] : starts[i] + rows[i], starts[j] : starts[j] + rows[j]]
                tiled = self._pair(block.view(bi.n, bi.m, bj.n, bj.m), bi, bj, same=i == j)
                if i != j:
                    k[starts[j] : starts[j] + rows[j], starts[i] : starts[i] + rows[i]] = block.T
                elif symmetric and not tiled:
                    block.copy_((block + block.T) * 0.5)
        return k

    def _pair(self, out: Tensor, bi: _Block, bj: _Block, same: bool) -> bool:
        """Adds the ``(n_i m_i) x (n_j m_j)`` block of ``J J^T`` between two residual blocks to
        ``out`` (zeros, shaped ``n_i x m_i x n_j x m_j``): on the CPU, in tiles where a block
        has more than :data:`TILED_ABOVE` points (:meth:`_tiled`; then ``True``)."""
        device = next(iter(bi.inputs.values())).device
        if device.type == "cpu" and max(bi.n, bj.n) > TILED_ABOVE:
            self._tiled(out, bi, bj, same)
            return True
        for layer in [layer for layer in bi.inputs if layer in bj.inputs]:  # in a fixed order
            a_i, a_j = bi.inputs[layer], bj.inputs[layer]
            _add_layer(out, a_i, a_j, bi.deltas[layer], bj.deltas[layer], same)
        return False

    def _tiled(self, out: Tensor, bi: _Block, bj: _Block, same: bool) -> None:
        """:meth:`_pair` by tiles of :data:`TILE` points of each block: every layer's and
        channel pair's products for one tile at a time, so that the tile's ``n x n`` terms stay
        in the cache; within a block (``same``) only the tiles on and above the diagonal, the
        others their transposes, and the diagonal tiles made symmetric."""
        layers = [layer for layer in bi.inputs if layer in bj.inputs]  # in a fixed order
        for i0 in range(0, bi.n, TILE):
            i1 = min(bi.n, i0 + TILE)
            for j0 in range(i0 if same else 0, bj.n, TILE):
                j1 = min(bj.n, j0 + TILE)
                tile = out[i0:i1, :, j0:j1, :]
                for layer in layers:
                    d_i = [d[:, i0:i1] for d in bi.deltas[layer]]
                    d_j = [d[:, j0:j1] for d in bj.deltas[layer]]
                    a_i, a_j = bi.inputs[layer][:, i0:i1], bj.inputs[layer][:, j0:j1]
                    _add_layer(tile, a_i, a_j, d_i, d_j, same=False)
                if same and j0 == i0:  # exactly symmetric, as J J^T is
                    flat = tile.reshape((i1 - i0) * bi.m, (j1 - j0) * bj.m)
                    tile.copy_(((flat + flat.T) * 0.5).view(tile.shape))
                elif same:
                    out[j0:j1, :, i0:i1, :] = tile.permute(2, 3, 0, 1)

    def vjp(self, u: Tensor) -> Tensor:
        """``J^T u`` (flat, the parameters' dtype) for ``u`` with one entry per residual."""
        u = u.reshape(-1)
        like = next(iter(self.blocks[0].inputs.values()))
        grads: Dict[nn.Linear, Tensor] = {}
        start = 0
        for b in self.blocks:
            ub = u[start : start + b.n * b.m].reshape(b.n, b.m).to(torch.float64)
            start += b.n * b.m
            for layer, a in b.inputs.items():
                for p, delta in enumerate(b.deltas[layer]):
                    # sum_c Delta_c^T diag(u) A_c, over the channels at once
                    g = torch.einsum("cno,n,cni->oi", delta, ub[:, p], a)
                    grads[layer] = grads[layer] + g if layer in grads else g
        flat = like.new_zeros(self.numel, dtype=self.dtype)
        for layer, g in grads.items():
            w, bias = self.slots[layer]
            if w is not None:
                flat[w : w + layer.weight.numel()] = g[:, : layer.in_features].reshape(-1)
            if bias is not None:
                flat[bias : bias + layer.out_features] = g[:, -1].to(self.dtype)
        return flat

    def jvp(self, v: Tensor) -> Tensor:
        """``J v`` (float64, one entry per residual) for flat parameters ``v``."""
        v = v.reshape(-1).to(torch.float64)
        weights: Dict[nn.Linear, Tensor] = {}  # each layer's [W_v, b_v] (out x in')
        for layer, (w, bias) in self.slots.items():
            parts = []
            if w is not None:
                parts.append(v[w : w + layer.weight.numel()].view(layer.out_features, -1))
            if bias is not None:
                parts.append(v[bias : bias + layer.out_features, None])
            weights[layer] = torch.cat(parts, 1)
        out = []
        for b in self.blocks:
            jv = v.new_zeros(b.n, b.m)
            for layer, a in b.inputs.items():
                za = a @ weights[layer].T  # C x n x out: the channels' tangents
                for p, delta in enumerate(b.deltas[layer]):
                    jv[:, p] += (delta * za).sum((0, 2))
            out.append(jv.reshape(-1))
        return torch.cat(out)


def _add_layer(
    out: Tensor, a_i: Tensor, a_j: Tensor, d_i: List[Tensor], d_j: List[Tensor], same: bool
) -> None:
    """Adds one layer's terms of ``J J^T`` between two sets of points (channels ``a``, ``C x n
    x in'``; sensitivities ``d[p]``, ``C x n x out``, per residual component ``p``) to ``out``
    (``n_i x m_i x n_j x m_j``, float64): from ``J``'s rows where the channels are many and
    the layer narrow, else channel pair by channel pair. ``same``: the same points on both
    sides (``J``'s rows formed once, the pairs ``(c, d)`` and ``(d, c)`` at once)."""
    ci, cj = a_i.shape[0], a_j.shape[0]
    if ci * cj * (a_i.shape[2] + d_i[0].shape[2]) > a_i.shape[2] * d_i[0].shape[2]:
        rows_i = [_rows(d, a_i) for d in d_i]
        rows_j = rows_i if same else [_rows(d, a_j) for d in d_j]
        for p, jp in enumerate(rows_i):
            for q, jq in enumerate(rows_j):
                out[:, p, :, q] += (jp @ jq.T).to(torch.float64)
        return
    for c in range(ci):  # one n_i x n_j Gram of inputs at a time (memory O(n^2))
        for d in range(c if same else 0, cj):  # within a block, (d, c) with (c, d)
            aa = a_i[c] @ a_j[d].T
            for p in range(len(d_i)):
                for q in range(len(d_j)):
                    term = (d_i[p][c] @ d_j[q][d].T) * aa
                    if same and d > c:  # the (d, c) term: A_d A_c^T = aa^T
                        term = term + (term.T if p == q else (d_i[p][d] @ d_j[q][c].T) * aa.T)
                    out[:, p, :, q] += term


def _rows(delta: Tensor, a: Tensor) -> Tensor:
    """The layer's block of ``J``'s rows, ``n x (out in')``: :math:`\\sum_c \\Delta_c \\otimes
    A_c` per point."""
    return torch.einsum("cno,cni->noi", delta, a).reshape(delta.shape[1], -1)


def layer_factors(
    problem: nn.Module, fmodel, flat: Tensor, inputs: Sequence[Tensor]
) -> Optional[LayerFactors]:
    """The factors of ``J`` for a :class:`~torch_sgn.pinn.Residuals` problem at ``flat``, or
    ``None`` where its parameters are not all weights and biases of linear layers applied as
    :func:`record` sees them (check the result with :func:`checked` before use)."""
    offsets = dict(zip(fmodel.names, accumulate(fmodel.numels, initial=0)))
    slots: Dict[nn.Linear, Tuple[Optional[int], Optional[int]]] = {}
    covered = 0
    for name, module in problem.named_modules():
        if type(module) is nn.Linear:
            prefix = f"{name}." if name else ""
            w, b = offsets.get(prefix + "weight"), offsets.get(prefix + "bias")
            if w is not None or b is not None:
                slots[module] = (w, b)
                covered += (module.weight.numel() if w is not None else 0) + (
                    module.out_features if b is not None else 0
                )
    if covered != fmodel.numel:  # parameters outside linear layers
        return None
    with torch.enable_grad():  # (a step runs under no_grad)
        return _factors(problem, fmodel, flat, inputs, slots)


def _factors(problem: nn.Module, fmodel, flat: Tensor, inputs, slots) -> Optional[LayerFactors]:
    leaf = flat.detach().requires_grad_(True)
    params = fmodel.unflatten(leaf)
    blocks: List[_Block] = []
    values: List[Tensor] = []
    for block in problem.jacobian_blocks(fmodel, inputs):
        if not block.points:  # a residual of the parameters alone
            return None
        with _recording(problem) as tape:
            r = torch.func.functional_call(
                problem, params, block.points, {"only": block.rows.name}, tie_weights=False
            )
            r = r * block.rows.scale
        n = block.points[0].shape[0]
        if not tape or r.shape[0] != n or not r.requires_grad:
            return None
        r = r.reshape(n, -1)
        uses = [u for u in tape if u.layer in slots]
        outputs = [t for u in uses for t in u.outputs]
        if any(not t.requires_grad for t in outputs):
            return None
        deltas_by_component = []
        for p in range(r.shape[1]):
            grads = torch.autograd.grad(
                r[:, p].sum(), outputs, retain_graph=p + 1 < r.shape[1], allow_unused=True
            )
            deltas_by_component.append(grads)
        inputs_by_layer: Dict[nn.Linear, List[Tensor]] = {}
        deltas_by_layer: Dict[nn.Linear, List[List[Tensor]]] = {}
        k = 0  # the index of the use's first output in ``outputs``
        for use in uses:
            weight_slot, bias_slot = slots[use.layer]
            for c, (a, z, biased) in enumerate(zip(use.inputs, use.outputs, use.biased)):
                a3 = (a if a.dim() == 3 else a.unsqueeze(0)).detach().to(torch.float64)
                if a3.shape[1] != n or a3.dim() != 3:
                    return None
                parts = [a3] if weight_slot is not None else []
                if bias_slot is not None:
                    parts.append(a3.new_full((*a3.shape[:2], 1), 1.0 if biased else 0.0))
                inputs_by_layer.setdefault(use.layer, []).append(torch.cat(parts, 2))
                per_component = deltas_by_layer.setdefault(
                    use.layer, [[] for _ in range(r.shape[1])]
                )
                for p in range(r.shape[1]):
                    g = deltas_by_component[p][k + c]
                    g = torch.zeros_like(z) if g is None else g
                    g = g if g.dim() == 3 else g.unsqueeze(0)
                    per_component[p].append(g.to(torch.float64))
            k += len(use.outputs)
        merged_inputs, merged_deltas = {}, {}
        for layer, chans in inputs_by_layer.items():
            a, ds = _merge(chans, deltas_by_layer[layer])
            merged_inputs[layer], merged_deltas[layer] = a, ds
        blocks.append(_Block(n, r.shape[1], merged_inputs, merged_deltas))
        values.append(r.detach().reshape(-1))
    if not blocks:
        return None
    return LayerFactors(blocks, slots, fmodel.numel, flat.dtype, torch.cat(values))


def _merge(inputs: List[Tensor], deltas: List[List[Tensor]]) -> Tuple[Tensor, List[Tensor]]:
    """The channels of one layer in one block, equal input channels merged (their ``Delta``
    summed: ``J``'s rows are :math:`\\sum_c \\Delta_c \\otimes A_c`), as ``C x n x in'`` and
    per component ``C x n x out``. A channel whose ``A`` or whose ``Delta`` is zero is left out:
    the first layer's Laplacian; a sub-network's derivatives in a block that reads only its
    value (a parallel network's other outputs)."""
    a = torch.cat(inputs, 0)
    ds = [torch.cat(d, 0) for d in deltas]
    keep: List[int] = []
    target = list(range(a.shape[0]))
    nonzero = [bool(a[c].any()) and any(bool(d[c].any()) for d in ds) for c in range(a.shape[0])]
    for c in range(a.shape[0]):
        if not nonzero[c]:  # a zero channel adds nothing
            continue
        twin = next((k for k in keep if torch.equal(a[k], a[c])), None)
        if twin is None:
            keep.append(c)
        else:
            target[c] = twin
    if len(keep) == a.shape[0]:
        return a, ds
    if not keep:  # every channel zero: the layer's block of J is zero
        keep = [0]
    used = [c for c in range(a.shape[0]) if nonzero[c]]
    index = torch.tensor([keep.index(target[c]) for c in used], device=a.device)
    merged = []
    for d in ds:
        out = d.new_zeros(len(keep), *d.shape[1:])
        merged.append(out.index_add_(0, index, d[used]) if used else out)
    return a[keep], merged


def agreement(dtype: torch.dtype) -> float:
    """The relative tolerance of :func:`checked` for parameters of ``dtype``: ``1e-8``, or 100
    times the dtype's machine epsilon where that is larger (float32: about ``1.2e-5``). The
    factors and the rows round differently (in float32 by about a tenth of its epsilon on a
    5 x 100 tanh network); a network the factors do not follow misses by far more."""
    return max(1e-8, 100 * torch.finfo(dtype).eps)


def checked(factors: LayerFactors, fmodel, flat: Tensor, problem: nn.Module, inputs) -> bool:
    """Whether ``factors`` agree with ``J``'s rows formed by ``vmap`` of ``jacrev`` on a few
    points of each block: their ``J J^T`` entries and ``J^T u`` for a random ``u`` on them, to
    :func:`agreement` of the largest entry (or of 1)."""
    few_rows, few_points = [], []
    for block, b in zip(problem.jacobian_blocks(fmodel, inputs), factors.blocks):
        k = min(3, b.n)
        pts = tuple(p[:k] for p in block.points)
        dims = (None,) + (0,) * len(pts)
        with torch.enable_grad():
            jac = torch.func.vmap(torch.func.jacrev(block.rows), in_dims=dims)(flat, *pts)
        few_rows.append(jac.reshape(k * b.m, -1).to(torch.float64))
        few_points.append(torch.arange(k, device=flat.device))
    j = torch.cat(few_rows)
    # The few points' own factors: J J^T of all R rows would be R x R.
    few = factors.subset(few_points)
    kernel = few.kernel()
    reference = j @ j.T
    rel = agreement(flat.dtype)
    tol = rel * max(reference.abs().max().item(), 1.0)
    if not (kernel - reference).abs().max().item() <= tol:
        return False
    g = torch.Generator().manual_seed(0)
    u = torch.randn(j.shape[0], generator=g, dtype=torch.float64).to(flat.device)
    got = few.vjp(u).to(torch.float64)
    want = j.T @ u
    tol = rel * max(want.abs().max().item(), 1.0)
    return bool((got - want).abs().max().item() <= tol)
