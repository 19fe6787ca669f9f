"""One shared table of models x losses for the core tests, with independent dense references."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple
    output_kind: str  # "flat": (N, C); "seq": (N, C, L)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(18, 3)
    )


def _seq() -> nn.Module:
    # (N, 2, 5) -> (N, 3, 4): outputs with an extra dimension (per-position classes).
    return nn.Sequential(nn.Conv1d(2, 3, 2), nn.Sigmoid(), nn.Conv1d(3, 3, 1))


MODELS = [
    ModelCase("mlp", _mlp, (6, 4), "flat"),
    ModelCase("cnn", _cnn, (5, 1, 8, 8), "flat"),
    ModelCase("seq", _seq, (4, 2, 5), "seq"),
]


def _log_cosh(outputs: Tensor, targets: Tensor) -> Tensor:
    return torch.log(torch.cosh(outputs - targets)).mean()


@dataclass(frozen=True)
class LossCase:
    name: str
    make: Callable[[], object]
    targets: str  # "real", "index", "index-ignored" (some -100), "binary", "probs", "multi-hot"


LOSSES = [
    LossCase("mse", lambda: "mse", "real"),
    LossCase("MSELoss-sum", lambda: nn.MSELoss(reduction="sum"), "real"),
    LossCase("cross_entropy", lambda: "cross_entropy", "index"),
    LossCase(
        "CE-sum-smooth", lambda: nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1), "index"
    ),
    LossCase("CE-mean-smooth", lambda: nn.CrossEntropyLoss(label_smoothing=0.2), "index"),
    LossCase("CE-probs", lambda: "cross_entropy", "probs"),
    # Rows of 0s and 1s: each sums to the number of its labels, 0 included.
    LossCase("CE-multi-hot", lambda: "cross_entropy", "multi-hot"),
    LossCase(
        "CE-sum-smooth-multi-hot",
        lambda: nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.2),
        "multi-hot",
    ),
    LossCase("CE-ignore-index", lambda: "cross_entropy", "index-ignored"),
    LossCase(
        "CE-sum-smooth-ignore",
        lambda: nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1),
        "index-ignored",
    ),
    LossCase(
        "CE-weight",
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)),
        "index",
    ),
    LossCase("bce_with_logits", lambda: "bce_with_logits", "binary"),
    LossCase("BCE-sum", lambda: nn.BCEWithLogitsLoss(reduction="sum"), "binary"),
    LossCase("log-cosh callable", lambda: _log_cosh, "real"),
]


LOSS = {case.name: case for case in LOSSES}


def make_batch(model_case: ModelCase, loss_case: LossCase, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = model_case.build().to(dtype)
    x = torch.randn(model_case.input_shape, generator=g, dtype=dtype)
    with torch.no_grad():
        out_shape = model(x).shape
    n, c = out_shape[0], out_shape[1]
    if loss_case.targets == "real":
        y = torch.randn(out_shape, generator=g, dtype=dtype)
    elif loss_case.targets == "binary":
        y = torch.rand(out_shape, generator=g, dtype=dtype)
    elif loss_case.targets == "probs":
        y = torch.softmax(torch.randn(out_shape, generator=g, dtype=dtype), dim=1)
    elif loss_case.targets == "multi-hot":
        y = (torch.rand(out_shape, generator=g) < 0.5).to(dtype)
    else:
        y = torch.randint(0, c, (n, *out_shape[2:]), generator=g)
        if loss_case.targets == "index-ignored":  # torch's default ignore_index
            y.view(-1)[::3] = -100
    return model, x, y


def loss_fn(loss) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss as a plain function, independent of torch_sgn.losses."""
    if isinstance(loss, str):
        return {
            "mse": F.mse_loss,
            "cross_entropy": F.cross_entropy,
            "bce_with_logits": F.binary_cross_entropy_with_logits,
        }[loss]
    return loss


def dense_ggn(model: nn.Module, loss, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(G, g, theta) built from full Jacobians and the output-space Hessian by autograd."""
    _, J, H, g, theta = dense_parts(model, loss, x, y)
    return J.T @ H @ J, g, theta


def dense_parts(model: nn.Module, loss, x: Tensor, y: Tensor):
    """(f, J, H, g, theta) by autograd over the trainable parameters: the outputs as a function
    ``f`` of the flat parameters, its Jacobian, the loss's output-space Hessian, the gradient
    and the point."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p.detach() for n, p in model.named_parameters() if p.requires_grad]
    theta = torch.cat([p.reshape(-1) for p in params])
    sizes = [p.numel() for p in params]

    def f(flat: Tensor) -> Tensor:
        chunks = [c.view(p.shape) for c, p in zip(flat.split(sizes), params)]
        return functional_call(model, dict(zip(names, chunks)), (x,))

    out = f(theta)
    fn = loss_fn(loss)
    J = jacobian(f, theta).reshape(out.numel(), -1)
    H = hessian(lambda z: fn(z.view(out.shape), y), out.detach().reshape(-1))
    g = torch.func.grad(lambda t: fn(f(t), y))(theta)
    return f, J, H, g, theta


def dense_ggn_of_module(model: nn.Module, loss, x, y: Tensor) -> tuple[Tensor, Tensor]:
    """(G, g) through the model's own parameters: one reverse-mode pass per output element
    (no ``torch.func``, no forward mode, parameters never swapped), so it holds for any model
    autograd can differentiate, shared modules and tied weights included."""
    params = [p for p in model.parameters() if p.requires_grad]  # each tensor once
    out = model(x)

    def dense(g, p):  # no gradient, or a sparse one (embeddings with sparse=True)
        return torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g

    rows = []
    for o in out.reshape(-1):
        grads = torch.autograd.grad(o, params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([dense(g, p).reshape(-1) for g, p in zip(grads, params)]))
    J = torch.stack(rows)
    fn = loss_fn(loss)
    H = hessian(lambda z: fn(z.view(out.shape), y), out.detach().reshape(-1))
    g = torch.autograd.grad(fn(model(x), y), params, allow_unused=True)
    return J.T @ H @ J, torch.cat([dense(t, p).reshape(-1) for t, p in zip(g, params)])


class SineWithoutJvp(torch.autograd.Function):
    """sin with a backward only (old style: no setup_context, no jvp): forward-mode AD has no
    rule for it, so an engine takes ``J v`` by double backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()
