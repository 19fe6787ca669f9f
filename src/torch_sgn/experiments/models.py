"""Model builders, the five networks of the SGN paper, and networks beyond them.

The paper's builders return plain :class:`torch.nn.Sequential` objects. Beyond the paper, a
ResNet with batch norm (:class:`ResNetBN`), a causal pre-norm transformer
(:class:`CausalTransformer`) and an LSTM language model (:class:`LSTMModel`) are what the
cost benchmark and the examples train: models the layer-wise engine does not take.

:data:`PRESETS` describes the networks exactly as they were run for the paper, together
with the data set, loss and mini-batch size each was trained with; :func:`preset` builds
one with the paper's initialisation.

References:
    Gargiani, Zanelli, Diehl, Hutter. "On the Promise of the Stochastic Generalized
    Gauss-Newton Method for Training DNNs", 2020.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESETS",
    "CausalTransformer",
    "LSTMModel",
    "Preset",
    "ResNetBN",
    "initialize",
    "mlp",
    "preset",
    "vgg",
]

Activation = Literal["sigmoid", "relu", "tanh"]
InitScheme = Literal["normal", "xavier_uniform", "torch"]
ConvSpec = Union[int, Literal["M"]]

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "sigmoid": nn.Sigmoid,
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
}


def _activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}"
        ) from None


def mlp(
    in_features: int,
    hidden: Sequence[int],
    out_features: int,
    activation: Activation = "sigmoid",
    flatten: bool = False,
) -> nn.Sequential:
    """A fully connected network with an activation after every hidden layer.

    The output layer is linear (no activation): the loss applies softmax or the identity.

    Args:
        in_features: Size of one input example (after flattening).
        hidden: Widths of the hidden layers, e.g. ``(100, 100)``.
        out_features: Size of the output.
        activation: ``"sigmoid"``, ``"relu"`` or ``"tanh"``.
        flatten: Prepend :class:`~torch.nn.Flatten`, so that images of shape
            ``(N, C, H, W)`` with ``C * H * W == in_features`` can be fed directly.

    Returns:
        ``[Flatten] -> Linear -> act -> ... -> Linear``.
    """
    _activation(activation)  # validate before building anything
    layers: list[nn.Module] = [nn.Flatten()] if flatten else []
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), _activation(activation)]
        width = h
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


def vgg(
    in_shape: tuple[int, int, int],
    conv: Sequence[ConvSpec],
    fc: Sequence[int],
    num_classes: int,
    activation: Activation = "relu",
    kernel_size: int = 3,
) -> nn.Sequential:
    """A VGG-style network: a convolution/pooling stack followed by a fully connected head.

    The convolution stack is described by ``conv``, read left to right:

    * an ``int`` ``c`` adds ``Conv2d(_, c, kernel_size)`` followed by the activation;
    * the string ``"M"`` adds ``MaxPool2d(2, stride=2)``.

    All convolutions have stride 1 and no padding, as in the paper, so each shrinks the
    spatial size by ``kernel_size - 1``; each pooling halves it (rounding down). The
    feature map is then flattened and passed through ``Linear -> act`` for every width in
    ``fc`` and a final linear layer with ``num_classes`` outputs.

    Example:
        LeNet of the paper's Fashion-MNIST runs::

            vgg((1, 28, 28), [6, "M", 16, "M"], [120, 84], 10, kernel_size=5)

    Args:
        in_shape: Shape ``(C, H, W)`` of one input image.
        conv: The convolution stack, as above.
        fc: Widths of the hidden fully connected layers.
        num_classes: Number of outputs.
        activation: ``"sigmoid"``, ``"relu"`` or ``"tanh"``.
        kernel_size: Side of every (square) convolution kernel.

    Returns:
        The network as an :class:`~torch.nn.Sequential`.

    Raises:
        ValueError: For an unknown spec entry or when the feature map shrinks to nothing.
    """
    _activation(activation)
    channels, height, width = in_shape
    layers: list[nn.Module] = []
    for i, spec in enumerate(conv):
        if spec == "M":
            layers.append(nn.MaxPool2d(2, stride=2))
            height, width = height // 2, width // 2
        elif isinstance(spec, int) and not isinstance(spec, bool) and spec > 0:
            layers += [nn.Conv2d(channels, spec, kernel_size), _activation(activation)]
            channels = spec
            height, width = height - kernel_size + 1, width - kernel_size + 1
        else:
            raise ValueError(f"conv[{i}] = {spec!r}: expected a positive number of filters or 'M'")
        if height < 1 or width < 1:
            raise ValueError(
                f"input of shape {tuple(in_shape)} shrinks to nothing at conv[{i}] = {spec!r}"
            )
    layers.append(nn.Flatten())
    layers += list(mlp(channels * height * width, fc, num_classes, activation))
    return nn.Sequential(*layers)


def _is_supported_layer(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.modules.conv._ConvNd))


def initialize(model: nn.Module, scheme: InitScheme, seed: int) -> nn.Module:
    """Re-initialise ``model`` in place, reproducibly and without touching the global RNG.

    Schemes:

    * ``"normal"``: weights of every linear/convolution layer drawn from N(0, 1) (standard
      deviation exactly 1, *not* scaled by the fan-in), biases 0. The paper's MLPs.
    * ``"xavier_uniform"``: weights from :func:`torch.nn.init.xavier_uniform_`, biases 0.
      The paper's convolutional networks.
    * ``"torch"``: each module's own ``reset_parameters()`` (PyTorch's default init).

    Layers are initialised in ``model.modules()`` order from one generator seeded with
    ``seed``: a local :class:`torch.Generator` for the first two schemes; for ``"torch"``,
    whose ``reset_parameters`` only use the global RNG, the global CPU RNG inside
    :func:`torch.random.fork_rng`, so its state is restored afterwards.

    .. note::
        The original Theano code drew its weights in another order from another RNG, so the
        paper schemes reproduce its weight *distribution*, not its exact weights.

    Args:
        model: The network; its parameters must all belong to ``nn.Linear`` or
            ``nn.Conv*d`` layers for the paper schemes.
        scheme: ``"normal"``, ``"xavier_uniform"`` or ``"torch"``.
        seed: Seed of the initialisation.

    Returns:
        ``model``, for chaining.

    Raises:
        ValueError: For an unknown scheme, or a paper scheme on a model with parameters
            outside linear/convolution layers.
    """
    if scheme == "torch":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        return model
    if scheme not in ("normal", "xavier_uniform"):
        raise ValueError(
            f"unknown init scheme {scheme!r}; expected 'normal', 'xavier_uniform' or 'torch'"
        )

    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)) and not _is_supported_layer(module):
            raise ValueError(
                f"init scheme {scheme!r} supports only Linear and Conv layers, "
                f"but module {name!r} is a {type(module).__name__} with parameters"
            )

    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for module in model.modules():
            if not _is_supported_layer(module):
                continue
            weight = module.weight
            if weight.device not in generators:
                generators[weight.device] = torch.Generator(weight.device).manual_seed(seed)
            gen = generators[weight.device]
            if scheme == "normal":
                nn.init.normal_(weight, 0.0, 1.0, generator=gen)
            else:
                nn.init.xavier_uniform_(weight, generator=gen)
            if module.bias is not None:
                module.bias.zero_()
    return model


@dataclass(frozen=True)
class Preset:
    """One of the paper's benchmark networks, with how it was trained.

    Attributes:
        name: Key in :data:`PRESETS`; also the name of the data set in
            :func:`torch_sgn.experiments.data.load`.
        architecture: Builds the uninitialised network (PyTorch default init).
        dataset: Name of the data set for :func:`torch_sgn.experiments.data.load`.
        loss: ``"mse"`` (mean squared error) or ``"cross_entropy"`` (softmax
            cross-entropy on the logits).
        batch_size: Mini-batch size of the paper's runs.
        input_shape: Shape of one input example (without the batch dimension).
        paper_init: Initialisation scheme of the paper, see :func:`initialize`.
        init_seed: The paper's fixed initialisation seed (10 for the MLPs, 1 for the
            convolutional networks); the runs' own seeds 1..5 did not change it.
        description: One line for humans.
    """

    name: str
    architecture: Callable[[], nn.Module]
    dataset: str
    loss: Literal["mse", "cross_entropy"]
    batch_size: int
    input_shape: tuple[int, ...]
    paper_init: Literal["normal", "xavier_uniform"]
    init_seed: int
    description: str

    def build(
        self, init: Literal["paper", "torch"] = "paper", seed: Optional[int] = None
    ) -> nn.Module:
        """Build the network.

        Args:
            init: ``"paper"`` for the paper's initialisation (:attr:`paper_init`),
                ``"torch"`` for PyTorch's default initialisation.
            seed: Initialisation seed; defaults to :attr:`init_seed`. Either way the
                global RNG is left untouched.

        Returns:
            A freshly initialised :class:`~torch.nn.Sequential` on the CPU, in float32.
        """
        if init not in ("paper", "torch"):
            raise ValueError(f"unknown init {init!r}; expected 'paper' or 'torch'")
        seed = self.init_seed if seed is None else seed
        # Construction runs PyTorch's default init on the global RNG: seed it in a fork.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.architecture()
        if init == "paper":
            initialize(model, self.paper_init, seed)
        return model


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="boston",
            architecture=lambda: mlp(13, [100, 100], 1, "sigmoid"),
            dataset="boston",
            loss="mse",
            batch_size=101,
            input_shape=(13,),
            paper_init="normal",
            init_seed=10,
            description="Boston housing regression: MLP 13-100-100-1, sigmoid",
        ),
        Preset(
            name="sine",
            architecture=lambda: mlp(1, [20, 20, 20], 1, "sigmoid"),
            dataset="sine",
            loss="mse",
            batch_size=1000,
            input_shape=(1,),
            paper_init="normal",
            init_seed=10,
            description="Noisy sine wave regression: MLP 1-20-20-20-1, sigmoid",
        ),
        Preset(
            name="mnist",
            architecture=lambda: mlp(784, [20, 20, 20], 10, "sigmoid", flatten=True),
            dataset="mnist",
            loss="cross_entropy",
            batch_size=1000,
            input_shape=(1, 28, 28),
            paper_init="normal",
            init_seed=10,
            description="MNIST classification: MLP 784-20-20-20-10, sigmoid",
        ),
        Preset(
            name="fashion_mnist",
            architecture=lambda: vgg(
                (1, 28, 28), [6, "M", 16, "M"], [120, 84], 10, "relu", kernel_size=5
            ),
            dataset="fashion_mnist",
            loss="cross_entropy",
            batch_size=1000,
            input_shape=(1, 28, 28),
            paper_init="xavier_uniform",
            init_seed=1,
            description="Fashion-MNIST classification: LeNet (conv 6@5x5, 16@5x5; fc 120, 84)",
        ),
        Preset(
            name="cifar10",
            architecture=lambda: vgg(
                (3, 32, 32), [32, "M", 64, "M", 64], [64], 10, "relu", kernel_size=3
            ),
            dataset="cifar10",
            loss="cross_entropy",
            batch_size=1000,
            input_shape=(3, 32, 32),
            paper_init="xavier_uniform",
            init_seed=1,
            description="CIFAR-10 classification: conv 32, 64, 64 @3x3; fc 64",
        ),
    ]
}
"""The paper's five benchmark networks, by name."""


def preset(
    name: str, init: Literal["paper", "torch"] = "paper", seed: Optional[int] = None
) -> nn.Module:
    """Build one of the paper's networks; shorthand for ``PRESETS[name].build(init, seed)``.

    Args:
        name: ``"boston"``, ``"sine"``, ``"mnist"``, ``"fashion_mnist"`` or ``"cifar10"``.
        init: ``"paper"`` (the paper's initialisation) or ``"torch"`` (PyTorch's default).
        seed: Initialisation seed; defaults to the paper's (10 for MLPs, 1 for conv nets).

    Returns:
        The network, on the CPU in float32.
    """
    try:
        p = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None
    return p.build(init, seed)


# --- networks beyond the paper's ----------------------------------------------------------------
class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a skip connection (projected by a 1x1
    convolution with batch norm where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNetBN(nn.Module):
    """A small ResNet: a 3x3 stem, ``stages`` residual blocks (the first keeps the width, each
    later one doubles it and halves the resolution), global average pooling, a linear head."""

    def __init__(self, channels: int = 3, width: int = 16, classes: int = 10, stages: int = 3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        widths = [width * 2**i for i in range(stages)]
        blocks = [ResidualBlock(width, width, 1)]
        blocks += [ResidualBlock(a, b, 2) for a, b in zip(widths, widths[1:])]
        self.stages = nn.Sequential(*blocks)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class PreNormBlock(nn.Module):
    """A pre-norm transformer block with causal scaled-dot-product attention."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        hidden = 4 * width
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x):
        n, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(n, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(n, length, width))
        return x + self.mlp(self.norm2(x))


class CausalTransformer(nn.Module):
    """A causal pre-norm transformer over token ids ``(N, L)``; returns logits ``(N, vocab, L)``
    (classes in dimension 1, as cross-entropy takes them)."""

    def __init__(self, vocab=64, width=128, layers=2, heads=4, length=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.blocks = nn.Sequential(*[PreNormBlock(width, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx) + self.position[: idx.shape[1]]
        return self.head(self.norm(self.blocks(x))).transpose(1, 2)


class LSTMModel(nn.Module):
    """An embedding, LSTM layers (one by default; ``bidirectional`` for a tagger that reads the
    whole sequence, ``dropout`` between layers; ``cell=nn.GRU`` for GRU layers instead) and a
    linear head; logits ``(N, vocab, L)``."""

    def __init__(
        self, vocab=64, width=128, layers=1, bidirectional=False, dropout=0.0, cell=nn.LSTM
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = cell(
            width, width, layers, batch_first=True, bidirectional=bidirectional, dropout=dropout
        )
        self.head = nn.Linear(width * (2 if bidirectional else 1), vocab)

    def forward(self, idx):
        return self.head(self.lstm(self.embed(idx))[0]).transpose(1, 2)
