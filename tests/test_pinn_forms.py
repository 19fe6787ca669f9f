"""Physics-informed residual models: forward takes derivatives of its inputs.

A PINN for the 2-D Poisson equation ``-(u_xx + u_yy) = f`` written as users write it: an
``nn.Module`` whose ``forward(x)`` returns the residuals, its Laplacian taken inside ``forward``
by ``torch.autograd.grad(..., create_graph=True)`` or by ``torch.func``'s transforms. Every
engine that takes it must give the Gauss-Newton matrix of ``"mse"`` against zeros exactly: the
reference ``J^T H J`` is built from ``torch.autograd.functional.jacobian`` of a residual
function written independently (``torch.func.hessian`` point by point), ``H = 2 I / n``.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacfwd, jacrev, vmap

from torch_sgn import GGN, SGN

DTYPE = torch.float64
INTERIOR, BOUNDARY = 20, 8


def _source(x: Tensor) -> Tensor:
    return 2 * math.pi**2 * torch.sin(math.pi * x[:, 0]) * torch.sin(math.pi * x[:, 1])


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


# --- Laplacians as users write them inside forward -------------------------------------------
def _by_autograd(net: nn.Module, x: Tensor) -> Tensor:
    u = net(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (dux,) = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
    (duy,) = torch.autograd.grad(du[:, 1].sum(), x, create_graph=True)
    return dux[:, 0] + duy[:, 1]


def _in_place(net, x):  # the input as given
    return _by_autograd(net, x.requires_grad_(True))


def _on_clone(net, x):
    return _by_autograd(net, x.clone().requires_grad_())


def _on_detached(net, x):
    return _by_autograd(net, x.detach().requires_grad_(True))


def _enable_grad(net, x):  # the user already turns autograd on
    with torch.enable_grad():
        return _by_autograd(net, x.detach().requires_grad_(True))


def _transformed(second):
    def laplacian(net, x):
        h = vmap(second(lambda p: net(p).squeeze(-1)))(x)
        return h[:, 0, 0] + h[:, 1, 1]

    return laplacian


def _functional_call_hessian(net, x):  # torch.func.functional_call of the submodule
    params = dict(net.named_parameters())
    h = vmap(hessian(lambda p: functional_call(net, params, (p,)).squeeze(-1)))(x)
    return h[:, 0, 0] + h[:, 1, 1]


LAPLACIANS = {
    "autograd_in_place": _in_place,
    "autograd_clone": _on_clone,
    "autograd_detach": _on_detached,
    "enable_grad": _enable_grad,
    "hessian": _transformed(hessian),
    "functional_call_hessian": _functional_call_hessian,
    "jacrev_jacrev": _transformed(lambda f: jacrev(jacrev(f))),
    "jacfwd_jacrev": _transformed(lambda f: jacfwd(jacrev(f))),
}


class Poisson(nn.Module):
    """Laplacian residuals on the first ``interior`` points; with ``interior`` less than the
    batch, ``u`` on the rest (a second residual block: the boundary values)."""

    def __init__(self, laplacian, interior: int):
        super().__init__()
        self.net, self.laplacian, self.interior = _net(), laplacian, interior

    def forward(self, x: Tensor) -> Tensor:
        inside, edge = x[: self.interior], x[self.interior :]
        residual = -self.laplacian(self.net, inside) - _source(inside)
        if not len(edge):
            return residual
        return torch.cat([residual, self.net(edge).squeeze(-1)])


ENGINES = ["auto", "traced", "functional"]
# (form, whether the model has the boundary block too, engine)
#: the default run checks one autograd form and one torch.func form in two blocks on every
#: engine; the other forms (each a few seconds on nested graphs) run with the slow tests, and so
#: does the torch.func form on "auto": the layer-wise engine declines these models and hands
#: them to the traced engine, whose products of that form ("traced") and whose hand-over
#: (the autograd form on "auto") the default run checks
CASES = [
    pytest.param(name, False, engine, marks=pytest.mark.slow)
    for name in LAPLACIANS
    for engine in ENGINES
] + [
    pytest.param("autograd_in_place", True, "auto"),
    pytest.param("autograd_in_place", True, "traced"),
    pytest.param("autograd_in_place", True, "functional"),
    pytest.param("hessian", True, "auto", marks=pytest.mark.slow),
    pytest.param("hessian", True, "traced"),
    pytest.param("hessian", True, "functional"),
]
#: the cases whose whole matrix is compared (a product per column: slow on nested graphs)
DENSE = {("autograd_in_place", True, "auto"), ("hessian", False, "functional")}


def _points(two_blocks: bool) -> Tensor:
    g = torch.Generator().manual_seed(1)
    inside = torch.rand(INTERIOR, 2, generator=g, dtype=DTYPE)
    if not two_blocks:
        return inside
    t = torch.rand(BOUNDARY, generator=g, dtype=DTYPE)
    edge = torch.stack([t, (torch.arange(BOUNDARY) % 2).to(DTYPE)], 1)
    return torch.cat([inside, edge])


def _model(form: str) -> Poisson:
    torch.manual_seed(0)
    return Poisson(LAPLACIANS[form], INTERIOR).to(DTYPE)


@functools.cache
def _reference_of(two_blocks: bool):
    """:func:`_reference` at the models' common initialization (every form's network is
    drawn from the same seed)."""
    return _reference(_model("hessian"), _points(two_blocks))


def _reference(model: Poisson, x: Tensor):
    """``J^T H J``, the gradient and the loss, from the Jacobian of an independent residual
    function (the network's Hessian point by point) with respect to the flat parameters."""
    net = model.net
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def residuals(theta: Tensor) -> Tensor:
        chunks = theta.split([s.numel() for s in shapes])
        params = {n: c.view(s) for n, c, s in zip(names, chunks, shapes)}

        def u(p: Tensor) -> Tensor:
            return functional_call(net, params, (p,)).squeeze(-1)

        inside, edge = x[:INTERIOR], x[INTERIOR:]
        lap = torch.stack([hessian(u)(p).diagonal().sum() for p in inside])
        parts = [-lap - _source(inside)] + ([u(edge)] if len(edge) else [])
        return torch.cat(parts)

    r = residuals(flat)
    jac = torch.autograd.functional.jacobian(residuals, flat)
    h = 2.0 / r.numel()  # the Hessian of mean((r - 0)^2) in r: 2 I / n
    return jac.T @ jac * h, jac.T @ r * h, (r**2).mean()


@pytest.mark.parametrize("form,two_blocks,engine", CASES)
def test_ggn_matches_dense_reference(form, two_blocks, engine):
    model = _model(form)
    x = _points(two_blocks)
    G_ref, g_ref, loss_ref = _reference_of(two_blocks)
    V = torch.randn(G_ref.shape[0], 3, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback on these engines: each takes every form
        G = GGN(model, "mse", x, torch.zeros(len(x), dtype=DTYPE), engine=engine)
        GV = G @ V
        dense = G.to_dense() if (form, two_blocks, engine) in DENSE else None
    assert G_ref.abs().max() > 1e-3  # not a vacuous comparison
    torch.testing.assert_close(GV, G_ref @ V, atol=1e-10, rtol=0)
    torch.testing.assert_close(G @ V[:, 0], G_ref @ V[:, 0], atol=1e-10, rtol=0)
    if dense is not None:
        torch.testing.assert_close(dense, G_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(G.gradient, g_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(G.loss, loss_ref, atol=1e-10, rtol=1e-12)


@pytest.mark.parametrize(
    "form,engine",
    # the torch.func form's steps on the traced engine (several seconds each) run with the slow
    # tests: the step is the same for every form, its products are checked above
    [("autograd_in_place", engine) for engine in ENGINES]
    + [pytest.param("hessian", e, marks=pytest.mark.slow) for e in ["auto", "traced"]]
    + [("hessian", "functional")],
)
def test_sgn_step_lowers_the_loss(form, engine):
    model = _model(form)
    x = _points(True)
    zeros = torch.zeros(len(x), dtype=DTYPE)
    info = SGN(model, "mse", engine=engine).step(x, zeros)
    assert info.loss_after < info.loss
    # the loss the step reports is the model's at its new parameters
    assert (model(x.clone()) ** 2).mean().item() == pytest.approx(info.loss_after, rel=1e-10)


def test_layerwise_engine_refuses_a_residual_model():
    with pytest.raises(ValueError, match="layer"):
        SGN(_model("autograd_in_place"), "mse", engine="layerwise").step(
            _points(False), torch.zeros(INTERIOR, dtype=DTYPE)
        )


class NoCreateGraph(nn.Module):
    """A residual whose derivative is taken without ``create_graph``: a constant."""

    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x: Tensor) -> Tensor:
        x = x.detach().requires_grad_(True)
        (du,) = torch.autograd.grad(self.net(x).sum(), x)
        return du.pow(2).sum(1) - _source(x)


@pytest.mark.parametrize("engine", ENGINES)
def test_output_independent_of_the_parameters_is_refused(engine):
    model = NoCreateGraph().to(DTYPE)
    before = [p.detach().clone() for p in model.parameters()]
    opt = SGN(model, "mse", engine=engine)
    with pytest.raises(ValueError, match="does not depend on its trainable parameters"):
        opt.step(_points(False), torch.zeros(INTERIOR, dtype=DTYPE))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


class LogResidual(Poisson):
    """Residuals that are NaN at the points with ``x < 0.5`` (the log of a negative number)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * torch.log(x[: self.interior, 0] - 0.5)


@pytest.mark.parametrize("engine", ENGINES)
def test_non_finite_residuals_are_refused(engine):
    torch.manual_seed(0)
    model = LogResidual(_in_place, INTERIOR).to(DTYPE)
    before = [p.detach().clone() for p in model.parameters()]
    opt = SGN(model, "mse", engine=engine)
    with pytest.raises(FloatingPointError, match="not changed"):
        opt.step(_points(False), torch.zeros(INTERIOR, dtype=DTYPE))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
