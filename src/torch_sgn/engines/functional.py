r"""The functional engines: :class:`FunctionalEngine`, which linearizes any model, and on it
:class:`RowsEngine`, a residual problem's engine, with the output Jacobian formed row by row.

:class:`FunctionalEngine` takes ``J v`` by forward-mode AD, which re-runs the forward pass at
every product (or, where an operator has no forward-mode rule, as
:mod:`torch_sgn.model.forward_mode` finds), and ``J^T u`` through the autograd graph of the
gradient's forward pass.

**Rows.** A residual problem (:class:`~torch_sgn.residual_problem.ResidualProblem`: a
:class:`torch_sgn.pinn.Residuals` problem, a DeepXDE model through the adapter) says how its rows
are formed: the blocks of rows whose Jacobians are taken separately (its residual blocks, each over
its own points), and maybe ``J J^T``, ``J v`` and ``J^T u`` without ``J``, from its layers' factors
(:mod:`torch_sgn.pinn.layer_kernel`). :class:`RowsEngine` is the engine of such a problem, first and
alone: the loss and its gradient from one recorded forward pass (its products engine's,
:class:`FunctionalEngine` unless another was asked for), and where exact steps may be taken, ``G``,
the sample space and ``G v`` from the rows, in one place; :meth:`RowsEngine.all_rows` linearizes on
all of too many rows from the layers' factors alone (:func:`by_factors`). Nothing is traced for it.

The direct solver needs ``G = J^\top H J`` (``P x P``) or the sample-space matrix ``J J^\top``
(``R x R``, ``R`` the batch's outputs). The layer-wise engine forms both from its chains' own
per-layer factors. For other models, forming ``G`` from ``P`` products ``G e_i`` costs ``P``
passes; but where each sample's outputs depend on that sample alone (no batch statistics, no
attention across the batch), each row block of ``J`` is the gradient of one sample's outputs,
and ``torch.func.vmap`` over samples of ``torch.func.jacrev`` forms all of them in one batched
reverse pass (:func:`jacobian_rows`, :func:`with_jacobian`, which the step applies to any such
model with ``solver="direct"``):

.. math::
    J = \begin{bmatrix} \partial f(\theta; x_1) / \partial\theta \\ \vdots \\
        \partial f(\theta; x_N) / \partial\theta \end{bmatrix}

(Physics-informed residuals whose derivatives are propagated forward, as
:mod:`torch_sgn.pinn.operators` does, are such models: a point's residual depends on that point
alone.) Whether a model is per-sample is checked, not assumed: the rows' outputs must equal the
batched forward pass's (:func:`per_sample`), else the rows are not formed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, List, Optional, Tuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from ..diagnostics import warn
from ..linearization import (
    FACTORS,
    ROWS,
    Batch,
    Engine,
    Linearization,
    RowSample,
    SampleSpace,
    loss_and_output_gradient,
)
from ..losses import OutputLoss
from ..model.flat_model import FunctionalModel, check_depends
from ..model.forward_mode import (
    SWITCHES,
    backward_hooks,
    gradient_stop_notice,
    jvp_by_double_backward,
    missing_rule,
    switch_for,
)
from ..residual_problem import JacobianBlock
from ..solve.sampled import draw

__all__ = [
    "FunctionalEngine", "PerSample", "RowsEngine", "by_factors", "jacobian_rows", "per_sample",
    "with_jacobian",
]  # fmt: skip


class FunctionalEngine:
    """Loss, gradient and a ``G v`` closure from one forward pass, for any model.

    The forward pass that gives the gradient is recorded once and its graph kept: ``J^T u``
    reuses it at every product. ``J v`` uses forward-mode AD (``torch.func.jvp``), which
    re-runs the forward pass with tangents. Where an operator has no forward-mode rule, the
    first product finds out and the engine adapts for good (:mod:`torch_sgn.model.forward_mode`):
    ``J v`` by double backward, on kernels whose backward is differentiable; it warns once,
    and the step records its forward pass again under the change.
    """

    def __init__(self, fmodel: FunctionalModel, loss: OutputLoss):
        self.fmodel, self.loss = fmodel, loss
        #: ``J v`` by double backward instead of forward mode (decided by the first product)
        self.double_backward = False

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        if not self.double_backward:
            stop = self.fmodel.gradient_stop(flat, batch.inputs)
            if stop is not None:
                self.double_backward = True
                warn(gradient_stop_notice(stop))
        point = self._record(flat, batch, buffers_out, check=True)
        value, grad = point.value, point.grad

        def ggn_vp(v: Tensor) -> Tensor:
            nonlocal point
            changes = []
            while True:
                try:
                    jv = point.jvp(v)  # v -> J v
                    break
                except _NotReplayed:
                    self.double_backward = True
                    changes.append(
                        "forward-mode AD did not replay the recorded forward pass (its outputs "
                        "differ: dropout drawn differently inside some operator): J v is taken "
                        "by double backward from now on, through the recorded pass itself"
                    )
                    point = self._record(flat, batch, None, check=False)
                except (NotImplementedError, RuntimeError) as error:
                    changes.append(self._adapt(error))  # re-raises what it cannot get around
                    # The products of one step share one recorded forward pass, on the new
                    # route and kernels (attention dropout draws differently in each kernel).
                    point = self._record(flat, batch, None, check=False)
            if changes:
                warn(
                    "; ".join(changes)
                    + ". Products stay exact; this is decided once for this model"
                )
            return vjp(point.hessian(jv))  # -> H J v -> J^T H J v

        def vjp(u: Tensor) -> Tensor:  # J^T u through the recorded pass of this step
            with torch.enable_grad():
                (jtu,) = torch.autograd.grad(point.outputs, point.leaf, u, retain_graph=True)
            return jtu

        return Linearization(value, grad, ggn_vp, outputs=point.outputs.detach(), vjp=vjp)

    def _record(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict], check: bool
    ) -> _Point:
        fmodel, loss, inputs, targets = self.fmodel, self.loss, batch.inputs, batch.targets
        leaf = flat.detach().requires_grad_(True)
        with torch.enable_grad():
            outputs = fmodel(leaf, inputs, buffers_out=buffers_out)
            check_depends(outputs)
            value, dz = loss_and_output_gradient(loss, outputs, targets, check=check)
            if self.double_backward:  # the gradient's backward pass also records J v's graph
                grad, jvp = jvp_by_double_backward(outputs, leaf, dz)
            else:
                (grad,) = torch.autograd.grad(
                    outputs, leaf, dz, retain_graph=True, allow_unused=True
                )
                check_depends(outputs, grad)
                base = flat.detach()
                # torch.func.jvp refuses the requires_grad_() of a forward that calls
                # autograd itself; forward_ad's dual tensors nest in it
                forward_mode = _dual_jvp if fmodel.calls_autograd else _func_jvp
                unchecked = [fmodel.model.training]

                def jvp(v: Tensor) -> Tensor:
                    primal, tangent = forward_mode(lambda p: fmodel(p, inputs), base, v)
                    if unchecked:  # once per step: does forward mode replay the recorded pass?
                        unchecked.clear()
                        if not _same(primal, outputs.detach()):
                            raise _NotReplayed()
                    return tangent

        hessian = loss.hessian(outputs.detach(), targets)
        return _Point(value, grad, leaf, outputs, hessian, jvp)

    def _adapt(self, error: BaseException) -> str:
        """Gets around the operator ``error`` names (or re-raises); returns the operator and
        what changed, for the warning.

        A missing forward-mode rule turns on double backward (before any switch to a kernel
        that has a rule; its cost is in ``docs/PERFORMANCE.md``). An operator whose backward is
        not differentiable in turn (the fused attention kernels) is switched to a kernel whose
        backward is.
        """
        op = missing_rule(error)
        if op is None:
            raise error
        if not self.double_backward:
            self.double_backward = True
            return (
                f"forward-mode AD has no rule for {op}: J v is taken by double backward from "
                "now on, J v = d/du [(J^T u) . v]; a product then costs about two backward "
                "passes, and the graph of u -> J^T u (recorded with the gradient) is kept "
                "through the step"
            )
        switch = switch_for(op)
        if switch is not None and switch not in self.fmodel.switches:
            self.fmodel.switches = self.fmodel.switches | {switch}
            return f"{op} is not differentiable: the model runs with {SWITCHES[switch]}"
        hint = ""
        if "embedding_bag" in op:
            hint = (
                " (call F.embedding_bag or nn.EmbeddingBag, which SGN runs as differentiable "
                "operators)"
            )
        raise RuntimeError(
            "cannot take Gauss-Newton products: an operator has no forward-mode rule and its "
            f"backward is not differentiable either ({op}: {error}); replace that operation "
            f"by differentiable ones{hint} or give it a jvp"
        ) from error


def _func_jvp(f: Callable[[Tensor], Tensor], x: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """``f(x)`` and ``J_f(x) v`` by ``torch.func.jvp``."""
    return torch.func.jvp(f, (x,), (v,))


def _dual_jvp(f: Callable[[Tensor], Tensor], x: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """``f(x)`` and ``J_f(x) v`` by the dual tensors of ``torch.autograd.forward_ad``, for an
    ``f`` that calls ``torch.autograd.grad`` itself (a residual model's ``u_xx``): autograd's
    backward passes inside ``f`` carry the tangents, while ``torch.func.jvp`` refuses the
    ``requires_grad_()`` they start from. (Its own forward mode cannot nest inside:
    :data:`~torch_sgn.model.forward_mode.NESTED_FORWARD`.)"""
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(f(fwAD.make_dual(x, v)))
    # the derivatives inside f recorded a graph from the inputs; the products need none
    return primal.detach(), tangent.detach()


class _NotReplayed(Exception):
    """The forward-mode pass computed other outputs than the recorded pass."""


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal up to rounding (kernels that are not bitwise reproducible), not up to a mask."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool((a - b).abs().max() <= 1e-4 * scale + 1e-30) if b.numel() else True


class _Point:
    """What the products of one step share: the recorded forward pass and ``v -> J v``."""

    def __init__(self, value, grad, leaf, outputs, hessian, jvp):
        self.value, self.grad, self.leaf, self.outputs = value, grad, leaf, outputs
        self.hessian, self.jvp = hessian, jvp


# --- a residual problem's rows, and J row by row -------------------------------------------
class RowsEngine:
    """The engine of a residual problem (see the module's docstring): the loss and its
    gradient from ``products``' recorded pass; where ``exact``, ``G``, the sample space and
    ``G v`` from the problem's rows (:func:`with_jacobian`), the problem being per-sample on
    the batch (:class:`PerSample`).

    Args:
        fmodel: the problem as a function of its flat parameters.
        loss: the loss in output space.
        products: the engine of the loss, its gradient and ``J^T u`` (and of ``G v`` where
            the rows are not formed): the functional engine, or the one asked for.
        exact: whether the step's exact solves may form the rows: not with ``solver="cg"``,
            CUDA graphs (the captured products are the route) or a data-parallel group (each
            rank holds its shard's rows only).
    """

    #: steps through the batch's outputs come from the rows, not from a chain's own factors
    may_solve_through_outputs = False

    def __init__(self, fmodel: FunctionalModel, loss: OutputLoss, products: Engine, exact: bool):
        self.fmodel, self.loss, self.products, self.exact = fmodel, loss, products, exact
        self.per_sample = PerSample()

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization:
        lin = self.products(flat, batch, buffers_out)
        if not (self.exact and self.per_sample(self.fmodel, flat, batch)):
            return lin
        return with_jacobian(lin, self.fmodel, self.loss, flat, batch)

    def all_rows(self, flat: Tensor, batch: Batch, points: int) -> Optional[Linearization]:
        """The linearization on all of too many rows, from the layers' factors alone
        (:func:`by_factors`; ``points``: its preconditioner's sample), or ``None``."""
        return by_factors(self.fmodel, self.loss, flat, batch, points)


class PerSample:
    """:func:`per_sample`, checked once per batch shape, training mode and model settings."""

    def __init__(self) -> None:
        self._known: dict = {}

    def __call__(self, fmodel: FunctionalModel, flat: Tensor, batch: Batch) -> bool:
        key = (
            tuple((tuple(x.shape), x.dtype) for x in batch.args),
            fmodel.model.training,
            fmodel.settings(),
        )
        if key not in self._known:
            self._known[key] = per_sample(fmodel, flat, batch)
        return self._known[key]


def _model_blocks(fmodel: FunctionalModel, batch: Batch) -> List[JacobianBlock]:
    problem = fmodel.problem
    if problem is not None:
        return problem.jacobian_blocks(fmodel, batch.args)

    def rows(flat: Tensor, *point: Tensor) -> Tensor:
        return fmodel(flat, tuple(p.unsqueeze(0) for p in point)).reshape(-1)

    return [JacobianBlock(rows, tuple(batch.args))]


def jacobian_rows(fmodel: FunctionalModel, flat: Tensor, batch: Batch) -> Tuple[Tensor, Tensor]:
    """``(outputs, J)``: the model's outputs at ``flat`` on ``batch`` (flat, ``R``) and their
    Jacobian (``R x P``, in the parameters' dtype), formed by ``vmap`` over the samples of
    ``jacrev`` of one sample's outputs."""
    outs, jacs = [], []
    for block in _model_blocks(fmodel, batch):
        one = torch.func.jacrev(_with_value(block.rows), has_aux=True)
        if block.points:
            n = block.points[0].shape[0]
            if n == 0:
                continue
            dims = (None,) + (0,) * len(block.points)
            jac, out = torch.func.vmap(one, in_dims=dims)(flat, *block.points)
        else:
            jac, out = one(flat)
        outs.append(out.reshape(-1))
        jacs.append(jac.reshape(-1, flat.numel()))
    if not outs:
        return flat.new_zeros(0), flat.new_zeros((0, flat.numel()))
    return torch.cat(outs), torch.cat(jacs)


def _with_value(rows: Callable[..., Tensor]) -> Callable[..., Tuple[Tensor, Tensor]]:
    """``rows`` returning its value twice, the second as ``jacrev``'s auxiliary output."""

    def both(flat: Tensor, *point: Tensor) -> Tuple[Tensor, Tensor]:
        out = rows(flat, *point)
        return out, out.detach()

    return both


def per_sample(fmodel: FunctionalModel, flat: Tensor, batch: Batch) -> bool:
    """Whether the model's outputs, taken one sample (or one block's point) at a time, equal the
    batched forward pass's up to rounding. A model whose samples interact (batch statistics,
    attention across the batch) gives other values; one that ``vmap`` or ``jacrev`` cannot run
    (random draws, an operator without a batching rule, backward hooks) is not taken either."""
    if backward_hooks(fmodel.model) is not None:  # J's rows would skip what the hooks do
        return False
    try:
        with torch.enable_grad():  # two points of each block as J is formed: it can run
            for block in _model_blocks(fmodel, batch):
                if block.points and block.points[0].shape[0]:
                    dims = (None,) + (0,) * len(block.points)
                    few = tuple(p[:2] for p in block.points)
                    torch.func.vmap(torch.func.jacrev(block.rows), in_dims=dims)(flat, *few)
        with torch.no_grad():
            rows = torch.cat(
                [
                    torch.func.vmap(block.rows, in_dims=(None,) + (0,) * len(block.points))(
                        flat, *block.points
                    ).reshape(-1)
                    if block.points
                    else block.rows(flat).reshape(-1)
                    for block in _model_blocks(fmodel, batch)
                    if not block.points or block.points[0].shape[0]
                ]
            )
            batched = fmodel(flat, batch.inputs).reshape(-1)
    except Exception:  # noqa: BLE001 - whatever vmap cannot run is not taken
        return False
    if rows.shape != batched.shape:
        return False
    if not rows.numel():
        return True
    tol = 1e3 * torch.finfo(batched.dtype).eps * max(batched.abs().max().item(), 1.0)
    return bool((rows - batched).abs().max() <= tol)


def with_jacobian(
    lin: Linearization, fmodel: FunctionalModel, loss: OutputLoss, flat: Tensor, batch: Batch
) -> Linearization:
    """``lin`` with ``G`` and the sample space formed from :func:`jacobian_rows`, for a model
    that is :func:`per_sample` on ``batch``. ``J`` is formed once, when a direct solve first
    asks for it; a step that solves by CG never forms it. Where the model is a residual
    problem whose layers give ``J``'s factors, ``J v``, ``J^T u`` and ``G v`` come from them
    (the same ``J`` as the solve's), else ``G v`` is ``lin``'s."""
    with torch.no_grad():
        outputs = lin.outputs if lin.outputs is not None else fmodel(flat, batch.inputs)
    outputs = outputs.detach()
    _, output_grad = loss_and_output_gradient(loss, outputs, batch.targets, check=False)
    hessian = loss.hessian(outputs, batch.targets)
    formed: List[Tensor] = []

    def jac() -> Tensor:
        if not formed:
            with torch.enable_grad():
                formed.append(jacobian_rows(fmodel, flat, batch)[1].to(torch.float64))
        return formed[0]

    def hessian_columns() -> Tensor:  # H J (R x P), float64
        cols = jac().T.reshape(-1, *outputs.shape).to(outputs.dtype)
        try:
            h = torch.func.vmap(hessian)(cols)
        except Exception:  # noqa: BLE001 - a loss whose Hessian products cannot be batched
            h = torch.stack([hessian(c) for c in cols.unbind(0)])
        return h.reshape(cols.shape[0], -1).T.to(torch.float64)

    factored: List[object] = []

    def factors():  # a model's own factors of J (layer_factors), or None
        if not factored:
            problem = fmodel.problem
            factored.append(
                None if problem is None else problem.layer_factors(fmodel, flat, batch.args)
            )
        return factored[0]

    def vjp(u: Tensor) -> Tensor:
        f = factors()
        if f is not None:
            return f.vjp(u)
        return (jac().T @ u.reshape(-1).to(torch.float64)).to(flat.dtype)

    def jvp(v: Tensor) -> Tensor:
        f = factors()
        if f is not None:
            return f.jvp(v).to(flat.dtype).view(outputs.shape)
        return (jac() @ v.to(torch.float64)).to(flat.dtype).view(outputs.shape)

    def kernel() -> Tensor:
        f = factors()
        return f.kernel(symmetric=True) if f is not None else _symmetric(jac() @ jac().T)

    products = lin.ggn_vp

    def ggn_vp(v: Tensor) -> Tensor:  # J^T H J v
        return products(v) if factors() is None else vjp(hessian(jvp(v)))

    space = SampleSpace(
        outputs=outputs,
        output_grad=output_grad,
        hessian=hessian,
        vjp=vjp,
        kernel=kernel,
        jvp=jvp,
    )
    return replace(
        lin,
        ggn_vp=ggn_vp,
        dense_ggn=lambda: jac().T @ hessian_columns(),
        sample_space=space,
        jacobian=ROWS,
    )


def _symmetric(k: Tensor) -> Tensor:
    """``(K + K^T) / 2``: a product ``J J^T`` is symmetric only up to rounding, and the sample
    space's Cholesky route needs it exactly so."""
    return (k + k.mT).mul_(0.5)


def by_factors(
    fmodel: FunctionalModel, loss: OutputLoss, flat: Tensor, batch: Batch, points: int
) -> Optional[Linearization]:
    r"""The linearization of a residual problem from its layers' factors
    (:mod:`torch_sgn.pinn.layer_kernel`) alone, for exact steps on more rows than an ``R x R``
    matrix takes (:mod:`torch_sgn.solve.sampled`): the loss and ``g = J^T e`` from one forward
    and one backward pass, ``G v = J^T h J v`` from the factors (no further pass), and
    ``rows``, a weighted sample of ``J``'s rows at about ``points`` points. ``None`` where the
    model has no factors, or the loss's output-space Hessian is not a multiple ``h I`` of the
    identity."""
    problem = fmodel.problem
    factors = None if problem is None else problem.layer_factors(fmodel, flat, batch.args)
    if factors is None or factors.values is None:
        return None
    outputs = factors.values.to(flat.dtype)
    value, output_grad = loss_and_output_gradient(loss, outputs, batch.targets)
    hessian = loss.hessian(outputs, batch.targets)
    h = _identity_multiple(hessian, outputs)
    if h is None:
        return None
    grad = factors.vjp(output_grad)

    def ggn_vp(v: Tensor) -> Tensor:
        return factors.vjp(factors.jvp(v).mul_(h))

    def rows(seed: int) -> RowSample:
        index = draw(factors.points, points, seed, flat.device)
        sub = factors.subset(index)
        # Each block's rows weighted by sqrt(N_b / n_b): sum_b (N_b / n_b) J_b,S^T J_b,S
        # estimates G / h without bias.
        weights = torch.cat(
            [
                torch.full((i.numel() * b.m,), math.sqrt(b.n / i.numel()), dtype=torch.float64)
                for b, i in zip(factors.blocks, index)
                if i.numel()
            ]
        ).to(flat.device)
        kernel = sub.kernel().mul_(weights[:, None]).mul_(weights[None, :])
        return RowSample(
            kernel=kernel,
            jvp=lambda v: sub.jvp(v).mul_(weights),
            vjp=lambda w: sub.vjp(w * weights),
            hessian=h,
            points=[i.numel() for i in index],
        )

    return Linearization(
        loss=value,
        grad=grad,
        ggn_vp=ggn_vp,
        outputs=outputs,
        vjp=factors.vjp,
        rows=rows,
        jacobian=FACTORS,
    )


def _identity_multiple(hessian: Callable[[Tensor], Tensor], outputs: Tensor) -> Optional[float]:
    """``h`` where ``hessian`` is ``t -> h t`` (checked on a random ``t``), else ``None``."""
    t = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    t = t.to(outputs.device, outputs.dtype)
    ht = hessian(t)
    h = float((ht * t).sum() / (t * t).sum())
    scale = max(abs(h), torch.finfo(outputs.dtype).tiny)
    if not (h > 0 and bool(((ht - h * t).abs() <= 1e-6 * scale * t.abs().max()).all())):
        return None
    return h
