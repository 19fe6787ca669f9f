"""Differential operators of torch_sgn.pinn.operators against nested autograd, in float64.

The reference differentiates the model twice with ``torch.autograd.grad(create_graph=True)``,
a route shared with neither the forward Laplacian nor the ``torch.func`` fallback; it stays a
function of the parameters, so their derivatives are checked against it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from cases import nested_derivative, nested_jet
from torch_sgn.pinn.operators import (
    Sin,
    derivative,
    divergence,
    gradient,
    hessian,
    hessian_jet,
    jet,
    laplacian,
    time_derivative,
)

TOL = dict(rtol=1e-12, atol=1e-12)


class Cube(nn.Module):
    """A user-defined activation that gives its own derivatives."""

    def forward(self, z: Tensor) -> Tensor:
        return z**3

    def derivatives(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return z**3, 3 * z**2, 6 * z


class TwoBranches(nn.Module):
    """Not a Sequential: u(x) = net(x) * sin(x_0) + |x|^2, by the fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) * torch.sin(x[:, :1]) + x.square().sum(1, keepdim=True)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    d: int
    forward: bool  # whether the forward Laplacian applies
    scale: float = 1.0  # of the points, to reach the activations' far regions


CASES = [
    Case(
        "tanh-2-16-16-1",
        lambda: nn.Sequential(
            nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
        ),
        2,
        True,
    ),
    Case(
        "sigmoid-3-8-2",
        lambda: nn.Sequential(nn.Linear(3, 8), nn.Sigmoid(), nn.Linear(8, 2)),
        3,
        True,
    ),
    Case(
        "softplus-beta2",
        lambda: nn.Sequential(nn.Linear(3, 8), nn.Softplus(beta=2.0), nn.Linear(8, 1)),
        3,
        True,
    ),
    Case(
        # some pre-activations above the threshold, where torch's softplus is z itself
        "softplus-threshold",
        lambda: nn.Sequential(
            nn.Linear(3, 8), nn.Softplus(beta=2.0, threshold=1.0), nn.Linear(8, 1)
        ),
        3,
        True,
        scale=3.0,
    ),
    Case("gelu", lambda: nn.Sequential(nn.Linear(3, 8), nn.GELU(), nn.Linear(8, 2)), 3, True, 2.0),
    Case(
        "gelu-tanh",
        lambda: nn.Sequential(nn.Linear(3, 8), nn.GELU(approximate="tanh"), nn.Linear(8, 1)),
        3,
        True,
        2.0,
    ),
    Case("silu", lambda: nn.Sequential(nn.Linear(3, 8), nn.SiLU(), nn.Linear(8, 1)), 3, True, 2.0),
    Case(
        "sin-no-bias",
        lambda: nn.Sequential(nn.Linear(2, 8, bias=False), Sin(), nn.Linear(8, 1)),
        2,
        True,
    ),
    Case("cube", lambda: nn.Sequential(nn.Linear(3, 5), Cube(), nn.Linear(5, 1)), 3, True),
    Case(
        "nested",
        lambda: nn.Sequential(
            nn.Sequential(nn.Linear(3, 6), nn.Tanh()),
            nn.Identity(),
            nn.Sequential(nn.Linear(6, 6), Sin(), nn.Sequential(nn.Linear(6, 5), nn.SiLU())),
            nn.Linear(5, 3),
        ),
        3,
        True,
    ),
    Case("two-branches", TwoBranches, 3, False),
    Case(
        # a layer the forward Laplacian does not take: "auto" falls back
        "sequential-elu",
        lambda: nn.Sequential(nn.Linear(3, 6), nn.ELU(), nn.Linear(6, 1)),
        3,
        False,
    ),
]
DIMS = [None, (0,), (-1,), (0, 2)]


def _methods(case: Case) -> list[str]:
    return ["auto", "forward", "func"] if case.forward else ["auto", "func"]


CASE_METHODS = [
    pytest.param(case, method, id=f"{case.name}-{method}")
    for case in CASES
    for method in _methods(case)
]


def _setup(case: Case, n: int = 5) -> tuple[nn.Module, Tensor]:
    model = case.build().double()
    x = case.scale * torch.randn(n, case.d, dtype=torch.float64)
    return model, x


def _dims_for(dims: Optional[tuple], d: int) -> Optional[tuple]:
    return None if dims is None else tuple(k for k in dims if -d <= k < d)


# --- values against the reference -------------------------------------------------------------


@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("case, method", CASE_METHODS)
def test_jet_matches_nested_autograd(case, method, dims):
    model, x = _setup(case)
    dims = _dims_for(dims, case.d)
    got = jet(model, x, laplacian_dims=dims, method=method)
    want = nested_jet(model, x, dims)
    m = want.value.shape[1]
    assert got.value.shape == (5, m)
    assert got.gradient.shape == (5, m, case.d)
    assert got.laplacian.shape == (5, m)
    torch.testing.assert_close(got.value, want.value, **TOL)
    torch.testing.assert_close(got.gradient, want.gradient, **TOL)
    torch.testing.assert_close(got.laplacian, want.laplacian, **TOL)
    assert want.laplacian.abs().max() > 1e-3  # a Laplacian that is not trivially zero


@pytest.mark.parametrize("case, method", CASE_METHODS)
def test_gradient_only_has_zero_laplacian(case, method):
    model, x = _setup(case)
    got = jet(model, x, laplacian_dims=(), method=method)
    want = nested_jet(model, x, ())
    torch.testing.assert_close(got.gradient, want.gradient, **TOL)
    torch.testing.assert_close(gradient(model, x, method=method), want.gradient, **TOL)
    assert torch.equal(got.laplacian, torch.zeros_like(want.value))


@pytest.mark.parametrize("case", [c for c in CASES if c.forward], ids=lambda c: c.name)
def test_forward_and_fallback_agree(case):
    model, x = _setup(case, n=7)
    fast = jet(model, x, method="forward")
    slow = jet(model, x, method="func")
    auto = jet(model, x)
    for a, b, c in zip(
        (fast.value, fast.gradient, fast.laplacian),
        (slow.value, slow.gradient, slow.laplacian),
        (auto.value, auto.gradient, auto.laplacian),
    ):
        torch.testing.assert_close(a, b, **TOL)
        assert torch.equal(a, c)  # "auto" takes the forward Laplacian


# --- derivatives with respect to the parameters -----------------------------------------------


@pytest.mark.parametrize("case, method", CASE_METHODS)
def test_laplacian_parameter_gradient(case, method):
    model, x = _setup(case)
    params = list(model.parameters())
    weights = torch.randn(5, nested_jet(model, x, None).value.shape[1], dtype=torch.float64)
    # the last layer's bias does not reach the Laplacian: its derivative is zero
    got = torch.autograd.grad(
        (laplacian(model, x, method=method) * weights).sum(), params, materialize_grads=True
    )
    want = torch.autograd.grad(
        (nested_jet(model, x, None).laplacian * weights).sum(), params, materialize_grads=True
    )
    assert any(w.abs().max() > 1e-3 for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


class Residual(nn.Module):
    """A PDE residual -Laplacian(u) - 1 as a module, evaluated by functional_call."""

    def __init__(self, u: nn.Module, op: Callable) -> None:
        super().__init__()
        self.u = u
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        return -self.op(self.u, x) - 1.0


@pytest.mark.parametrize("case", [c for c in CASES if c.forward], ids=lambda c: c.name)
def test_forward_mode_jvp_over_functional_call(case):
    model, x = _setup(case, n=4)
    residual = Residual(model, lambda u, x: laplacian(u, x, method="forward"))
    names = [f"u.{name}" for name, _ in model.named_parameters()]
    primals = tuple(p.detach() for p in model.parameters())
    tangents = tuple(torch.randn_like(p) for p in primals)

    def fast(*ps):
        return functional_call(residual, dict(zip(names, ps)), (x,))

    value, jvp = torch.func.jvp(fast, primals, tangents)

    plain = [name for name, _ in model.named_parameters()]

    def ref(*ps):
        def u(z):
            return functional_call(model, dict(zip(plain, ps)), (z,))

        return -nested_jet(u, x, None).laplacian - 1.0

    jacobians = torch.autograd.functional.jacobian(ref, primals)
    want = sum((j * t).flatten(2).sum(2) for j, t in zip(jacobians, tangents))
    torch.testing.assert_close(value, ref(*primals), **TOL)
    torch.testing.assert_close(jvp, want, **TOL)
    assert want.abs().max() > 1e-3


def _tanh_net() -> nn.Module:
    return CASES[0].build().double()


def test_make_fx_traces_the_forward_laplacian():
    from torch.fx.experimental.proxy_tensor import make_fx

    model = _tanh_net()
    residual = Residual(model, lambda u, x: laplacian(u, x, method="forward"))
    names = [f"u.{name}" for name, _ in model.named_parameters()]

    def lap(x, *ps):
        return -functional_call(residual, dict(zip(names, ps)), (x,)) - 1.0

    def lap_and_grads(x, *ps):
        out = lap(x, *ps)
        return (out, *torch.autograd.grad(out.square().sum(), ps, materialize_grads=True))

    with torch.no_grad():
        params = [p.clone() for p in model.parameters()]
    x = torch.randn(6, 2, dtype=torch.float64)
    traced = make_fx(lap)(x, *params)
    # The trace is a function of x and the parameters: evaluate it elsewhere.
    x2 = torch.randn(6, 2, dtype=torch.float64)  # make_fx specializes the shapes
    params2 = [p + 0.1 * torch.randn_like(p) for p in params]
    model2 = _tanh_net()
    with torch.no_grad():
        for p, q in zip(model2.parameters(), params2):
            p.copy_(q)
    torch.testing.assert_close(traced(x2, *params2), nested_jet(model2, x2, None).laplacian, **TOL)

    params = [p.requires_grad_(True) for p in params]
    traced_grads = make_fx(lap_and_grads)(x, *params)
    out, *grads = traced_grads(x, *params)
    plain = [name for name, _ in model.named_parameters()]
    want = nested_jet(
        lambda z: functional_call(model, dict(zip(plain, params)), (z,)), x, None
    ).laplacian
    want_grads = torch.autograd.grad(want.square().sum(), params, materialize_grads=True)
    torch.testing.assert_close(out, want, **TOL)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)


def test_vmap_over_points():
    model = _tanh_net()
    x = torch.randn(5, 2, dtype=torch.float64)
    per_point = torch.func.vmap(lambda xi: laplacian(model, xi[None], method="forward")[0])(x)
    torch.testing.assert_close(per_point, nested_jet(model, x, None).laplacian, **TOL)


# --- the wrappers -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["forward", "func"])
def test_heat_equation_terms(method):
    # points (t, x1): u_t - u_{x1 x1}
    model = _tanh_net()
    tx = torch.rand(8, 2, dtype=torch.float64)
    want = nested_jet(model, tx, (1,))
    u_xx = laplacian(model, tx, dims=[1], method=method)
    u_t = time_derivative(model, tx, dim=0, method=method)
    assert u_xx.shape == u_t.shape == (8, 1)
    torch.testing.assert_close(u_xx, want.laplacian, **TOL)
    torch.testing.assert_close(u_t, want.gradient[..., 0], **TOL)
    full = nested_jet(model, tx, None).laplacian
    assert (u_xx - full).abs().max() > 1e-3  # dims=[1] is not the full Laplacian
    torch.testing.assert_close(time_derivative(model, tx, dim=-1), want.gradient[..., 1], **TOL)


@pytest.mark.parametrize("method", ["forward", "func"])
def test_divergence(method):
    model = CASES[-3].build().double()  # "nested", 3 -> 3
    x = torch.randn(6, 3, dtype=torch.float64)
    want = nested_jet(model, x, ()).gradient.diagonal(dim1=1, dim2=2).sum(1, keepdim=True)
    got = divergence(model, x, method=method)
    assert got.shape == (6, 1)
    torch.testing.assert_close(got, want, **TOL)


# --- errors ---------------------------------------------------------------------------------


def _net(*layers: nn.Module) -> nn.Module:
    return nn.Sequential(*layers).double()


_X = torch.randn(4, 2, dtype=torch.float64)
_SMOOTH = _net(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))

ERRORS = [
    ("x-1d", lambda: laplacian(_SMOOTH, _X[0]), ValueError, r"x must have shape \(N, d\)"),
    ("x-3d", lambda: jet(_SMOOTH, _X[None]), ValueError, r"x must have shape \(N, d\)"),
    ("x-int", lambda: gradient(_SMOOTH, _X.long()), TypeError, r"x must be floating point"),
    ("dims-high", lambda: laplacian(_SMOOTH, _X, dims=[2]), ValueError, r"laplacian_dims.*got 2"),
    ("dims-low", lambda: jet(_SMOOTH, _X, [-3]), ValueError, r"laplacian_dims.*got -3"),
    ("dims-twice", lambda: jet(_SMOOTH, _X, [1, -1]), ValueError, r"laplacian_dims.*twice"),
    ("dims-empty", lambda: laplacian(_SMOOTH, _X, dims=[]), ValueError, r"dims must name"),
    ("time-dim", lambda: time_derivative(_SMOOTH, _X, dim=2), ValueError, r"dim entries.*got 2"),
    ("divergence-m", lambda: divergence(_SMOOTH, _X), ValueError, r"divergence.*m = 1.*d = 2"),
    (
        "relu",
        lambda: laplacian(_net(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)), _X),
        ValueError,
        r"layer 1 \(ReLU\).*second derivatives vanish",
    ),
    (
        "forward-unsupported",
        lambda: jet(_net(nn.Linear(2, 3), nn.ELU(), nn.Linear(3, 1)), _X, method="forward"),
        ValueError,
        r"method='forward' does not support u's layer 1 \(ELU\)",
    ),
    (
        "forward-not-sequential",
        lambda: jet(lambda z: z.sin(), _X, method="forward"),
        ValueError,
        r"method='forward' needs u to be an nn.Sequential",
    ),
    ("method", lambda: jet(_SMOOTH, _X, method="taylor"), ValueError, r"method must be one of"),
    (
        "output-1d",
        lambda: laplacian(lambda z: z.sin().sum(1), _X),
        ValueError,
        r"u must map \(N, d\) points to \(N, m\) values",
    ),
]


@pytest.mark.parametrize("call, error, match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_func_method_does_not_inspect_layers():
    # method="func" differentiates whatever u computes: a ReLU's first derivatives are exact
    net = _net(nn.Sequential(nn.Linear(2, 3), nn.LeakyReLU(0.1)))
    torch.testing.assert_close(gradient(net, _X, method="func"), nested_jet(net, _X, ()).gradient)


# --- mixed second partials and derivatives of order 3 and 4 -----------------------------------


class Quintic(nn.Module):
    """A user activation with derivatives to the fourth order."""

    def forward(self, z: Tensor) -> Tensor:
        return z**5 / 20

    def derivatives(self, z: Tensor) -> tuple[Tensor, ...]:
        return z**5 / 20, z**4 / 4, z**3, 3 * z**2, 6 * z


@pytest.mark.parametrize("case, method", CASE_METHODS)
def test_hessian_matches_nested_autograd(case, method):
    model, x = _setup(case)
    got = hessian(model, x, method=method)
    d = case.d
    want = torch.stack(
        [
            torch.stack([nested_derivative(model, x, (k, j)) for j in range(d)], -1)
            for k in range(d)
        ],
        -2,
    )
    assert got.shape == want.shape == (5, want.shape[1], d, d)
    torch.testing.assert_close(got, want, **TOL)
    assert (want - want.diagonal(dim1=2, dim2=3).diag_embed()).abs().max() > 1e-3  # mixed


HIGHER_CASES = [
    pytest.param(case, method, id=f"{case.name}-{method}")
    for case in CASES
    for method in _methods(case)
    if case.name in ("tanh-2-16-16-1", "sigmoid-3-8-2", "sin-no-bias", "two-branches", "gelu")
] + [
    pytest.param(
        Case(
            "quintic", lambda: nn.Sequential(nn.Linear(2, 4), Quintic(), nn.Linear(4, 1)), 2, True
        ),
        "forward",
        id="quintic-forward",
    )
]


@pytest.mark.parametrize("order", [1, 2, 3, 4])
@pytest.mark.parametrize("case, method", HIGHER_CASES)
def test_derivative_along_a_coordinate_matches_nested_autograd(case, method, order):
    model, x = _setup(case)
    if case.name == "gelu" and method == "forward" and order > 2:  # no 3rd derivative here
        with pytest.raises(ValueError, match="third and fourth derivatives"):
            derivative(model, x, -1, order, method=method)
        return
    got = derivative(model, x, -1, order, method=method)
    want = nested_derivative(model, x, (case.d - 1,) * order)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert want.abs().max() > 1e-3


def test_higher_derivatives_keep_the_layer_factors_exact():
    """An Euler beam's residual u'''' - f through the Taylor-mode derivatives: the layers'
    factors of J J^T (torch_sgn.pinn.layer_kernel) follow it, and SGN takes exact steps."""
    from torch_sgn import SGN
    from torch_sgn.pinn import Residual, Residuals

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1))
    net = net.double()
    x = torch.rand(40, 1, dtype=torch.float64)
    problem = Residuals(
        net,
        {
            "beam": Residual(lambda u, x: derivative(u, x, 0, 4) + 1.0, points=x),
            "mixed": Residual(lambda u, x: hessian(u, x)[:, :, 0, 0], points=x[:5]),
        },
    )
    opt = SGN(problem, problem.loss)
    info = opt.step(*problem.batch())
    assert info.solver == "direct" and info.loss_after < info.loss
    assert problem.factors_follow  # checked against J's rows, and used


def test_derivative_and_hessian_refuse_bad_arguments():
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    x = torch.rand(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="order must be"):
        derivative(model, x, 0, 5)
    with pytest.raises(ValueError, match="dim entries"):
        derivative(model, x, 2, 1)
    with pytest.raises(ValueError, match="method must be"):
        hessian(model, x, method="nope")


@pytest.mark.parametrize("case, method", CASE_METHODS)
def test_hessian_jet_matches_nested_autograd(case, method):
    model, x = _setup(case)
    got = hessian_jet(model, x, method=method)
    d = case.d
    torch.testing.assert_close(got.value, model(x), **TOL)
    grads = torch.stack([nested_derivative(model, x, (k,)) for k in range(d)], -1)
    torch.testing.assert_close(got.gradient, grads, **TOL)
    torch.testing.assert_close(got.hessian, hessian(model, x, method="func"), **TOL)


def test_hessian_jet_pairs_fill_only_the_pairs_asked():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.rand(6, 3, dtype=torch.float64)
    full = hessian_jet(model, x, method="func").hessian
    some = hessian_jet(model, x, method="forward", pairs=[(2, 0), (1, 1)]).hessian
    for k in range(3):
        for j in range(3):
            if {k, j} in ({0, 2}, {1}):
                torch.testing.assert_close(some[:, :, k, j], full[:, :, k, j], **TOL)
            else:
                assert not some[:, :, k, j].any()
    with pytest.raises(ValueError, match="pairs must index coordinates 0..2"):
        hessian_jet(model, x, pairs=[(0, 3)])
