"""J J^T and J^T u of physics-informed residuals from the layers' factors
(torch_sgn.pinn.layer_kernel), against a dense float64 Jacobian built by autograd."""

import copy

import pytest
import torch
from torch import nn
from torch.autograd.functional import jacobian

from torch_sgn import SGN
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.pinn import Residual, Residuals, gradient, laplacian, layer_kernel, time_derivative

D = torch.float64


def _mlp(widths, seed=0, act=nn.Tanh):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(act())
    return nn.Sequential(*layers).to(D)


def _points(n, d, seed, dtype=D):
    return torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=D).to(dtype)


def _poisson(net, dtype=D):
    return {
        "interior": Residual(
            lambda u, x: -laplacian(u, x) - x.sum(1, keepdim=True), _points(30, 2, 1, dtype)
        ),
        "boundary": Residual(lambda u, x: u(x), _points(7, 2, 2, dtype), weight=3.0),
    }


def _heat(net, dtype=D):
    return {
        "pde": Residual(
            lambda u, x: time_derivative(u, x, 0) - 0.25 * laplacian(u, x, dims=[1]),
            _points(25, 2, 3, dtype),
        ),
        "initial": Residual(lambda u, x: u(x) - torch.sin(x[:, 1:]), _points(6, 2, 4, dtype)),
    }


def _gradient_and_two_outputs(net, dtype=D):
    # a vector field u: R^2 -> R^2, residuals with two components per point
    return {
        "curl": Residual(lambda u, x: gradient(u, x)[:, 0, :] - x, _points(20, 2, 5, dtype)),
        "values": Residual(lambda u, x: u(x), _points(5, 2, 6, dtype)),
    }


# Narrow layers take J's rows (sum_c Delta_c (x) A_c); wide ones the channel-pair kernel
# sum_cc' (Delta_c Delta_c'^T) o (A_c A_c'^T): both are covered.
CASES = {
    "poisson": (lambda: _mlp([2, 8, 6, 1]), _poisson),
    "heat": (lambda: _mlp([2, 7, 7, 1], act=nn.Softplus), _heat),
    "two-outputs": (lambda: _mlp([2, 6, 2]), _gradient_and_two_outputs),
    "poisson-wide": (lambda: _mlp([2, 64, 64, 1]), _poisson),
    "heat-wide": (lambda: _mlp([2, 40, 40, 1], act=nn.Softplus), _heat),
    "two-outputs-wide": (lambda: _mlp([2, 48, 48, 2]), _gradient_and_two_outputs),
}


def _dense_jacobian(problem: Residuals, fmodel: FunctionalModel, inputs):
    flat = fmodel.flat()

    def residuals(theta):
        return torch.func.functional_call(problem, fmodel.unflatten(theta), tuple(inputs))

    return jacobian(residuals, flat).reshape(-1, flat.numel())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_kernel_and_vjp_match_a_dense_jacobian(monkeypatch, case, frozen, tiled):
    """Untiled, and by tiles of 7 points (blocks of 5 to 30 points: several tiles, a part tile
    at each block's end, tiles across two blocks)."""
    if tiled:
        monkeypatch.setattr(layer_kernel, "TILED_ABOVE", 4)
        monkeypatch.setattr(layer_kernel, "TILE", 7)
    build, blocks = CASES[case]
    net = build()
    if frozen:
        net[0].bias.requires_grad_(False)
    problem = Residuals(net, blocks(net))
    fmodel = FunctionalModel(problem)
    inputs, _ = problem.batch()
    factors = problem.layer_factors(fmodel, fmodel.flat(), inputs)
    assert factors is not None
    J = _dense_jacobian(problem, fmodel, inputs)
    K = factors.kernel()
    torch.testing.assert_close(K, J @ J.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(K, K.T, rtol=1e-12, atol=1e-14)  # symmetric up to rounding
    if tiled:  # each block's own part exactly symmetric
        start = 0
        for n in [b.n * b.m for b in factors.blocks]:
            own = K[start : start + n, start : start + n]
            assert torch.equal(own, own.T)
            start += n
    assert torch.linalg.eigvalsh(K).min() > -1e-10 * K.abs().max()  # PSD
    # symmetric=True: exactly symmetric, and to the bit the symmetric part of the kernel
    sym = factors.kernel(symmetric=True)
    assert torch.equal(sym, sym.T) and torch.equal(sym, (K + K.T).mul_(0.5))
    u = torch.randn(J.shape[0], dtype=D)
    torch.testing.assert_close(factors.vjp(u), J.T @ u, rtol=1e-10, atol=1e-12)
    v = torch.randn(J.shape[1], dtype=D)
    torch.testing.assert_close(factors.jvp(v), J @ v, rtol=1e-10, atol=1e-12)


def _sgn_steps(problem, steps=4, **kwargs):
    opt = SGN(problem, problem.loss, **kwargs)
    losses = []
    for t in range(steps):
        inputs, targets = problem.batch(t)
        losses.append(opt.step(inputs, targets).loss_after)
    return losses, torch.cat([p.detach().reshape(-1) for p in problem.parameters()])


@pytest.mark.parametrize("options", [{}, {"weight_decay": 1e-3}], ids=["plain", "weight-decay"])
def test_sgn_steps_equal_those_through_the_rows_of_J(monkeypatch, options):
    net = _mlp([2, 8, 6, 1])
    problem = Residuals(net, _poisson(net))
    twin = copy.deepcopy(problem)
    calls = []
    real = Residuals.layer_factors

    def counted(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(Residuals, "layer_factors", counted)
    losses, theta = _sgn_steps(problem, **options)
    assert calls and all(calls)  # the factors were used at every step
    monkeypatch.setattr(Residuals, "layer_factors", lambda self, *args: None)
    twin_losses, twin_theta = _sgn_steps(twin, **options)
    torch.testing.assert_close(theta, twin_theta, rtol=1e-8, atol=1e-10)
    assert losses[-1] < losses[0]


class _Scaled(nn.Module):
    """A network with a parameter outside any linear layer."""

    def __init__(self):
        super().__init__()
        self.body = _mlp([2, 5, 1])
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=D))

    def forward(self, x):
        return self.scale * self.body(x)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Residuals(_Scaled(), {"fit": Residual(lambda u, x: u(x) - 1, _points(9, 2, 0))}),
        # derivatives by torch.func (not the forward Laplacian): the layers run inside vmap
        lambda: (
            lambda net: Residuals(
                net,
                {"pde": Residual(lambda u, x: laplacian(u, x, method="func"), _points(9, 2, 0))},
            )
        )(_mlp([2, 5, 1])),
        # a layer's weight used directly by the residual, besides the network's forward
        lambda: (
            lambda net: Residuals(
                net,
                {"fit": Residual(lambda u, x: u(x) + x @ net[0].weight.T[:, :1], _points(9, 2, 0))},
            )
        )(_mlp([2, 5, 1])),
    ],
    ids=["parameter-outside-layers", "torch-func-derivatives", "weight-used-directly"],
)
def test_networks_the_factors_cannot_follow_fall_back_to_rows(make):
    problem = make()
    fmodel = FunctionalModel(problem)
    inputs, _ = problem.batch()
    assert problem.layer_factors(fmodel, fmodel.flat(), inputs) is None
    losses, _ = _sgn_steps(problem, steps=3)  # the exact steps go on through J's rows
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("case", ["poisson-wide", "heat-wide", "two-outputs-wide"])
def test_float32_networks_take_the_factors(case):
    """A float32 network's factors pass the check (the rows and the factors round apart by
    about a tenth of float32's epsilon) and give J J^T and J^T u of the float64 Jacobian of the
    same network to float32's accuracy; float64 keeps its tolerance of 1e-8."""
    build, blocks = CASES[case]
    net = build()
    problem = Residuals(net, blocks(net))  # float64 network and points: the reference
    net32 = copy.deepcopy(net).to(torch.float32)
    narrow = Residuals(net32, blocks(net32, torch.float32))
    fmodel = FunctionalModel(narrow)
    inputs, _ = narrow.batch()
    assert all(x.dtype == torch.float32 for x in inputs)
    factors = narrow.layer_factors(fmodel, fmodel.flat(), inputs)
    assert factors is not None
    wide = FunctionalModel(problem)
    J = _dense_jacobian(problem, wide, tuple(x.to(D) for x in inputs))
    K = factors.kernel()
    torch.testing.assert_close(K, J @ J.T, rtol=0, atol=1e-5 * (J @ J.T).abs().max())
    u = torch.randn(J.shape[0], dtype=D)
    want = J.T @ u
    torch.testing.assert_close(factors.vjp(u).to(D), want, rtol=0, atol=1e-5 * want.abs().max())
    assert layer_kernel.agreement(torch.float64) == 1e-8
    assert 1e-6 < layer_kernel.agreement(torch.float32) < 1e-4
