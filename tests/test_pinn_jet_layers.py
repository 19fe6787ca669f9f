"""torch_sgn.pinn's ParallelLinear and InputMap in networks written by hand: the operators
against nested autograd, and the layers' factors against the dense Jacobian, in float64."""

import pytest
import torch
from torch import nn
from torch.autograd.functional import jacobian

from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.pinn import (
    InputMap,
    ParallelLinear,
    Residual,
    Residuals,
    derivative,
    jet,
    laplacian,
)

D = torch.float64


def _features(x):  # a point's periodic features and its radius squared
    return torch.cat([torch.cos(3 * x), torch.sin(3 * x), (x * x).sum(1, keepdim=True)], 1)


def _net(masked: bool = False):
    """InputMap -> shared layer -> two branches (each reading all 6 columns, masked or not)
    -> two branches (each its own 5 columns) -> one output per branch."""
    g = torch.Generator().manual_seed(0)

    def linear(a, b):
        layer = nn.Linear(a, b).to(D)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(b, a, generator=g, dtype=D) / a**0.5)
            layer.bias.copy_(torch.rand(b, generator=g, dtype=D) - 0.5)
        return layer

    mask = [torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=D), None] if masked else None
    return nn.Sequential(
        InputMap(_features),
        linear(5, 6),
        nn.Tanh(),
        ParallelLinear([linear(6, 5), linear(6, 5)], [(0, 6), (0, 6)], mask),
        nn.Tanh(),
        ParallelLinear([linear(5, 4), linear(5, 3)], [(0, 5), (5, 10)]),
        nn.Tanh(),
        ParallelLinear([linear(4, 1), linear(3, 1)], [(0, 4), (4, 7)]),
    )


def _points(n, seed=1):
    return torch.rand(n, 2, generator=torch.Generator().manual_seed(seed), dtype=D)


def _forward(net, x):
    """The network's value written out layer by layer (ParallelLinear's branches as plain
    ``nn.Linear`` calls on their masked columns), apart from the code the jets run."""
    for layer in net:
        if isinstance(layer, ParallelLinear):
            outs = []
            for linear, (a, b), scale in zip(layer.linears, layer.inputs, layer.scales):
                cols = x[:, a:b] if scale is None else x[:, a:b] * scale
                outs.append(linear(cols))
            x = torch.cat(outs, 1)
        elif isinstance(layer, InputMap):
            x = _features(x)
        else:
            x = layer(x)
    return x


def _reference(net, x):
    """The value, gradient and Laplacian by nested autograd of :func:`_forward`."""
    x = x.clone().requires_grad_(True)
    u = _forward(net, x)
    grads, laps = [], []
    for c in range(u.shape[1]):
        g = torch.autograd.grad(u[:, c].sum(), x, create_graph=True)[0]
        lap = sum(
            torch.autograd.grad(g[:, k].sum(), x, retain_graph=True)[0][:, k]
            for k in range(x.shape[1])
        )
        grads.append(g.detach())
        laps.append(lap)
    return u.detach(), torch.stack(grads, 1), torch.stack(laps, 1)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_the_forward_jet_is_nested_autograds(masked):
    net = _net(masked)
    x = _points(11)
    value, grad, lap = _reference(net, x)
    ours = jet(net, x, method="forward")
    torch.testing.assert_close(ours.value, value, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.gradient, grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.laplacian, lap, rtol=0, atol=1e-12)
    torch.testing.assert_close(net(x), value, rtol=0, atol=1e-14)  # the layers' own forward
    # a partial Laplacian (one coordinate) and order 3 along it
    x1 = x.clone().requires_grad_(True)
    t = _forward(net, x1)[:, 1]
    for order in range(1, 4):
        t = torch.autograd.grad(t.sum(), x1, create_graph=True)[0][:, 1]
        if order == 2:
            part = laplacian(net, x, dims=[1], method="forward")[:, 1]
            torch.testing.assert_close(part, t.detach(), rtol=0, atol=1e-12)
    ours3 = derivative(net, x, dim=1, order=3, method="forward")[:, 1]
    torch.testing.assert_close(ours3, t.detach(), rtol=0, atol=1e-11)


def test_the_layer_factors_follow_them():
    net = _net(masked=True)

    def pde(u, x):
        j = jet(u, x)
        return -j.laplacian[:, :1] + j.value[:, 1:] * j.gradient[:, 0, :1] - 1

    problem = Residuals(
        net,
        {
            "pde": Residual(pde, _points(30, 2)),
            "values": Residual(lambda u, x: u(x), _points(8, 3)),
        },
    )
    fmodel = FunctionalModel(problem)
    inputs, _ = problem.batch()
    flat = fmodel.flat()
    factors = problem.layer_factors(fmodel, flat, inputs)
    assert factors is not None

    def rows(theta):
        return torch.func.functional_call(problem, fmodel.unflatten(theta), tuple(inputs))

    J = jacobian(rows, flat).reshape(-1, flat.numel())
    torch.testing.assert_close(factors.kernel(), J @ J.T, rtol=1e-10, atol=1e-12)
    u = torch.randn(J.shape[0], generator=torch.Generator().manual_seed(0), dtype=D)
    torch.testing.assert_close(factors.vjp(u), J.T @ u, rtol=1e-10, atol=1e-12)
    v = torch.randn(J.shape[1], generator=torch.Generator().manual_seed(1), dtype=D)
    torch.testing.assert_close(factors.jvp(v), J @ v, rtol=1e-10, atol=1e-12)


def test_a_branch_must_read_its_width():
    with pytest.raises(ValueError, match="in_features"):
        ParallelLinear([nn.Linear(3, 2)], [(0, 4)])
