"""The shared test cases: one zoo of models with the batches they take, the losses of the core
table, and one dense float64 reference of ``G = J^T H J`` and the gradient.

The zoo maps a name to a :class:`ModelCase`: how to build the model and draw its inputs (and, for
the families with a loss of their own, its targets). ``MODELS`` is the core table's model axis
(plain chains, taken by every engine), crossed with ``LOSSES`` by :func:`make_batch`; the other
families (residual nets with batch norm, attention, recurrent nets, several inputs, shared and
tied parameters) are drawn by :func:`make_model`. :func:`dense_ggn` (and :func:`dense_parts`,
its factors) builds ``J`` and ``g`` by reverse mode through the model's own parameters and forward
pass, one output element at a time: no forward mode, parameters never swapped (``torch.func``
only for ``f``, the outputs at other points), so it holds for any model autograd can
differentiate. The PINN operators' references (:func:`nested_jet`, :func:`nested_derivative`,
:func:`pointwise_laplacian`) take input derivatives by nested ``torch.autograd.grad``; shared
helpers: :func:`flat_parameters`, :func:`sgn_options`; a PINN of many rows:
:func:`poisson_residuals`; what a call runs of the library, observed, not patched:
:func:`library_calls`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.functional import hessian
from torch.func import functional_call

import torch_sgn
from torch_sgn import SGN
from torch_sgn.options import ARGUMENT_NAMES, KEYS, Options
from torch_sgn.pinn import Residual, Residuals, laplacian
from torch_sgn.pinn.operators import Jet

D = torch.float64

_LIBRARY = os.path.dirname(torch_sgn.__file__) + os.sep


def library_calls(run: Callable[[], object]) -> set:
    """``(file, function)`` of every call into the library while ``run()`` runs, the file
    relative to the package (``"optimizer.py"``, ``"engines/traced/engine.py"``), the function
    by its qualified name (``"SGN.__init__"``): by ``sys.setprofile``, so a test asserts what
    a call did not run without replacing anything."""
    seen: set = set()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(_LIBRARY):
            seen.add((code.co_filename[len(_LIBRARY) :], code.co_qualname))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


# A maker draws one tensor from a generator, in a floating dtype (index tensors ignore it).
Maker = Callable[[torch.Generator, torch.dtype], Tensor]


def normal(*shape: int) -> Maker:
    return lambda g, dtype: torch.randn(shape, generator=g, dtype=dtype)


def classes(count: int, *shape: int) -> Maker:
    """Class indices (or tokens) in ``range(count)``."""
    return lambda g, dtype: torch.randint(0, count, shape, generator=g)


@dataclass(frozen=True)
class ModelCase:
    """One model of the zoo. ``inputs`` is a maker, or a tuple of makers for a model of several
    inputs; ``targets`` is ``None`` for the core table's models (the loss case draws them),
    else a maker, with ``loss`` the loss the family is tested with."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Union[Maker, tuple]
    targets: Maker | None = None
    loss: str = "mse"


# --- the core table's models: chains of known layers -------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(18, 3)
    )


def _seq() -> nn.Module:
    # (N, 2, 5) -> (N, 3, 4): outputs with an extra dimension (per-position classes).
    return nn.Sequential(nn.Conv1d(2, 3, 2), nn.Sigmoid(), nn.Conv1d(3, 3, 1))


# --- small families that are not chains of known layers ----------------------------------------
class ResidualBlock(nn.Module):
    """Convolutions, batch norm, a skip connection, global pooling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(3)
        self.skip = nn.Conv2d(2, 3, 1)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)) + self.skip(x))
        return self.head(h.mean((2, 3)))


class TokenAttention(nn.Module):
    """Embedding, pre-norm causal self-attention (scaled_dot_product_attention), LayerNorm."""

    def __init__(self, vocab=5, width=4, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        n, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(n, length, width)
        return self.out(x).transpose(1, 2)  # (N, classes, L) for cross-entropy per position


class MaskedMultihead(nn.Module):
    """nn.MultiheadAttention with an explicit causal mask, dropout and a GELU MLP."""

    def __init__(self, width=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, dropout=0.2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 6), nn.GELU(), nn.Dropout(0.3), nn.Linear(6, 2))

    def forward(self, x):
        length = x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        a, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.mlp(x + a)


LENGTH, WIDTH = 5, 8  # sequence length and width of the larger sequence models


class Recurrent(nn.Module):
    """A recurrent layer read at the last time step, and a linear head."""

    def __init__(self, cell, width=WIDTH, hidden=6, outputs=3, **options):
        super().__init__()
        self.rnn = cell(width, hidden, batch_first=True, **options)
        self.head = nn.Linear(hidden * (2 if options.get("bidirectional") else 1), outputs)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class TwoInputs(nn.Module):
    """A custom forward with two inputs and a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(2, 4)
        self.scale = nn.Parameter(torch.tensor(1.5), requires_grad=False)
        self.head = nn.Linear(4, 2)

    def forward(self, x, z):
        return self.head(torch.tanh(self.a(x)) * self.b(z).sigmoid() * self.scale)


def _encoder_layer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0, batch_first=True)
    return nn.Sequential(layer, nn.Flatten(), nn.Linear(12, 2))


class CausalEncoder(nn.Module):
    """A causal transformer encoder layer (its attention goes through the fused kernels)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(LENGTH, dtype=x.dtype)
        return self.head(self.layer(x, src_mask=mask, is_causal=True)).mean(1)


class CausalAttention(nn.Module):
    """Multi-head causal self-attention by ``F.scaled_dot_product_attention``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        heads = (t.unflatten(-1, (2, WIDTH // 2)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.head(torch.tanh(a.transpose(1, 2).flatten(2))).mean(1)


class SharedModule(nn.Module):
    """One module under two names, applied twice."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class TiedWeight(nn.Module):
    """An embedding tied to the output layer, as in language models."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(3, 4)
        self.hidden = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)
        self.out.weight = self.embed.weight  # both (3, 4)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens)))).mean(1)


def _twice_in_sequential() -> nn.Module:
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(4, 3))


class Parametrized(nn.Module):
    """Weight norm, an orthogonal weight, a channels-last convolution, spectral norm (in eval
    mode: in training mode its power iteration runs under no_grad, see
    test_any_model.NoGradGate)."""

    def __init__(self):
        super().__init__()
        P = nn.utils.parametrizations
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = P.weight_norm(nn.Linear(3 * 4 * 4, 6))
        self.turn = P.orthogonal(nn.Linear(6, 6))
        self.head = P.spectral_norm(nn.Linear(6, 3)).eval()

    def forward(self, x):
        h = torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last)))
        return self.head(torch.tanh(self.turn(torch.tanh(self.norm(h.flatten(1))))))


class Checkpointed(nn.Module):
    """Activation checkpointing (non-reentrant): traced with the checkpointed function run
    plainly."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        inner = lambda t: torch.tanh(self.a(t))  # noqa: E731
        return self.head(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False))


class BranchesOnValues(nn.Module):
    """Control flow on the values of a tensor (``if h.sum() > 0``): a trace would fix one
    branch. Inputs ``(N, 3)``, outputs ``(N, 2)``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            return torch.tanh(h)
        return h * 2


class MobileBlock(nn.Module):
    """A MobileNetV3 block: an expansion, a depthwise convolution, hard-swish, and a
    squeeze-and-excitation gate through a hard sigmoid."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(2, 6, 1)
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.squeeze, self.excite = nn.Linear(6, 3), nn.Linear(3, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = F.hardswish(self.depthwise(F.hardswish(self.expand(x))))
        gate = F.hardsigmoid(self.excite(F.relu(self.squeeze(h.mean((2, 3))))))
        return self.head((h * gate[:, :, None, None]).mean((2, 3)))


_SEQUENCES = normal(4, LENGTH, WIDTH)
ZOO = {
    case.name: case
    for case in [
        # the core table
        ModelCase("mlp", _mlp, normal(6, 4)),
        ModelCase("cnn", _cnn, normal(5, 1, 8, 8)),
        ModelCase("seq", _seq, normal(4, 2, 5)),
        # small enough for a dense G by one product per parameter
        ModelCase("resnet-bn", ResidualBlock, normal(6, 2, 4, 4), classes(3, 6), "cross_entropy"),
        ModelCase("attention", TokenAttention, classes(5, 3, 4), classes(5, 3, 4), "cross_entropy"),
        ModelCase("mha-mask", MaskedMultihead, normal(2, 3, 4), normal(2, 3, 2)),
        ModelCase("lstm-small", lambda: Recurrent(nn.LSTM, 3, 4, 2), normal(4, 3, 3), normal(4, 2)),
        ModelCase("gru-small", lambda: Recurrent(nn.GRU, 3, 4, 2), normal(4, 3, 3), normal(4, 2)),
        ModelCase(
            "two-inputs", TwoInputs, (normal(5, 3), normal(5, 2)), classes(2, 5), "cross_entropy"
        ),
        ModelCase("encoder-layer", _encoder_layer, normal(3, 3, 4), normal(3, 2)),
        # larger sequence models, and parameters reachable by several names
        ModelCase("encoder", CausalEncoder, _SEQUENCES, normal(4, 3)),
        ModelCase("sdpa", CausalAttention, _SEQUENCES, normal(4, 3)),
        ModelCase("lstm", lambda: Recurrent(nn.LSTM), _SEQUENCES, normal(4, 3)),
        ModelCase("gru", lambda: Recurrent(nn.GRU), _SEQUENCES, normal(4, 3)),
        ModelCase(
            "bilstm",
            lambda: Recurrent(nn.LSTM, num_layers=2, bidirectional=True),
            _SEQUENCES,
            normal(4, 3),
        ),
        ModelCase("shared-module", SharedModule, normal(6, 4), normal(6, 3)),
        ModelCase("twice-in-sequential", _twice_in_sequential, normal(6, 4), normal(6, 3)),
        ModelCase("tied-weight", TiedWeight, classes(3, 6, 2), normal(6, 3)),
        # parametrizations, activation checkpointing, a MobileNetV3 block
        ModelCase("parametrized", Parametrized, normal(4, 2, 4, 4), normal(4, 3)),
        ModelCase("checkpointed", Checkpointed, normal(5, 4), normal(5, 3)),
        ModelCase("mobile-block", MobileBlock, normal(4, 2, 5, 5), normal(4, 3)),
    ]
}
MODELS = [ZOO["mlp"], ZOO["cnn"], ZOO["seq"]]


def _draw(maker, g: torch.Generator, dtype: torch.dtype):
    return tuple(m(g, dtype) for m in maker) if isinstance(maker, tuple) else maker(g, dtype)


def _model_and_inputs(case: ModelCase, dtype, seed: int, mode: str | None):
    """The model (built after ``torch.manual_seed(seed)``, put in ``mode``), its inputs and the
    generator, seeded with ``seed``, that drew them."""
    if mode not in ("train", "eval", None):
        raise ValueError(f"invalid mode={mode!r}: 'train', 'eval' or None (as built)")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = case.build().to(dtype)
    if mode is not None:
        model.train(mode == "train")
    return model, _draw(case.inputs, g, dtype), g


def make_model(name: str, *, mode: str | None = None, dtype=D, seed: int = 0):
    """(model, inputs, targets, loss) of the zoo's family ``name``, drawn from ``seed``; the
    model in ``mode`` ("train" or "eval"), or as built (in training mode, but where a model
    sets a part of itself otherwise, as "parametrized" does)."""
    case = ZOO[name]
    if case.targets is None:
        raise ValueError(f"{name!r} draws its targets by a loss case: use make_batch")
    model, x, g = _model_and_inputs(case, dtype, seed, mode)
    return model, x, case.targets(g, dtype), case.loss


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


def make_batch(model_case: ModelCase, loss_case: LossCase, dtype=D, seed=0):
    """(model, inputs, targets) of one cell of the core table: targets of the loss case's
    kind, shaped as the model's outputs."""
    model, x, g = _model_and_inputs(model_case, dtype, seed, None)
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


# --- the dense reference -----------------------------------------------------------------------
@contextlib.contextmanager
def _random_numbers(seed: int | None):
    """With ``seed``, random numbers (dropout) drawn from ``torch.manual_seed(seed)`` and the
    global random state left as it was; without, drawn as they come."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _one_pass(model: nn.Module, seed: int | None):
    """One forward pass and its derivatives: the buffers it writes (batch norm's running
    statistics) are put back afterwards, so that each pass starts from the model's own, as the
    one forward pass of a step does."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    try:
        with _random_numbers(seed):
            yield
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved and not torch.equal(b, saved[n]):
                    b.copy_(saved[n])


def _flat_grad(output: Tensor, params: list, **options) -> Tensor:
    """d output / d params, flat; zeros for a parameter the output does not use, dense for a
    sparse gradient (embeddings with ``sparse=True``)."""
    grads = torch.autograd.grad(output, params, allow_unused=True, **options)
    return torch.cat(
        [
            (torch.zeros_like(p) if t is None else t.to_dense() if t.is_sparse else t).reshape(-1)
            for t, p in zip(grads, params)
        ]
    )


def dense_parts(model: nn.Module, loss, inputs, targets: Tensor, *, seed: int | None = None):
    """(f, J, H, g, theta) at the model's trainable parameters ``theta``: the Jacobian ``J`` of
    the outputs, one reverse-mode pass per output element through the model's own parameters
    (each tensor once, shared modules and tied weights included), the loss's output-space
    Hessian ``H``, the gradient ``g``, and the outputs as a function ``f`` of flat parameters
    (by ``functional_call``, for evaluations elsewhere).

    ``inputs`` is a tensor or a tuple of the model's arguments. Every pass starts from the
    model's buffers (:func:`_one_pass`); with ``seed`` each one draws its random numbers
    (dropout) from ``torch.manual_seed(seed)``, so that all see the same masks.
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    fn = loss_fn(loss)
    params = [p for p in model.parameters() if p.requires_grad]  # each tensor once
    with _one_pass(model, seed):
        out = model(*args)
        J = torch.stack([_flat_grad(o, params, retain_graph=True) for o in out.reshape(-1)])
    with _one_pass(model, seed):
        g = _flat_grad(fn(model(*args), targets), params)
    H = hessian(lambda z: fn(z.view(out.shape), targets), out.detach().reshape(-1))
    theta = torch.cat([p.detach().reshape(-1) for p in params])  # after the passes (max_norm)
    return _outputs_of_flat(model, args, seed), J, H, g, theta


def _outputs_of_flat(model: nn.Module, args: tuple, seed: int | None):
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # as parameters()
    shapes = [p.shape for n, p in model.named_parameters() if p.requires_grad]
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def f(flat: Tensor) -> Tensor:
        tensors = {n: b.clone() for n, b in buffers.items()}  # fresh, as in one pass
        chunks = flat.split([s.numel() for s in shapes])
        tensors.update({n: c.view(s) for n, c, s in zip(names, chunks, shapes)})
        with _random_numbers(seed):
            return functional_call(model, tensors, args)

    return f


def dense_ggn(model: nn.Module, loss, inputs, targets: Tensor, *, seed: int | None = None):
    """(G, g, theta): ``G = J^T H J``, the gradient and the point, from :func:`dense_parts`."""
    _, J, H, g, theta = dense_parts(model, loss, inputs, targets, seed=seed)
    return J.T @ H @ J, g, theta


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


def sgn_options(**changes) -> Options:
    """SGN's default options (:class:`~torch_sgn.options.Options`, by their param-group keys),
    with ``changes``; read from :class:`~torch_sgn.SGN`'s signature."""
    params = inspect.signature(SGN.__init__).parameters
    base = {key: params[ARGUMENT_NAMES.get(key, key)].default for key in KEYS}
    return Options.of({**base, **changes})


def flat_parameters(model: nn.Module, trainable: bool = False) -> Tensor:
    """A copy of the model's parameters as one flat vector, in ``parameters_to_vector``'s
    order (``trainable``: those with ``requires_grad`` alone)."""
    params = [p for p in model.parameters() if p.requires_grad or not trainable]
    return torch.cat([p.detach().reshape(-1) for p in params])


# --- PINN references: derivatives by nested autograd -------------------------------------------
def nested_jet(u: Callable[[Tensor], Tensor], x: Tensor, dims: Optional[tuple]) -> Jet:
    """Value, gradient and Laplacian by nested ``torch.autograd.grad``; rows are independent,
    so the derivative of a column's sum is the per-point derivative."""
    d = x.shape[1]
    dims = range(d) if dims is None else [k % d for k in dims]
    x = x.detach().requires_grad_(True)
    value = u(x)
    grads, laps = [], []
    for i in range(value.shape[1]):
        (g,) = torch.autograd.grad(value[:, i].sum(), x, create_graph=True)
        grads.append(g)
        lap = torch.zeros_like(value[:, i])
        for k in dims:
            (h,) = torch.autograd.grad(g[:, k].sum(), x, create_graph=True, materialize_grads=True)
            lap = lap + h[:, k]
        laps.append(lap)
    return Jet(value, torch.stack(grads, 1), torch.stack(laps, 1))


def nested_derivative(u: Callable[[Tensor], Tensor], x: Tensor, path: tuple) -> Tensor:
    """``d^p u_i / dx_{path[0]} ... dx_{path[-1]}`` for every output ``i``, by nested
    ``torch.autograd.grad`` (``(N, m)``)."""
    x = x.detach().requires_grad_(True)
    value = u(x)
    out = []
    for i in range(value.shape[1]):
        g = value[:, i]
        for k in path:
            (full,) = torch.autograd.grad(g.sum(), x, create_graph=True, materialize_grads=True)
            g = full[:, k]
        out.append(g)
    return torch.stack(out, 1)


def pointwise_laplacian(u, x):
    """The Laplacian of a network of two inputs by nested autograd, one point at a time: shares
    no code with the forward Laplacian."""
    rows = []
    for p in x:
        p = p.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(u(p[None]).sum(), p, create_graph=True)
        rows.append(sum(torch.autograd.grad(g[i], p, create_graph=True)[0][i] for i in range(2)))
    return torch.stack(rows)[:, None]


def poisson_residuals(n_in: int, n_bd: int, widths=(2, 8, 8, 1), seed: int = 0) -> Residuals:
    """The 2-D Poisson problem of :mod:`torch_sgn.pinn` on ``n_in`` interior points and ``n_bd``
    boundary points (two edges, weight 2) drawn from a seeded generator, a tanh MLP of
    ``widths``: a residual problem whose rows are as many as asked."""
    g = torch.Generator().manual_seed(seed)
    x_in = torch.rand(n_in, 2, generator=g, dtype=D)
    t = torch.rand(n_bd, 1, generator=g, dtype=D)
    x_bd = torch.cat([t, (torch.arange(n_bd) % 2).to(D)[:, None]], 1)
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    net = nn.Sequential(*layers).to(D)

    def f(x: Tensor) -> Tensor:
        return 2 * math.pi**2 * torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])

    return Residuals(
        net,
        {
            "interior": Residual(lambda u, x: -laplacian(u, x) - f(x), points=x_in),
            "boundary": Residual(lambda u, x: u(x), points=x_bd, weight=2.0),
        },
    )
