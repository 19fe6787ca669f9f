"""DeepXDE's networks on the forward-jet path: ``PFNN`` (DeepXDE's and PINNacle's) and networks
with a feature transform (periodic, Fourier, polar features).

References, all in float64: nested autograd (``torch.autograd.grad(create_graph=True)``) of the
network's own forward for the jets; ``torch.func.jacrev`` of the residuals for the layers'
factors' ``J J^T`` and ``J^T u``.
"""

import numpy as np
import pytest
import torch
from deepxde_support import import_deepxde
from torch import nn

dde = import_deepxde()

import torch_sgn.deepxde  # noqa: E402
from torch_sgn.deepxde.derivatives import chain_of, network_jet  # noqa: E402
from torch_sgn.model.flat_model import FunctionalModel  # noqa: E402
from torch_sgn.pinn import InputMap, derivative, hessian_jet  # noqa: E402

D = torch.float64
PI = np.pi


#: every test here in DeepXDE's float64 (conftest's ``dde_float64``)
pytestmark = pytest.mark.usefixtures("dde_float64")


class PFNN(dde.nn.NN):
    """PINNacle's parallel network (``src/model/fnn.py``, MIT licensed), as its ``HeatInv``
    builds it: the branches read the input times their ``split_mask`` rows, and never rejoin."""

    def __init__(self, layer_sizes, activation, split_mask):
        super().__init__()
        self.activation = {"tanh": torch.tanh, "sin": torch.sin}[activation]
        self.split_mask = torch.as_tensor(split_mask)
        n_output = layer_sizes[-1]
        self.layers = nn.ModuleList()
        for prev, curr in zip(layer_sizes[:-2], layer_sizes[1:-1]):
            if isinstance(curr, list):
                ins = prev if isinstance(prev, list) else [prev] * n_output
                self.layers.append(nn.ModuleList(nn.Linear(a, b) for a, b in zip(ins, curr)))
            else:
                self.layers.append(nn.Linear(prev, curr))
        self.layers.append(nn.ModuleList(nn.Linear(w, 1) for w in layer_sizes[-2]))

    def forward(self, inputs):
        x = inputs
        if self._input_transform is not None:
            x = self._input_transform(x)
        for layer in self.layers[:-1]:
            if isinstance(layer, nn.ModuleList):
                if isinstance(x, list):
                    x = [self.activation(f(x_)) for f, x_ in zip(layer, x)]
                else:
                    x = [self.activation(f(x * self.split_mask[i])) for i, f in enumerate(layer)]
            else:
                x = self.activation(layer(x))
        x = torch.cat([f(x_) for f, x_ in zip(self.layers[-1], x)], dim=1)
        if self._output_transform is not None:
            x = self._output_transform(inputs, x)
        return x


class FNN(dde.nn.NN):
    """PINNacle's fully connected network (``src/model/fnn.py``): one activation, a torch
    function (``torch.tanh``) rather than DeepXDE's."""

    def __init__(self, layer_sizes):
        super().__init__()
        self.activation = torch.tanh
        self.linears = nn.ModuleList(nn.Linear(a, b) for a, b in zip(layer_sizes, layer_sizes[1:]))

    def forward(self, inputs):
        x = inputs
        if self._input_transform is not None:
            x = self._input_transform(x)
        for linear in self.linears[:-1]:
            x = self.activation(linear(x))
        x = self.linears[-1](x)
        if self._output_transform is not None:
            x = self._output_transform(inputs, x)
        return x


def _periodic(x):  # DeepXDE's periodic features
    return torch.cat([torch.cos(PI * x), torch.sin(PI * x)], 1)


_B = torch.randn(2, 5, generator=torch.Generator().manual_seed(3), dtype=D) * 2


def _fourier(x):  # random Fourier features [cos Bx, sin Bx] with a fixed B
    z = x @ _B
    return torch.cat([torch.cos(z), torch.sin(z)], 1)


def _polar(x):  # DeepXDE's Laplace_disk: (r, theta) -> (r sin theta, r cos theta)
    return torch.cat([x[:, :1] * torch.sin(x[:, 1:]), x[:, :1] * torch.cos(x[:, 1:])], 1)


def _with_features(net, transform):
    net.apply_feature_transform(transform)
    return net


def _with_output(net):
    net.apply_output_transform(lambda x, y: x[:, :1] * (1 - x[:, :1]) * y + x[:, 1:] ** 2)
    return net


def _fnn(sizes, act="tanh"):
    return dde.nn.FNN(sizes, act, "Glorot normal")


def _pfnn(sizes, act="tanh"):
    return dde.nn.PFNN(sizes, act, "Glorot normal")


#: name -> (network builder, input dimension). One table for every test below.
CASES = {
    "fnn-periodic": (lambda: _with_features(_fnn([4, 8, 8, 1]), _periodic), 2),
    "fnn-fourier": (lambda: _with_features(_fnn([10, 8, 8, 1], "sin"), _fourier), 2),
    "fnn-polar": (lambda: _with_features(_fnn([2, 8, 8, 1]), _polar), 2),
    "fnn-features-output": (
        lambda: _with_output(_with_features(_fnn([4, 8, 8, 1]), _periodic)),
        2,
    ),
    "pfnn-split": (lambda: _pfnn([2, 8, [6, 5], [5, 4], 2]), 2),
    "pfnn-parallel": (lambda: _pfnn([2, [6, 6], [5, 5], 2], "sin"), 2),
    "pfnn-rejoin": (lambda: _pfnn([2, [5, 4], 7, [3, 4], [1, 2]]), 2),
    "pfnn-features": (lambda: _with_features(_pfnn([4, [6, 6], [5, 5], 2]), _periodic), 2),
    "pinnacle-fnn-fourier": (lambda: _with_features(FNN([10, 8, 8, 2]), _fourier), 2),
    "pinnacle-pfnn-masked": (
        lambda: PFNN([3, [6, 6], [5, 5], 2], "tanh", np.array([[[1, 1, 1]], [[1, 1, 0]]])),
        3,
    ),
}


def _net(case):
    """The case's network in float64, its biases drawn (DeepXDE starts them at zero, where a
    bias taken by a derivative would go unseen)."""
    build, d = CASES[case]
    net = build().to(D)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, nn.Linear):
                module.bias.copy_(torch.rand(module.bias.shape, generator=g, dtype=D) - 0.5)
    return net, d


def _points(n, d, seed=0):
    return torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=D) * 0.9 + 0.05


def _nested(net, x):
    """Value, gradient ``(N, m, d)`` and Hessian ``(N, m, d, d)`` by nested autograd."""
    x = x.clone().requires_grad_(True)
    u = net(x)
    m, d = u.shape[1], x.shape[1]
    grads = [torch.autograd.grad(u[:, c].sum(), x, create_graph=True)[0] for c in range(m)]
    hess = [
        torch.stack(
            [torch.autograd.grad(g[:, k].sum(), x, retain_graph=True)[0] for k in range(d)], 1
        )
        for g in grads
    ]
    return u.detach(), torch.stack(grads, 1).detach(), torch.stack(hess, 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_jet_is_nested_autograds(case):
    net, d = _net(case)
    chain = chain_of(net)
    assert chain is not None  # the forward path
    x = _points(9, d)
    value, grad, hess = _nested(net, x)
    pairs = [(k, j) for k in range(d) for j in range(k, d)]
    ours = network_jet(net, chain, x, pairs)
    torch.testing.assert_close(ours.value, value, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.gradient, grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.hessian, hess, rtol=0, atol=1e-12)
    # only the pairs asked for: the others hold zeros, the ones asked are the same
    few = network_jet(net, chain, x, [(0, 1)])
    torch.testing.assert_close(few.hessian[..., 0, 1], hess[..., 0, 1], rtol=0, atol=1e-12)
    if net._output_transform is None:  # (one transforms the Taylor polynomial whole)
        assert not few.hessian[..., 0, 0].any()
    # value and gradient alone (no pairs: DeepXDE's Neumann and periodic conditions)
    first = network_jet(net, chain, x, [])
    torch.testing.assert_close(first.gradient, grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "case", ["fnn-periodic", "fnn-polar", "pfnn-rejoin", "pinnacle-pfnn-masked"]
)
@pytest.mark.parametrize("order", [3, 4])
def test_derivatives_of_order_three_and_four_are_nested_autograds(case, order):
    net, d = _net(case)
    chain = chain_of(net)
    x = _points(6, d, seed=1).requires_grad_(True)
    u = net(x)
    for dim in range(d):
        for c in range(u.shape[1]):
            t = u[:, c]
            for _ in range(order):
                t = torch.autograd.grad(t.sum(), x, create_graph=True)[0][:, dim]
            ours = derivative(chain, x.detach(), dim, order, method="forward")[:, c]
            torch.testing.assert_close(ours, t.detach(), rtol=0, atol=1e-11)


def _model(net, d, m):
    """A nonlinear PDE with mixed second partials on every output component, and a Dirichlet
    condition on each component."""

    def pde(x, y):
        out = []
        for c in range(m):
            u_xx = dde.grad.hessian(y, x, component=c, i=0, j=0)
            u_xy = dde.grad.hessian(y, x, component=c, i=0, j=1)
            u_y = dde.grad.jacobian(y, x, i=c, j=1)
            out.append(u_xx + 0.5 * u_xy + y[:, c : c + 1] * u_y - torch.sin(PI * x[:, :1]))
        return out

    geom = dde.geometry.Hypercube([0] * d, [1] * d)
    bcs = [dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on, component=c) for c in range(m)]
    data = dde.data.PDE(geom, pde, bcs, num_domain=24, num_boundary=10)
    return dde.Model(data, net)


def _compiled(case):
    net, d = _net(case)
    m = net(_points(1, d)).shape[1]
    model = _model(net, d, m)
    opt = torch_sgn.deepxde.SGN(model)
    model.compile(opt)
    model.train_state.set_data_train(*model.data.train_next_batch())
    return model, opt


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_layer_factors_give_the_residuals_jacobian(case):
    model, opt = _compiled(case)
    residuals = opt.problem.residuals
    assert opt.problem.network.chain is not None
    fmodel = FunctionalModel(residuals)
    inputs, _ = residuals.batch()
    flat = fmodel.flat()
    factors = residuals.layer_factors(fmodel, flat, inputs)
    assert factors is not None  # checked against a few rows of J, and followed

    def rows(theta):
        return torch.func.functional_call(residuals, fmodel.unflatten(theta), tuple(inputs))

    J = torch.func.jacrev(rows)(flat).reshape(-1, flat.numel())
    assert J.shape[0] == factors.rows
    torch.testing.assert_close(factors.kernel(), J @ J.T, rtol=1e-10, atol=1e-12)
    u = torch.randn(J.shape[0], dtype=D, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(factors.vjp(u), J.T @ u, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_model_with_the_network_trains(case):
    model, opt = _compiled(case)
    residuals = opt.problem.residuals
    inputs, targets = residuals.batch()
    with torch.no_grad():
        before = float(residuals.loss(residuals(*inputs), targets))
    model.train(iterations=4, verbose=0)
    assert opt.last_info.loss_after < 0.9 * before
    assert residuals.factors_follow  # the exact steps took the layers' factors


def test_networks_off_the_path_say_so():
    assert chain_of(_fnn([2, 8, 1], "relu")) is None
    assert chain_of(_fnn([2, 8, 1], "LAAF-5 tanh")) is None
    deeponet = dde.nn.DeepONet([5, 8, 8], [2, 8, 8], "tanh", "Glorot normal")
    assert chain_of(deeponet) is None


def test_an_input_map_reads_the_points_and_comes_first():
    x = _points(5, 2)
    late = nn.Sequential(nn.Linear(2, 2), InputMap(_periodic), nn.Linear(4, 1)).to(D)
    with pytest.raises(ValueError, match="must come first"):
        hessian_jet(late, x, method="forward")
    # auto: the torch.func fallback, still exact
    value, grad, hess = _nested(late, x)
    torch.testing.assert_close(hessian_jet(late, x).hessian, hess, rtol=0, atol=1e-12)
