"""torch_sgn.deepxde.ResidualPoints: the PDE's points redrawn by its residual (RAD)."""

import numpy as np
import pytest
import torch
from deepxde_support import import_deepxde

dde = import_deepxde()

from torch_sgn.deepxde import SGN, ResidualPoints  # noqa: E402

PI = np.pi


#: every test here in DeepXDE's float64 (conftest's ``dde_float64``)
pytestmark = pytest.mark.usefixtures("dde_float64")


def _burgers(num_domain=80):
    """Burgers' equation on [-1, 1] x [0, 1] (a steep front forms), small."""

    def pde(x, y):
        u_x = dde.grad.jacobian(y, x, i=0, j=0)
        u_t = dde.grad.jacobian(y, x, i=0, j=1)
        return u_t + y * u_x - 0.01 / PI * dde.grad.hessian(y, x, i=0, j=0)

    domain = dde.geometry.GeometryXTime(dde.geometry.Interval(-1, 1), dde.geometry.TimeDomain(0, 1))
    bcs = [
        dde.icbc.DirichletBC(domain, lambda x: 0, lambda _, on: on),
        dde.icbc.IC(domain, lambda x: -np.sin(PI * x[:, 0:1]), lambda _, on: on),
    ]
    data = dde.data.TimePDE(
        domain, pde, bcs, num_domain=num_domain, num_boundary=10, num_initial=10
    )
    return dde.Model(data, dde.nn.FNN([2, 8, 8, 1], "tanh", "Glorot uniform"))


def _system():
    """A PDE of two components (a first-order system) on the unit square."""

    def pde(x, y):
        return [
            dde.grad.jacobian(y, x, i=0, j=0) - y[:, 1:2],
            dde.grad.hessian(y, x, component=1, i=1, j=1) + y[:, 0:1],
        ]

    geom = dde.geometry.Rectangle([0, 0], [1, 1])
    bcs = [dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on, component=0)]
    data = dde.data.PDE(geom, pde, bcs, num_domain=20, num_boundary=8)
    return dde.Model(data, dde.nn.FNN([2, 6, 2], "tanh", "Glorot uniform"))


def test_density_is_the_residual_to_the_k_over_its_mean_plus_c():
    r = np.array([0.0, 1.0, -2.0, 3.0, 0.5])
    for k, c in [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)]:
        p = ResidualPoints(k=k, c=c).density(r)
        w = np.abs(r) ** k
        expected = w / w.mean() + c
        np.testing.assert_allclose(p, expected / expected.sum(), rtol=1e-14)
        assert p.sum() == pytest.approx(1.0, rel=1e-14) and (p > 0).all()
        assert np.all(np.diff(p[np.argsort(np.abs(r))]) >= 0)  # larger residual, likelier
    uniform = np.full(5, 0.2)
    np.testing.assert_allclose(ResidualPoints(k=0).density(r), uniform, rtol=1e-14)
    np.testing.assert_allclose(ResidualPoints().density(np.zeros(5)), uniform, rtol=1e-14)
    np.testing.assert_allclose(ResidualPoints().density(r * np.nan), uniform, rtol=1e-14)


def test_the_residual_is_the_components_absolute_values_summed():
    model = _system()
    model.compile("adam", lr=1e-3)
    x = np.random.default_rng(0).random((23, 2))
    # the reference: each component by nested autograd on the network, in float64
    xt = torch.tensor(x, requires_grad=True)
    y = model.net(xt)
    (u_x,) = torch.autograd.grad(y[:, 0].sum(), xt, create_graph=True)
    (v_y,) = torch.autograd.grad(y[:, 1].sum(), xt, create_graph=True)
    (v_yy,) = torch.autograd.grad(v_y[:, 1].sum(), xt)
    first = u_x[:, 0] - y[:, 1]
    second = v_yy[:, 1] + y[:, 0]
    expected = (first.abs() + second.abs()).detach().numpy()
    for chunk in (7, 10**6):  # in chunks of 7 points (the last of 2), or at once
        callback = ResidualPoints(chunk=chunk)
        callback.set_model(model)
        np.testing.assert_allclose(callback.residual(x), expected, rtol=1e-10, atol=1e-12)


class _RightHalf(ResidualPoints):
    """A residual that is large on x > 0.5 only: where the redraws must put most points."""

    def residual(self, x):
        return np.where(x[:, 0] > 0.5, 1.0, 1e-3)


def test_sgn_steps_read_the_redrawn_points_and_the_conditions_points_stay():
    model = _burgers()
    opt = SGN(model)
    model.compile(opt)
    callback = _RightHalf(period=2, c=0.1, candidates=5000)
    model.train(iterations=4, callbacks=[callback], display_every=4, verbose=0)
    data = model.data
    assert callback.redraws == 2 and len(data.train_x_all) == data.num_domain == 80
    # density 1/mean + 0.1 against 1e-3/mean + 0.1: about 95% of the points on the right
    assert np.mean(data.train_x_all[:, 0] > 0.5) > 0.85
    bcs = data.train_x_bc.copy()
    pde_before = data.train_x_all.copy()
    model.train(iterations=1, display_every=1, verbose=0)  # a step on the last redraw's points
    residuals = opt.problem.residuals
    inputs, _ = residuals.batch()
    blocks = residuals.split(inputs)
    np.testing.assert_array_equal(blocks["pde"][0].numpy(), pde_before)
    np.testing.assert_array_equal(data.train_x_bc, bcs)
    np.testing.assert_array_equal(
        np.vstack([blocks[name][0].numpy() for name in residuals.names[1:]]), bcs
    )


def test_redraws_on_a_steep_front_lower_the_residual_away_from_the_points():
    """With a fixed set of 40 points the steps fit the points and leave the front free; with
    the points redrawn by the residual the residual at fresh points ends lower."""
    fresh = {}
    for redraw in (False, True):
        dde.config.set_random_seed(0)
        model = _burgers(num_domain=40)
        model.compile(SGN(model))
        callbacks = [ResidualPoints(period=5, candidates=4000)] if redraw else []
        model.train(iterations=30, callbacks=callbacks, display_every=30, verbose=0)
        x = np.random.default_rng(1).random((4000, 2)) * [2, 1] - [1, 0]
        r = np.asarray(model.predict(x, operator=model.data.pde))
        fresh[redraw] = float(np.sqrt(np.mean(r**2)))
    assert fresh[True] < 0.5 * fresh[False]


def test_bad_arguments_and_data_are_refused_with_what_was_wrong():
    for kwargs in (
        {"period": 0},
        {"period": 2.5},
        {"k": -1},
        {"k": float("inf")},
        {"c": 0},
        {"candidates": 0},
        {"chunk": True},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            ResidualPoints(**kwargs)
    model = _burgers(num_domain=80)
    model.compile("adam", lr=1e-3)
    with pytest.raises(ValueError, match=r"candidates \(50\) must be at least .* \(80\)"):
        model.train(iterations=1, callbacks=[ResidualPoints(candidates=50)], verbose=0)
    data = dde.data.Function(dde.geometry.Interval(0, 1), np.sin, 10, 10)
    model = dde.Model(data, dde.nn.FNN([1, 4, 1], "tanh", "Glorot uniform"))
    model.compile("adam", lr=1e-3)
    with pytest.raises(ValueError, match="Function without a PDE"):
        model.train(iterations=1, callbacks=[ResidualPoints()], verbose=0)
