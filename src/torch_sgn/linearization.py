r"""The interface between the optimizer and the curvature engines.

An *engine* linearizes the model and loss at a point on a mini-batch (a :class:`Batch`: the
model's inputs and the loss's targets): one call ``engine(flat, batch, buffers_out)`` returns a
:class:`Linearization` holding the loss, its
gradient and the matrix-free product ``v -> G v`` at the parameters ``flat``. The optimizer,
CG, the data-parallel communicator and the CUDA-graph capture consume it; the engines
(:mod:`~torch_sgn.model.flat_model`, :mod:`~torch_sgn.engines.layerwise.engine`) produce it, and
:mod:`~torch_sgn.engines.selection` chooses one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from .losses import OutputLoss

if TYPE_CHECKING:
    from .model.flat_model import FunctionalModel, Inputs

__all__ = [
    "ENGINE",
    "Batch",
    "FACTORS",
    "ROWS",
    "Engine",
    "Linearization",
    "RowSample",
    "SampleSpace",
    "check_loss_parameters",
    "ggn_matrix",
    "linearize",
    "loss_and_output_gradient",
    "weight_penalty",
]


#: How a linearization's ``J`` is formed (:attr:`Linearization.jacobian`): by the engine's
#: products (or its own dense ``G`` or sample space), row by row
#: (:mod:`torch_sgn.engines.functional`), or on all of too many rows by the layers' factors
#: (:func:`torch_sgn.engines.functional.by_factors`).
ENGINE, ROWS, FACTORS = "engine", "rows", "factors"


@dataclass(frozen=True)
class Batch:
    """One mini-batch: the model's ``inputs`` (a tensor, or a tuple passed positionally) and the
    loss's ``targets``."""

    inputs: Inputs
    targets: Tensor

    @property
    def args(self) -> Tuple[Tensor, ...]:
        """The inputs as the tuple of positional arguments of the model's forward."""
        return self.inputs if isinstance(self.inputs, tuple) else (self.inputs,)

    def __len__(self) -> int:
        """The number of samples (the leading dimension of the first input)."""
        return self.args[0].shape[0]

    def subset(self, index: Tensor) -> Batch:
        """The samples at ``index`` (along the leading dimension of inputs and targets)."""
        xs = tuple(x[index] for x in self.args)
        return Batch(xs if isinstance(self.inputs, tuple) else xs[0], self.targets[index])


@dataclass(frozen=True)
class RowSample:
    r"""The weighted rows :math:`\tilde J = D^{1/2} J_S` of a sample of a residual problem's rows
    (:mod:`torch_sgn.solve.sampled`).

    Attributes:
        kernel: :math:`\tilde K = \tilde J \tilde J^\top`, ``m x m``, float64.
        jvp: flat ``v -> \tilde J v`` (``m``, float64).
        vjp: ``w -> \tilde J^\top w`` for ``w`` of ``m`` entries (flat, the parameters' dtype).
        hessian: ``h``, the loss's output-space Hessian ``h I``.
        points: the points drawn from each block.
    """

    kernel: Tensor
    jvp: Callable[[Tensor], Tensor]
    vjp: Callable[[Tensor], Tensor]
    hessian: float
    points: List[int]

    @property
    def size(self) -> int:
        return self.kernel.shape[0]


@dataclass
class SampleSpace:
    r"""``G = J^\top H J`` seen from the ``R`` network outputs of a batch (samples times outputs
    per sample), for the direct solver on models with more parameters than the batch has
    outputs (see :func:`~torch_sgn.solve.direct.solve_in_sample_space`).

    Attributes:
        outputs: the network's outputs (their shape; ``R = outputs.numel()``).
        output_grad: the loss's gradient with respect to the outputs, ``g = J^T output_grad``.
        hessian: ``t -> H t`` for output-shaped ``t`` (the loss's Hessian in output space).
        vjp: output-shaped ``u -> J^T u`` (flat).
        kernel: ``() -> J J^T``, the ``R x R`` matrix in float64 (rows in the order of
            ``outputs.reshape(-1)``).
        jvp: flat ``v -> J v`` (output-shaped), where the engine has it; the weight decay's
            step through the outputs needs it.
        weight_decay, point: the L2 penalty :math:`\lambda` and the point :math:`\theta`
            (:meth:`Linearization.regularized`): the gradient is then
            :math:`J^\top e + \lambda\theta` and the curvature :math:`G + \lambda I`.
    """

    outputs: Tensor
    output_grad: Tensor
    hessian: Callable[[Tensor], Tensor]
    vjp: Callable[[Tensor], Tensor]
    kernel: Callable[[], Tensor]
    jvp: Optional[Callable[[Tensor], Tensor]] = None
    weight_decay: float = 0.0
    point: Optional[Tensor] = None
    _kernel: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        """``R``, the number of outputs of the batch."""
        return self.outputs.numel()

    def kernel_matrix(self) -> Tensor:
        """``J J^T``, formed once (a step's re-solves with another damping reuse it)."""
        if self._kernel is None:
            self._kernel = self.kernel()
        return self._kernel


@dataclass
class Linearization:
    """The model and loss linearized at one point on one mini-batch.

    Attributes:
        loss: the loss at the point (detached scalar tensor).
        grad: its gradient, flat.
        ggn_vp: ``v -> G v`` for flat ``v``.
        value_at: ``flat -> loss`` at other parameters on the same batch, with the same random
            numbers (the trust region's and line search's trial points); ``None`` lets the
            optimizer evaluate the model functionally.
        outputs: the network's outputs at the point, where the engine keeps them.
        outputs_at: ``flat -> outputs`` at other parameters on the same batch, with the same
            random numbers (the geodesic acceleration's second difference); ``None`` lets the
            optimizer evaluate the model functionally.
        vjp: output-shaped ``u -> J^T u`` (flat) at the point, where the engine has it without
            another forward pass; ``None`` lets the optimizer run one.
        dense_ggn: ``() -> G``, the ``P x P`` matrix (float64 where the engine can sum it so),
            where the engine has a faster route to it than products (see :meth:`ggn_matrix`);
            ``None`` otherwise.
        sample_space: ``G`` as seen from the batch's outputs, where the engine forms ``J J^T``
            (chains of linear layers and activations); ``None`` otherwise. Anything that
            changes ``G`` or the gradient (a subset, a mask, an all-reduce) must drop it.
        rows: ``seed -> sample``, a random sample of ``J``'s rows weighted to estimate ``G``
            (:class:`RowSample`), where the engine can draw one
            without forming ``J`` (a residual problem on more rows than an exact step takes);
            ``None`` otherwise. A mask of the parameters drops it.
        jacobian: how ``J`` is formed: :data:`ENGINE`, :data:`ROWS` or :data:`FACTORS`.
    """

    loss: Tensor
    grad: Tensor
    ggn_vp: Callable[[Tensor], Tensor]
    value_at: Optional[Callable[[Tensor], Tensor]] = None
    outputs: Optional[Tensor] = None
    outputs_at: Optional[Callable[[Tensor], Tensor]] = None
    vjp: Optional[Callable[[Tensor], Tensor]] = None
    dense_ggn: Optional[Callable[[], Tensor]] = None
    sample_space: Optional[SampleSpace] = None
    rows: Optional[Callable[[int], RowSample]] = None
    jacobian: str = ENGINE
    _matrix: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)

    def ggn_matrix(self) -> Tensor:
        """``G`` as a dense ``P x P`` float64 matrix (undamped), for the direct solver.

        From the engine's own route where it has one (the layer-wise engine forms the output
        Jacobian of a chain of linear layers and activations and sums ``J^T H J`` in
        float64), else from products with the identity's columns
        (:func:`torch_sgn.solve.direct.ggn_matrix`, in the model's dtype). Formed once: a step's
        re-solves with another damping reuse it.
        """
        if self._matrix is None:
            if self.dense_ggn is not None:
                matrix = self.dense_ggn()
            else:
                matrix = ggn_matrix(self.ggn_vp, self.grad.numel(), self.grad)
            self._matrix = matrix.to(torch.float64)
        return self._matrix

    def restricted(self, mask: Tensor) -> Linearization:
        """The linearization in the directions where ``mask`` is 1 (the parameters still
        trainable): ``P g`` and ``P G P``, with ``P`` the diagonal of ``mask``."""
        ggn_vp = self.ggn_vp
        dense = None
        if self.dense_ggn is not None:
            dense = lambda: self.ggn_matrix() * mask[:, None] * mask[None, :]  # noqa: E731
        return replace(
            self,
            grad=self.grad * mask,
            ggn_vp=lambda v: ggn_vp(v * mask) * mask,
            dense_ggn=dense,
            sample_space=None,  # its J spans the frozen directions too
            rows=None,
        )

    def regularized(self, weight_decay: float, flat: Tensor) -> Linearization:
        r"""The linearization of the loss plus the penalty :math:`\frac\lambda2 \|\theta\|^2`
        at ``flat`` (:math:`\theta`): loss :math:`L + \frac\lambda2\|\theta\|^2`, gradient
        :math:`g + \lambda\theta`, curvature :math:`G + \lambda I` (the penalty's Hessian:
        exact, it is quadratic), the trial points' loss with the penalty. Itself where
        ``weight_decay`` is 0.

        The view through the batch's outputs keeps the penalty
        (:func:`~torch_sgn.solve.direct.solve_in_sample_space` solves for its term
        :math:`\lambda\theta`, not of the form :math:`J^\top e`, by one product ``J theta``),
        and is dropped where the engine has no ``J v`` for it. ``outputs``, ``outputs_at`` and
        ``vjp`` describe the network, not the loss, and stay as they are.
        """
        if weight_decay == 0:
            return self
        ggn_vp, value_at, dense_ggn = self.ggn_vp, self.value_at, self.dense_ggn

        def product(v: Tensor) -> Tensor:  # G v + lambda v (a product is a fresh tensor)
            return ggn_vp(v).add_(v, alpha=weight_decay)

        def value(point: Tensor) -> Tensor:
            return value_at(point) + weight_penalty(point, weight_decay)

        def dense() -> Tensor:  # G + lambda I, on a copy: an engine may keep its matrix
            matrix = dense_ggn().to(torch.float64, copy=True)
            matrix.diagonal().add_(weight_decay)
            return matrix

        space = self.sample_space
        if space is not None:
            keep = space.jvp is not None
            space = replace(space, weight_decay=weight_decay, point=flat) if keep else None
        return replace(
            self,
            loss=self.loss + weight_penalty(flat, weight_decay).to(self.loss.dtype),
            grad=torch.add(self.grad, flat, alpha=weight_decay),
            ggn_vp=product,
            value_at=None if value_at is None else value,
            dense_ggn=None if dense_ggn is None else dense,
            sample_space=space,
        )


def weight_penalty(flat: Tensor, weight_decay: float) -> Tensor:
    r""":math:`\frac\lambda2 \|\theta\|^2`, the penalty of ``SGN(weight_decay=lambda)``, as a
    0-d tensor of ``flat``'s dtype (summed in float64)."""
    return (0.5 * weight_decay * flat.double().square().sum()).to(flat.dtype)


class Engine(Protocol):
    """Linearizes a model and a loss (bound at construction) at ``flat`` on ``batch``.

    ``buffers_out`` receives the buffers as the one forward pass that gives the gradient
    updated them (training mode); the caller commits them when the step is accepted.
    """

    def __call__(
        self, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
    ) -> Linearization: ...


def linearize(
    engine: Engine, flat: Tensor, batch: Batch, buffers_out: Optional[dict] = None
) -> Linearization:
    """``engine(flat, batch, buffers_out)``, with autograd's error for a loss that has no path to
    the parameters turned into one that says what it means."""
    try:
        return engine(flat, batch, buffers_out)
    except RuntimeError as error:
        if "does not require grad and does not have a grad_fn" not in str(error):
            raise
        raise ValueError(
            "the model's outputs have no gradient path to its trainable parameters: an output "
            "(a residual) that does not depend on the parameters, or a forward pass that "
            "computes it with autograd off (torch.no_grad, .detach()); make the outputs "
            "depend on the parameters. Nothing was changed"
        ) from error


def loss_and_output_gradient(
    loss: OutputLoss, outputs: Tensor, targets: Tensor, check: bool = True
) -> Tuple[Tensor, Tensor]:
    """The loss and its gradient with respect to the outputs (autograd in output space)."""
    if check:
        loss.check_targets(outputs, targets)
    with torch.enable_grad():
        z = outputs.detach().requires_grad_(True)
        value = loss.value(z, targets)
        (dz,) = torch.autograd.grad(value, z)
    return value.detach(), dz


def check_loss_parameters(
    loss: OutputLoss, fmodel: FunctionalModel, lin: Linearization, flat: Tensor, batch: Batch
) -> None:
    """Raises ``ValueError`` where the loss reads the model's parameters (a penalty inside a
    callable, which no engine differentiates): once per loss and model, on the outputs the
    engine kept, else on one more forward pass."""

    def outputs() -> Tensor:
        return lin.outputs if lin.outputs is not None else fmodel(flat, batch.inputs)

    loss.check_parameters(fmodel.params, outputs, batch.targets)


def ggn_matrix(
    ggn_vp: Callable[[Tensor], Tensor],
    n: int,
    like: Tensor,
    chunk: Optional[int] = None,
) -> Tensor:
    """``G`` (``n x n``) from products with the identity's columns.

    On a CPU one product per column: batching them with ``torch.func.vmap`` gained nothing
    consistent there (faster on some models, slower on others: ``docs/SOLVERS.md``, "What
    forming G costs"). On other devices the columns go through
    ``vmap`` in chunks of ``chunk``, one batched pass per chunk in place of many small kernel
    launches, and one by one where a product cannot be batched.

    Args:
        ggn_vp: ``v -> G v`` for a flat ``v``.
        n: the number of parameters.
        like: a tensor of the parameters' dtype and device.
        chunk: columns per batched pass; ``None`` picks 64.
    """
    chunk = min(n, 64) if chunk is None else max(1, min(chunk, n))
    out = like.new_empty((n, n))
    products = _products(ggn_vp, like.device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        out[start:stop] = products(_identity_columns(n, start, stop, like))
    # Row i holds G e_i, column i of G; G is symmetric, so these rows are its columns too.
    return out


def _identity_columns(n: int, start: int, stop: int, like: Tensor) -> Tensor:
    """Rows ``start:stop`` of the identity: the unit vectors ``e_start ... e_{stop-1}``."""
    rows = like.new_zeros((stop - start, n))
    rows[:, start:stop].fill_diagonal_(1.0)
    return rows


def _loop(ggn_vp: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
    return torch.stack([ggn_vp(r) for r in rows.unbind(0)])


def _products(
    ggn_vp: Callable[[Tensor], Tensor], device: torch.device
) -> Callable[[Tensor], Tensor]:
    """Products with the rows of a matrix: batched by ``vmap`` off the CPU while that works."""
    use_vmap = device.type != "cpu"
    vmapped = torch.func.vmap(ggn_vp)

    def run(rows: Tensor) -> Tensor:
        nonlocal use_vmap
        if use_vmap:
            try:
                return vmapped(rows)
            except Exception:  # an op without a batching rule (older torch, custom layers)
                use_vmap = False
        return _loop(ggn_vp, rows)

    return run
