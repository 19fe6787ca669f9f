import math

import pytest
import torch
from torch import nn

from torch_sgn.experiments.models import PRESETS, initialize, mlp, preset, vgg


def _linear(i, o):
    return i * o + o


def _conv(cin, cout, k):
    return cin * cout * k * k + cout


# name -> (parameter count from the layer sizes, input shape, output size, loss, batch size)
CASES = {
    "boston": (_linear(13, 100) + _linear(100, 100) + _linear(100, 1), (13,), 1, "mse", 101),
    "sine": (_linear(1, 20) + 2 * _linear(20, 20) + _linear(20, 1), (1,), 1, "mse", 1000),
    "mnist": (
        _linear(784, 20) + 2 * _linear(20, 20) + _linear(20, 10),
        (1, 28, 28),
        10,
        "cross_entropy",
        1000,
    ),
    # 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4
    "fashion_mnist": (
        _conv(1, 6, 5)
        + _conv(6, 16, 5)
        + _linear(16 * 4 * 4, 120)
        + _linear(120, 84)
        + _linear(84, 10),
        (1, 28, 28),
        10,
        "cross_entropy",
        1000,
    ),
    # 32 -conv3-> 30 -pool-> 15 -conv3-> 13 -pool-> 6 -conv3-> 4
    "cifar10": (
        _conv(3, 32, 3)
        + _conv(32, 64, 3)
        + _conv(64, 64, 3)
        + _linear(64 * 4 * 4, 64)
        + _linear(64, 10),
        (3, 32, 32),
        10,
        "cross_entropy",
        1000,
    ),
}
MLPS = ["boston", "sine", "mnist"]
CONVNETS = ["fashion_mnist", "cifar10"]


def _weighted(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def test_presets_are_the_papers_five():
    assert set(PRESETS) == set(CASES)


@pytest.mark.parametrize("name", CASES)
def test_preset_parameter_count_and_output_shape(name):
    count, in_shape, out, _, _ = CASES[name]
    model = preset(name)
    assert sum(p.numel() for p in model.parameters()) == count
    assert model(torch.zeros(3, *in_shape)).shape == (3, out)
    assert PRESETS[name].input_shape == in_shape


@pytest.mark.parametrize("name", CASES)
def test_preset_training_setup(name):
    _, _, _, loss, batch_size = CASES[name]
    p = PRESETS[name]
    assert (p.loss, p.batch_size, p.dataset) == (loss, batch_size, name)
    assert p.init_seed == (10 if name in MLPS else 1)


def test_activations_and_architecture_of_the_convnets():
    lenet = preset("fashion_mnist")
    convs = [m for m in lenet if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (6, (5, 5), (1, 1), (0, 0)),
        (16, (5, 5), (1, 1), (0, 0)),
    ]
    pools = [m for m in lenet if isinstance(m, nn.MaxPool2d)]
    assert [(p.kernel_size, p.stride) for p in pools] == [(2, 2), (2, 2)]
    assert sum(isinstance(m, nn.ReLU) for m in lenet) == 4  # 2 conv + 2 hidden fc
    assert isinstance(lenet[-1], nn.Linear)  # logits, no activation

    cifar = preset("cifar10")
    types = [type(m) for m in cifar]
    assert types[:8] == [
        nn.Conv2d,
        nn.ReLU,
        nn.MaxPool2d,
        nn.Conv2d,
        nn.ReLU,
        nn.MaxPool2d,
        nn.Conv2d,
        nn.ReLU,
    ]
    assert types[8:] == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear]


@pytest.mark.parametrize("name", MLPS)
def test_mlp_presets_are_sigmoid(name):
    model = preset(name)
    acts = [m for m in model if not isinstance(m, (nn.Linear, nn.Flatten))]
    assert acts and all(isinstance(m, nn.Sigmoid) for m in acts)
    assert len(acts) == len(_weighted(model)) - 1


@pytest.mark.parametrize("name", MLPS)
def test_paper_init_of_mlps_is_unscaled_standard_normal(name):
    model = preset(name)
    weights = torch.cat([m.weight.flatten() for m in _weighted(model)])
    n = weights.numel()
    # Sample mean and std of n standard normals: errors ~ 1/sqrt(n) and 1/sqrt(2n).
    assert abs(weights.mean().item()) < 5 / math.sqrt(n)
    assert abs(weights.std().item() - 1) < 5 / math.sqrt(2 * n)
    for m in _weighted(model):
        assert torch.count_nonzero(m.bias) == 0
        if m.weight.numel() >= 1000:  # also per layer: no fan-in scaling anywhere
            assert abs(m.weight.std().item() - 1) < 5 / math.sqrt(2 * m.weight.numel())


@pytest.mark.parametrize("name", CONVNETS)
def test_paper_init_of_convnets_is_xavier_uniform(name):
    for m in _weighted(preset(name)):
        w = m.weight
        fan_in = w.shape[1] * w[0, 0].numel()
        fan_out = w.shape[0] * w[0, 0].numel()
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert w.abs().max() <= bound
        # U(-b, b) has variance b^2 / 3; the sample variance's relative error ~ 1/sqrt(n).
        assert abs(w.var().item() / (bound**2 / 3) - 1) < 6 / math.sqrt(w.numel())
        assert torch.count_nonzero(m.bias) == 0


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("init", ["paper", "torch"])
def test_init_is_seeded_and_leaves_global_rng_alone(name, init):
    state = torch.get_rng_state()
    a, b = preset(name, init), preset(name, init)
    c = preset(name, init, seed=PRESETS[name].init_seed + 1)
    assert torch.equal(torch.get_rng_state(), state)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_torch_init_is_pytorch_default_scale():
    model = preset("boston", init="torch")
    hidden = model[2]  # Linear(100, 100): U(-1/sqrt(100), 1/sqrt(100)), not N(0, 1)
    assert hidden.weight.abs().max() <= 0.1
    assert torch.count_nonzero(hidden.bias) > 0
    # The same as constructing the module from the seeded global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10)
        reference = mlp(13, [100, 100], 1)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_initialize_rejects_unsupported_layers():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="BatchNorm1d"):
        initialize(model, "normal", 0)
    with pytest.raises(ValueError, match="scheme"):
        initialize(nn.Linear(2, 2), "orthogonal", 0)


def test_unknown_preset_and_init():
    with pytest.raises(ValueError, match="cifar10"):
        preset("imagenet")
    with pytest.raises(ValueError, match="init"):
        preset("boston", init="kaiming")


@pytest.mark.parametrize("activation, cls", [("relu", nn.ReLU), ("tanh", nn.Tanh)])
def test_mlp_builder(activation, cls):
    model = mlp(12, [5, 7], 3, activation=activation, flatten=True)
    assert isinstance(model[0], nn.Flatten)
    assert [type(m) for m in model[1:]] == [nn.Linear, cls, nn.Linear, cls, nn.Linear]
    assert model(torch.zeros(2, 3, 2, 2)).shape == (2, 3)
    assert [m.out_features for m in _weighted(model)] == [5, 7, 3]
    with pytest.raises(ValueError, match="activation"):
        mlp(2, [3], 1, activation="gelu")


def test_vgg_builder_shapes_and_errors():
    model = vgg((2, 10, 12), [4, "M", 8], [6], 5, activation="tanh", kernel_size=3)
    # 10x12 -conv3-> 8x10 -pool-> 4x5 -conv3-> 2x3
    assert model[-3].in_features == 8 * 2 * 3
    assert model(torch.zeros(2, 2, 10, 12)).shape == (2, 5)
    with pytest.raises(ValueError, match="conv\\[1\\]"):
        vgg((1, 8, 8), [4, "X"], [], 2)
    with pytest.raises(ValueError, match="shrinks"):
        vgg((1, 8, 8), [4, "M", 4, "M", 4], [], 2, kernel_size=3)
