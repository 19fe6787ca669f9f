"""The models and batches the cost benchmarks time: the paper's five (its presets) and models
that are not chains of known layers (:data:`ANY_MODELS`), with random inputs and targets of the
right shapes (a product's cost does not depend on the values); the kernel switches and engine
options they run under."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Dict

import torch
from torch import nn

from torch_sgn.experiments.models import PRESETS, CausalTransformer, LSTMModel, ResNetBN

__all__ = [
    "ANY_MODELS",
    "TCN",
    "ScaledEmbedding",
    "batch",
    "engine_options",
    "math_kernels",
    "scaled_padding_transformer",
]


class TCN(nn.Module):
    """A temporal convolutional network (Bai, Kolter and Koltun, 2018): an embedding, two
    residual blocks of two causal dilated convolutions with weight normalization, a 1x1
    convolution per position; logits ``(N, vocab, L)``."""

    def __init__(self, vocab=64, width=128, kernel=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        wn = nn.utils.parametrizations.weight_norm
        self.convs = nn.ModuleList(
            wn(nn.Conv1d(width, width, kernel, padding=(kernel - 1) * d, dilation=d))
            for d in (1, 1, 2, 2)
        )
        self.head = nn.Conv1d(width, vocab, 1)

    def forward(self, idx):
        h = self.embed(idx).transpose(1, 2)
        for first, second in zip(self.convs[::2], self.convs[1::2]):
            length = h.shape[2]
            inner = torch.relu(first(h)[..., :length])  # causal: the right padding cut off
            h = torch.relu(h + torch.relu(second(inner)[..., :length]))
        return self.head(h)


class ScaledEmbedding(nn.Embedding):
    """A word embedding scaled by the square root of its width, with a padding row: a subclass
    with a forward of its own, as sequence-to-sequence models have."""

    def forward(self, idx):
        return super().forward(idx) * self.embedding_dim**0.5


def scaled_padding_transformer() -> CausalTransformer:
    """:class:`CausalTransformer` with a :class:`ScaledEmbedding` (padding row 0)."""
    model = CausalTransformer()
    model.embed = ScaledEmbedding(64, 128, padding_idx=0)
    return model


#: name -> (build, input shape with the batch, vocabulary size or None for real inputs)
ANY_MODELS = {
    "resnet_bn": (ResNetBN, (128, 3, 32, 32), None),
    "transformer": (CausalTransformer, (32, 64), 64),
    "lstm": (LSTMModel, (32, 64), 64),
    "bilstm": (partial(LSTMModel, layers=2, bidirectional=True, dropout=0.1), (32, 64), 64),
    "gru": (partial(LSTMModel, cell=nn.GRU), (32, 64), 64),
    "tcn": (TCN, (32, 64), 64),
    "transformer_pad": (scaled_padding_transformer, (32, 64), 64),
}


def batch(name: str, device: torch.device):
    """``(model, x, y, loss name)`` of the model ``name`` (a paper preset or one of
    :data:`ANY_MODELS`) at its batch size on ``device``, drawn from seed 0."""
    if name in ANY_MODELS:
        build, shape, vocab = ANY_MODELS[name]
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = build()
        if vocab is None:
            x = torch.randn(shape, generator=g)
            y = torch.randint(0, 10, shape[:1], generator=g)
        else:
            x = torch.randint(0, vocab, shape, generator=g)
            y = torch.randint(0, vocab, shape, generator=g)
        return model.to(device), x.to(device), y.to(device), "cross_entropy"
    p = PRESETS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn((p.batch_size, *p.input_shape), generator=g)
    model = p.build()
    with torch.no_grad():
        out = model(x)
    if p.loss == "mse":
        y = torch.randn(out.shape, generator=g)
    else:
        y = torch.randint(0, out.shape[1], (p.batch_size,), generator=g)
    return model.to(device), x.to(device), y.to(device), p.loss


@contextlib.contextmanager
def math_kernels(recurrent: bool):
    """The math attention kernel, no mkldnn recurrent kernels and, for a ``recurrent`` model,
    no cuDNN (none of these fused kernels has forward-mode rules)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mkldnn, cudnn = torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled
    torch.backends.mkldnn.enabled = False
    torch.backends.cudnn.enabled = cudnn and not recurrent
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled = mkldnn, cudnn


def engine_options(engine: str) -> Dict[str, object]:
    """SGN's arguments for a benchmark's engine name (``graphs``: the layer-wise engine with CUDA
    graphs; ``traced_graphs``, ``traced_compiled``; else the engine itself)."""
    if engine == "graphs":
        return {"engine": "layerwise", "cuda_graphs": True}
    if engine == "traced_graphs":
        return {"engine": "traced", "cuda_graphs": True}
    if engine == "traced_compiled":
        return {"engine": "traced", "compile": True}
    return {"engine": engine}
