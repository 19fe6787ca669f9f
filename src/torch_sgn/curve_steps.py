r"""SGN's exact steps on a small curve fit, without the optimizer's per-step set-up.

A curve fit (a few parameters, one fixed batch of residuals) spends most of an
:meth:`SGN.step <torch_sgn.SGN.step>` on what a general model needs: the engine's
linearization through :func:`torch.func.functional_call`, ``J`` by ``vmap`` of ``jacrev``, the
checks of a new batch and the optimizer's state. :class:`CurveSteps` takes the same step (the
damped Gauss-Newton solve, its Levenberg-Marquardt attempts, trust region, line search,
geodesic acceleration and uphill rule: the step core, :func:`torch_sgn.solve.core.take`, with
SGN's options) from a lighter linearization:

* the residuals at a trial point: the parameters written in place and the user's residual
  function called as it is;
* ``J``: the residual function evaluated once with each parameter entry *broadcast* to the
  residuals' shape (a scalar ``b`` becomes a tensor of ``b`` of the residuals' shape, a vector
  ``x`` of shape ``(k,)`` one of shape ``(k, *residuals)``), then one backward pass of their
  sum: where residual ``i`` reads only entry ``i`` of each broadcast copy (an elementwise curve
  model), the copy's gradient at ``i`` is :math:`\partial r_i / \partial b`, so the whole
  ``J`` costs one forward and one backward pass. Whether a model is such is checked, not
  assumed: at the first point the copies' residuals must equal the plain call's, and their
  ``J`` must give one vector-Jacobian product of the plain residuals to rounding; where it
  does not (a parameter that enters a reduction over the residuals, a weight registered
  twice, a model that cannot take the copies) every step forms ``J`` by ``jacrev``;
* where the copies' residuals equal the plain call's bit for bit and the copies are small
  (:data:`SHARED_FORWARD_SIZE`: their forward pass then costs little more than a plain one),
  every trial point is evaluated by them with their graph kept, so that the step's accepted
  point, the next step's start, needs only the backward pass for its ``J``.

The loss is SGN's for a residual problem, :math:`L = \lVert r \rVert^2` (gradient
:math:`2 J^\top r`, Gauss-Newton matrix :math:`2 J^\top J`), so a step here is an SGN step with
the same options up to rounding (``tests/test_curve_steps.py`` compares them), but for the
geodesic acceleration's second difference: with ``J`` at hand it is one-sided,
:math:`2 (r(\theta + h v) - r - h J v) / h^2`, one evaluation where SGN's central one takes two
(:func:`~torch_sgn.solve.core.second_difference`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .distributed import SingleProcess
from .linearization import Linearization
from .model.flat_model import flat_gradient
from .solve import core
from .solve.descents import MATRIX, Accelerate, Phase
from .solve.scaled_trust_region import ACCEPT, Radius, Scaled, update
from .solve.state import StepState
from .solve.step import LineSearch
from .step_info import StepInfo

if TYPE_CHECKING:
    from .options import Options

__all__ = ["CurveSteps", "SCALED_TRIALS", "SHARED_FORWARD_SIZE"]

#: The most trial points of one step of the scaled trust region (:meth:`CurveSteps.scaled_step`).
SCALED_TRIALS = 10

#: The most entries (parameters times residuals) of the broadcast copies for which trial points
#: are evaluated by them (:meth:`CurveSteps.loss_at`): below it the copies' forward pass, its
#: graph kept, costs little more than a plain call (small tensor operations cost their dispatch),
#: where a rejected trial's would waste a forward pass of ``P`` times the plain one's work.
SHARED_FORWARD_SIZE = 1 << 14


class CurveSteps:
    """Exact SGN steps on ``fn(module)``, the residuals of a module's parameters.

    Args:
        fn: ``module -> residuals`` (any shape), a function of the module's trainable
            parameters.
        module: the module; its trainable parameters ``params`` are written in place at each
            evaluation (:meth:`write` the point to keep at the end).
        params: the module's trainable parameters, in the order of the flat vector.
        options: SGN's options (:class:`~torch_sgn.options.Options`).
        check: ``(residuals, grads) -> None``, called once with the residuals at the first
            point (with their graph) and the gradients of one product of them with a random
            vector (``None`` for a parameter they do not reach); it raises on what it refuses.

    While it runs, the parameters are views of one flat tensor (a point is written by one
    copy); :meth:`close` gives each its own storage again.
    """

    def __init__(
        self,
        fn: Callable[[nn.Module], Tensor],
        module: nn.Module,
        params: List[nn.Parameter],
        options: Options,
        check: Optional[Callable[[Tensor, List[Optional[Tensor]]], None]] = None,
    ):
        self.fn, self.module, self.params, self.check = fn, module, params, check
        self.sizes = [p.numel() for p in params]
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = [names[id(p)] for p in params]
        self.options = options
        # Backtracking stops at the loss's rounding: a fit to the last digits reaches it, and
        # comparisons of losses there would pick a step by the noise.
        self.search = replace(LineSearch.of(options), above_rounding=True)
        self.lr = float(options.lr)
        self.accelerate = core.wanted(options.geodesic_acceleration, params[0].dtype)
        self.state = StepState.first(options)
        self.region: Optional[Radius] = None  # the scaled trust region's, once it runs
        self.broadcast: Optional[bool] = None  # J by broadcast copies: decided at the first J
        self._shape: Tuple[int, ...] = ()  # the residuals' shape, where broadcast
        self._same = False  # the broadcast residuals equal the plain call's bit for bit
        self._shares_forward = False  # loss_at evaluates by the copies (see jacobian)
        # (point, residuals with their graph, leaf) of loss_at's last evaluation
        self._pending: Optional[Tuple[Tensor, Tensor, Tensor]] = None
        self._call = _Call(fn, module)
        self._keys = [f"inner.{n}" for n in self.names]
        # Where each parameter is registered (its first name): the broadcast copies take its
        # place there for one call. A weight registered twice keeps its original under its
        # second name, and the check of J (by the plain residuals) then refuses the copies.
        self._places = [
            (module.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in self.names
        ]
        self.shares = SingleProcess().shares
        self._scalars = all(p.dim() == 0 for p in params)  # (a curve's coefficients)
        self._flat: Optional[Tensor] = None
        if len({(p.dtype, p.device) for p in params}) == 1:
            # Views of the same shapes, dtype and device: autograd's record of each parameter
            # (its gradient's shape) is unchanged.
            self._flat = torch.cat([p.detach().reshape(-1) for p in params])
            for p, chunk in zip(params, self._flat.split(self.sizes)):
                p.data = chunk.view_as(p)

    def close(self) -> None:
        """Gives each parameter its own storage again (it holds the last point written)."""
        self._pending = None
        if self._flat is not None:
            for p in self.params:
                p.data = p.data.clone()
            self._flat = None

    # --- evaluations ---------------------------------------------------------------------------
    def write(self, flat: Tensor) -> None:
        """Writes the flat point into the parameters."""
        if self._flat is not None:  # a plain tensor: no autograd to keep out
            self._flat.copy_(flat)
            return
        with torch.no_grad():
            for p, chunk in zip(self.params, flat.split(self.sizes)):
                p.copy_(chunk.view_as(p))

    def residuals_at(self, flat: Tensor) -> Tensor:
        """The residuals at ``flat``, flat and detached."""
        self.write(flat)
        with torch.no_grad():
            return self.fn(self.module).reshape(-1)

    def loss_at(self, flat: Tensor) -> float:
        r""":math:`\lVert r \rVert^2` at ``flat``; where ``J`` is formed by the broadcast copies
        and they are small, evaluated by them, their graph kept: if the step ends at ``flat``,
        the next :meth:`jacobian` is one backward pass (an accepted trial's evaluation is the
        next linearization's forward pass)."""
        if not self._shares_forward:
            return float(self.residuals_at(flat).square().sum())
        self.write(flat)
        self._pending = None  # the graph of the last point evaluated, freed first
        out, leaf = self._broadcast_forward(self._shape)
        r = out.detach().reshape(-1)
        self._pending = (flat, out, leaf)
        return float(r.square().sum())

    def jacobian(self, flat: Tensor) -> Tuple[Tensor, Tensor]:
        """``(r, J)`` at ``flat``: the residuals (flat) and their Jacobian (``R x P``). ``r``
        equals :meth:`residuals_at`'s bit for bit, as every trial point's, so that the step
        compares losses computed alike: the broadcast copies' residuals are used where they
        were equal at the first point, else :meth:`residuals_at` runs too."""
        pending, self._pending = self._pending, None
        if pending is not None and torch.equal(pending[0], flat):
            self.write(flat)
            return self._broadcast_backward(*pending[1:])
        pending = None  # (its graph freed before another is made)
        self.write(flat)
        first = None
        if self.broadcast is None:
            self.broadcast, first = self._broadcast_agrees()
            # the forward shared with the trial points (loss_at) where its residuals are the
            # plain call's and the copies are few (SHARED_FORWARD_SIZE)
            self._shares_forward = (
                self.broadcast
                and self._same
                and sum(self.sizes) * math.prod(self._shape) <= SHARED_FORWARD_SIZE
            )
        if self.broadcast:
            r, jac = first if first is not None else self._by_broadcast(self._shape)
            return (r if self._same else self.residuals_at(flat)), jac
        return self.residuals_at(flat), self._by_jacrev(flat)[1]

    def _by_jacrev(self, flat: Tensor) -> Tuple[Tensor, Tensor]:
        base = {n: p.detach() for n, p in zip(self.names, self.params)}

        def residuals(point: Tensor) -> Tuple[Tensor, Tensor]:
            chunks = point.split(self.sizes)
            values = {k: c.view_as(base[n]) for k, n, c in zip(self._keys, self.names, chunks)}
            out = torch.func.functional_call(self._call, values, ())
            out = out.reshape(-1)
            return out, out.detach()

        with torch.enable_grad():
            jac, r = torch.func.jacrev(residuals, has_aux=True)(flat)
        return r, jac

    def _by_broadcast(self, r_shape: Tuple[int, ...]) -> Tuple[Tensor, Tensor]:
        """``(r, J)`` by the broadcast copies (:meth:`_broadcast_forward`,
        :meth:`_broadcast_backward`)."""
        return self._broadcast_backward(*self._broadcast_forward(r_shape))

    def _broadcast_forward(self, r_shape: Tuple[int, ...]) -> Tuple[Tensor, Tensor]:
        """The residuals by the broadcast copies, with their graph, and the copies' leaf:
        views of one ``P x R`` leaf set in the parameters' places in their modules for one
        call of ``fn``."""
        flat = self._flat
        if flat is None:
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        leaf = flat.reshape((-1,) + (1,) * len(r_shape)).expand((-1,) + r_shape).clone()
        leaf.requires_grad_()
        try:
            with torch.enable_grad():
                if self._scalars:  # one view node in the graph rather than a split and P views
                    copies = leaf.unbind(0)
                else:
                    copies = [
                        chunk.view(p.shape + r_shape)
                        for p, chunk in zip(self.params, leaf.split_with_sizes(self.sizes))
                    ]
                for (owner, name), copy in zip(self._places, copies):
                    owner._parameters[name] = copy
                out = self.fn(self.module)
        finally:
            for (owner, name), p in zip(self._places, self.params):
                owner._parameters[name] = p
        if tuple(out.shape) != r_shape:
            raise ValueError("the broadcast residuals changed shape")
        return out, leaf

    def _broadcast_backward(self, out: Tensor, leaf: Tensor) -> Tuple[Tensor, Tensor]:
        """``(r, J)`` from :meth:`_broadcast_forward`'s residuals: the leaf's gradient of
        their sum is ``J^T``."""
        grad = None
        if out.grad_fn is not None:
            # the gradient of out.sum(), with the sum's backward (ones) handed in
            (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out), allow_unused=True)
        if grad is None:  # residuals of none of the parameters
            grad = torch.zeros_like(leaf)
        return out.detach().reshape(-1), grad.reshape(leaf.shape[0], -1).T

    def _broadcast_agrees(self) -> Tuple[bool, Optional[Tuple[Tensor, Tensor]]]:
        """Whether the broadcast copies give the residuals and ``J`` at the point the
        parameters hold, up to rounding, with the copies' ``(r, J)`` there where they do; notes
        the residuals' shape and whether the copies' residuals equal the plain call's bit for
        bit.

        ``J`` is checked through one vector-Jacobian product of the plain residuals with a
        random ``u``: ``J_b^T u = J^T u`` for every ``u`` exactly where ``J_b = J``, and where
        they differ, for a random ``u`` almost surely not (drawn from a generator of its own, so
        that the fit leaves the global random state alone). The plain residuals and that
        product's gradients (``None`` for a parameter they do not reach) go to ``check`` first."""
        with torch.enable_grad():
            direct = self.fn(self.module)
            r = direct.detach().reshape(-1)
            generator = torch.Generator(device=r.device).manual_seed(0)
            u = torch.randn(r.shape, generator=generator, dtype=r.dtype, device=r.device)
            grads: List[Optional[Tensor]] = [None] * len(self.params)
            if direct.grad_fn is not None:
                product = direct.reshape(-1) @ u
                grads = list(torch.autograd.grad(product, self.params, allow_unused=True))
        if self.check is not None:
            self.check(direct, grads)
        self._shape = tuple(direct.shape)
        try:
            r_b, jac_b = self._by_broadcast(self._shape)
        except Exception:  # a model that cannot take the copies: J by jacrev
            return False, None
        self._same = torch.equal(r_b, r)
        if not _close(r_b, r, r.abs()) or direct.grad_fn is None:
            return False, None
        jtu = flat_gradient(self.params, grads)
        # J_b^T u and the product by autograd sum the same R products in another order: they
        # differ by at most about R eps (|J_b|^T |u|) (Higham's bound of a sum's rounding); a
        # J that is wrong by more than that is refused.
        bound = 4 * r.numel() * torch.finfo(r.dtype).eps * (jac_b.abs().T @ u.abs())
        agrees = bool(((jac_b.T @ u - jtu).abs() <= bound + torch.finfo(r.dtype).tiny).all())
        return agrees, ((r_b, jac_b) if agrees else None)

    # --- one step ------------------------------------------------------------------------------
    def step(
        self, theta: Tensor, r: Tensor, jac: Tensor, cost_grad: Tensor
    ) -> Tuple[Tensor, StepInfo]:
        """One SGN step from ``theta``, where the residuals are ``r``, their Jacobian ``jac``
        and the cost's gradient ``cost_grad = J^T r`` (the driver's, which tested it): the next
        point (``theta`` itself where the step is not taken) and its
        :class:`~torch_sgn.StepInfo`. The parameters hold an arbitrary trial point after it."""
        grad = 2.0 * cost_grad  # SGN's loss is ||r||^2, twice the cost
        loss0 = float(r.square().sum())
        matrix = None

        def ggn() -> Tensor:
            nonlocal matrix
            if matrix is None:
                matrix = 2.0 * (jac.T @ jac)
            return matrix

        def accelerator(route: str) -> Accelerate:
            return core.accelerator(
                theta, self.residuals_at, lambda centre: lambda t: 2.0 * t,
                lambda u: jac.T @ u, self.shares, theta.numel(), 0.5 * self.lr**2,
                centre=r, jvp=lambda v: jac @ v,
            )  # fmt: skip

        lin = Linearization(loss=r.new_tensor(loss0), grad=grad, ggn_vp=None, dense_ggn=ggn)
        point = core.Point(theta, self.loss_at, accelerator, search=self.search)
        phase, rhs = Phase(MATRIX), (grad, None)
        taken = core.take(lin, self.state, self.options, phase, MATRIX, rhs, loss0, point)
        self.state = core.next_state(self.state, taken, self.options)
        moved = taken.displacement
        point = theta + moved if moved is not None else theta
        grad_norm = float(torch.linalg.vector_norm(grad))
        return point, taken.info(grad_norm, self.lr)

    def scaled_step(
        self, theta: Tensor, r: Tensor, jac: Tensor, cost_grad: Tensor
    ) -> Tuple[Tensor, StepInfo]:
        r"""One step of MINPACK's scaled trust region from ``theta``
        (:mod:`~torch_sgn.solve.scaled_trust_region`; the driver's fallback where SGN's steps
        ended on a plateau): trial points within a radius shrunk after each failed one, up to
        :data:`SCALED_TRIALS`, each with the geodesic acceleration where SGN's steps take it
        (``p + a / 2`` where :math:`2 \lVert D a \rVert \le 0.75 \lVert D p \rVert`, the
        radius judged by ``p``); the next point and the step's :class:`~torch_sgn.StepInfo`
        (``stop_reason="scaled_trust_region"``, ``damping`` its :math:`\lambda`)."""
        if self.region is None:
            self.region = Radius.start(theta, jac)
        else:
            self.region.rescaled(jac)
        loss0 = float(r.square().sum())
        scaled = Scaled.of(jac, cost_grad, self.region.scale)
        trials, taken, evals = 0, False, 0
        while not taken and trials < SCALED_TRIALS:
            trials += 1
            step, damping = scaled.step(self.region.radius)
            trial = step
            if self.accelerate:  # as SGN's steps: p + a / 2 where a is small against p
                curve, norms = core.second_difference(
                    self.residuals_at, theta, step, r, jvp=lambda v: jac @ v
                )
                evals += 1
                if core.above_rounding(norms, theta.dtype):
                    a = scaled.acceleration(jac.T @ curve, damping)
                    scale = self.region.scale
                    if core.accepted(scale * step, scale * a) is not None:
                        trial = step + 0.5 * a
            loss = self.loss_at(theta + trial)
            evals += 1
            ratio = update(self.region, step, damping, jac, loss0 / 2, loss / 2)
            taken = ratio >= ACCEPT
        # SGN's loss is ||r||^2: its predicted change is twice the cost's, g^T p + |J p|^2 / 2
        predicted = 2 * float(cost_grad @ step) + float((jac @ step).square().sum())
        info = StepInfo(
            loss=loss0, loss_after=loss if taken else loss0,
            grad_norm=2 * float(torch.linalg.vector_norm(cost_grad)), iterations=0,
            residual=0.0, stop_reason="scaled_trust_region", damping=damping,
            next_damping=damping, step_size=self.lr if taken else 0.0, tr_ratio=ratio,
            predicted_change=predicted, loss_evals=evals, line_search_ok=taken,
            attempts=trials, solver="direct", accelerated=taken and trial is not step,
            taken=taken,
        )  # fmt: skip
        return (theta + trial if taken else theta), info


def _close(a: Tensor, b: Tensor, size: Tensor) -> bool:
    """Equal shapes, and each entry of ``a`` within ``sqrt(eps)`` times ``size`` (the entry's
    magnitude) of ``b``'s."""
    if a.shape != b.shape:
        return False
    info = torch.finfo(b.dtype)
    return bool(((a - b).abs() <= math.sqrt(info.eps) * size + info.tiny).all())


class _Call(nn.Module):
    """``fn(module)`` as a module's forward, for :func:`torch.func.functional_call`."""

    def __init__(self, fn: Callable[[nn.Module], Tensor], module: nn.Module):
        super().__init__()
        self.fn, self.inner = fn, module

    def forward(self) -> Tensor:
        return self.fn(self.inner)
