"""torch_sgn.deepxde: DeepXDE models trained by SGN in DeepXDE's own loop.

The references are DeepXDE's own: its loss (nested autograd through ``dde.grad``) and that
loss's gradient, on the same points, in float64.
"""

import copy

import numpy as np
import pytest
import torch
from deepxde_support import import_deepxde

dde = import_deepxde()

import torch_sgn.deepxde  # noqa: E402

PI = np.pi


#: every test here in DeepXDE's float64 (conftest's ``dde_float64``)
pytestmark = pytest.mark.usefixtures("dde_float64")


def _poisson(net=None, bcs=None, num_domain=40, num_boundary=16, **kw):
    def pde(x, y):
        dy_xx = dde.grad.hessian(y, x, i=0, j=0)
        dy_yy = dde.grad.hessian(y, x, i=1, j=1)
        return -dy_xx - dy_yy - 2 * PI**2 * torch.sin(PI * x[:, 0:1]) * torch.sin(PI * x[:, 1:2])

    geom = dde.geometry.Rectangle([0, 0], [1, 1])
    if bcs is None:
        bcs = [dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on)]
    data = dde.data.PDE(geom, pde, bcs, num_domain=num_domain, num_boundary=num_boundary, **kw)
    net = net or dde.nn.FNN([2, 8, 8, 1], "tanh", "Glorot uniform")
    return dde.Model(data, net)


def _their_loss_and_grad(model, params):
    """DeepXDE's training loss terms (its MSE, its nested autograd, weighted by its
    loss_weights), their sum and its gradient."""
    for p in params:
        p.grad = None
    _, losses = model.outputs_losses_train(
        model.train_state.X_train, model.train_state.y_train, model.train_state.train_aux_vars
    )
    total = losses.sum()
    total.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    return float(total.detach()), grad, losses.detach().tolist()


def _our_loss_and_grad(opt):
    residuals = opt.problem.residuals
    inputs, targets = residuals.batch()
    params = list(residuals.parameters())
    with torch.enable_grad():
        loss = residuals.loss(residuals(*inputs), targets)
        grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return float(loss.detach()), torch.cat([g.reshape(-1) for g in grads])


def _compiled(model, **compile_kw):
    opt = torch_sgn.deepxde.SGN(model)
    model.compile(opt, **compile_kw)
    model.train_state.set_data_train(*model.data.train_next_batch())
    opt._sync()
    return opt


def _assert_same_loss_and_gradient(model, opt):
    ours, our_grad = _our_loss_and_grad(opt)
    params = list(opt.problem.residuals.parameters())
    theirs, their_grad, their_terms = _their_loss_and_grad(model, params)
    assert theirs > 1e-6
    assert ours == pytest.approx(theirs, rel=1e-12)
    # each block's weighted mean square is DeepXDE's loss term
    residuals = opt.problem.residuals
    our_terms = [
        residuals.losses()[name] * block.weight
        for name, block in zip(residuals.names, residuals.blocks)
    ]
    assert our_terms == pytest.approx(their_terms, rel=1e-12, abs=1e-300)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-9, atol=1e-12)


def test_poisson_loss_and_gradient_are_deepxdes_and_steps_converge():
    model = _poisson()
    opt = _compiled(model, loss_weights=[1.0, 3.0])
    _assert_same_loss_and_gradient(model, opt)
    losshistory, state = model.train(iterations=25, display_every=25, verbose=0)
    assert opt.last_info.solver == "direct"
    assert opt.problem.residuals.factors_follow  # the layers' factors follow the jets
    assert losshistory.loss_train[-1].sum() < 1e-6 * losshistory.loss_train[0].sum()
    x = np.random.default_rng(0).random((200, 2))
    exact = np.sin(PI * x[:, :1]) * np.sin(PI * x[:, 1:])
    assert dde.metrics.l2_relative_error(exact, model.predict(x)) < 1e-2
    # a later compile and train keep working
    model.compile("adam", lr=1e-4)
    model.train(iterations=2, verbose=0)


def _every_condition_model():
    """A heat-like TimePDE on [0, 1] x [0, 1] with one condition of each kind."""

    def pde(x, y):
        u_t = dde.grad.jacobian(y, x, i=0, j=1)
        u_x = dde.grad.jacobian(y, x, i=0, j=0)
        u_xx = dde.grad.jacobian(u_x, x, i=0, j=0)  # a derivative's derivative
        u_xt = dde.grad.hessian(y, x, i=0, j=1)  # a mixed partial
        return [u_t - 0.1 * u_xx + 0.01 * u_xt, y[:, 1:2] - y[:, 0:1] ** 2]

    geom = dde.geometry.Interval(0, 1)
    time = dde.geometry.TimeDomain(0, 1)
    domain = dde.geometry.GeometryXTime(geom, time)

    def left(x, on):
        return on and np.isclose(x[0], 0)

    def right(x, on):
        return on and np.isclose(x[0], 1)

    def operator(x, y, X):
        return dde.grad.jacobian(y, x, i=0, j=0) + y[:, 0:1] * torch.as_tensor(np.sin(X[:, 1:2]))

    anchors = np.random.default_rng(1).random((6, 2))
    bcs = [
        dde.icbc.DirichletBC(domain, lambda x: np.sin(x[:, 1:2]), left),
        dde.icbc.NeumannBC(domain, lambda x: x[:, 1:2], right),
        dde.icbc.RobinBC(domain, lambda X, y: 0.5 * y[:, 0:1], right),
        dde.icbc.PeriodicBC(domain, 0, left, derivative_order=1),
        dde.icbc.PeriodicBC(domain, 0, left, derivative_order=0, component=1),
        dde.icbc.OperatorBC(domain, operator, left),
        dde.icbc.PointSetBC(anchors, np.cos(anchors[:, :1]), component=0),
        dde.icbc.PointSetBC(anchors, np.ones((6, 2)), component=[0, 1]),
        dde.icbc.IC(domain, lambda x: np.sin(PI * x[:, 0:1]), lambda _, on: on),
        dde.icbc.PointSetOperatorBC(
            anchors, np.zeros((6, 1)), lambda x, y, X: dde.grad.jacobian(y, x, i=1, j=1)
        ),
    ]
    data = dde.data.TimePDE(domain, pde, bcs, num_domain=30, num_boundary=12, num_initial=8)
    return dde.Model(data, dde.nn.FNN([2, 6, 6, 2], "sin", "Glorot uniform"))


def test_every_condition_kind_gives_deepxdes_loss_and_gradient():
    model = _every_condition_model()
    opt = _compiled(model, loss_weights=[1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0.5, 1])
    names = opt.problem.names
    assert names[:2] == ["pde0", "pde1"] and len(names) == 12
    _assert_same_loss_and_gradient(model, opt)
    before = float(_our_loss_and_grad(opt)[0])
    model.train(iterations=3, verbose=0)
    assert opt.last_info.loss_after < before


def test_output_transform_and_steps():
    net = dde.nn.FNN([2, 8, 8, 1], "tanh", "Glorot uniform")

    def hard(x, y):  # zero on the boundary of the unit square
        return x[:, :1] * (1 - x[:, :1]) * x[:, 1:] * (1 - x[:, 1:]) * y

    net.apply_output_transform(hard)
    model = _poisson(net=net, bcs=[])
    opt = _compiled(model)
    _assert_same_loss_and_gradient(model, opt)
    model.train(iterations=10, verbose=0)
    assert opt.problem.residuals.factors_follow


def test_feature_transform_takes_the_forward_route():
    net = dde.nn.FNN([4, 8, 1], "tanh", "Glorot uniform")
    net.apply_feature_transform(lambda x: torch.cat([x, torch.sin(PI * x)], 1))
    model = _poisson(net=net)
    opt = _compiled(model)
    assert opt.problem.network.chain is not None  # its jets forward (torch_sgn.pinn.InputMap)
    _assert_same_loss_and_gradient(model, opt)
    model.train(iterations=2, verbose=0)


def test_inverse_problem_recovers_the_variable_and_reports_it(tmp_path):
    """-C u'' = pi^2 sin(pi x) on [0, 1], u = sin(pi x) / C_true with C_true = 2, observed at
    points: C is found, and VariableValue reports the dde.Variable SGN changed."""
    c = dde.Variable(1.0)

    def pde(x, y):
        return -c * dde.grad.hessian(y, x) - PI**2 * torch.sin(PI * x)

    geom = dde.geometry.Interval(0, 1)
    obs = np.linspace(0, 1, 12)[:, None]
    bcs = [
        dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on),
        dde.icbc.PointSetBC(obs, np.sin(PI * obs) / 2),
    ]
    data = dde.data.PDE(geom, pde, bcs, num_domain=30, num_boundary=2)
    model = dde.Model(data, dde.nn.FNN([1, 10, 10, 1], "tanh", "Glorot uniform"))
    opt = torch_sgn.deepxde.SGN(model)
    model.compile(opt, external_trainable_variables=[c])
    values = dde.callbacks.VariableValue([c], period=1, filename=str(tmp_path / "c.txt"))
    model.train(iterations=40, callbacks=[values], verbose=0)
    assert c.item() == pytest.approx(2.0, rel=1e-3)
    assert values.value[0] == pytest.approx(c.item())
    assert len(list(opt.problem.residuals.parameters())) == len(list(model.net.parameters())) + 1


def test_resampled_points_are_the_ones_stepped_on():
    model = _poisson(train_distribution="pseudo")
    opt = torch_sgn.deepxde.SGN(model)
    model.compile(opt)
    seen = []
    resampler = dde.callbacks.PDEPointResampler(period=2)

    class Record(dde.callbacks.Callback):
        def on_epoch_end(self):
            seen.append(opt.problem.residuals.batch()[0][0].clone())

    model.train(iterations=5, callbacks=[resampler, Record()], verbose=0)
    pde_points = torch.as_tensor(model.data.train_x[int(sum(model.data.num_bcs)) :])
    assert not torch.equal(seen[0], seen[-1])
    model.train(iterations=1, verbose=0)
    torch.testing.assert_close(opt.problem.residuals.batch()[0][0], pde_points)


def test_a_loss_other_than_mse_is_refused_before_any_change():
    model = _poisson()
    model.compile(torch_sgn.deepxde.SGN(model), loss="MAE")
    before = [p.detach().clone() for p in model.net.parameters()]
    with pytest.raises(ValueError, match="loss='MSE'"):
        model.train(iterations=1, verbose=0)
    for p, q in zip(before, model.net.parameters()):
        assert torch.equal(p, q)


def test_models_it_cannot_take_are_refused_at_once():
    geom = dde.geometry.Interval(0, 1)
    func = dde.data.Function(geom, lambda x: x, 8, 8)
    with pytest.raises(ValueError, match="dde.data.PDE and dde.data.TimePDE"):
        torch_sgn.deepxde.SGN(dde.Model(func, dde.nn.FNN([1, 4, 1], "tanh", "Glorot uniform")))
    net = dde.nn.FNN([2, 4, 1], "tanh", "Glorot uniform", regularization=["l2", 1e-3])
    with pytest.raises(ValueError, match="no regularizer"):
        torch_sgn.deepxde.SGN(_poisson(net=net))


def test_state_dict_round_trip_takes_the_same_steps():
    model = _poisson()
    opt = _compiled(model)
    model.train(iterations=3, verbose=0)
    state = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.net.parameters()]
    model.train(iterations=2, verbose=0)
    after = [p.detach().clone() for p in model.net.parameters()]
    with torch.no_grad():
        for p, q in zip(model.net.parameters(), params):
            p.copy_(q)
    opt.load_state_dict(state)
    model.train(iterations=2, verbose=0)
    for p, q in zip(model.net.parameters(), after):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_save_restore_and_saveplot_work_as_with_deepxdes_optimizers(tmp_path):
    model = _poisson()
    opt = torch_sgn.deepxde.SGN(model)
    model.compile(opt)
    losshistory, train_state = model.train(iterations=3, verbose=0)
    path = model.save(str(tmp_path / "model"), verbose=0)
    saved = [p.detach().clone() for p in model.net.parameters()]
    model.train(iterations=2, verbose=0)
    model.restore(path, verbose=0)
    for p, q in zip(model.net.parameters(), saved):
        assert torch.equal(p, q)
    assert (
        opt.state_dict()["state"]
        == torch.load(path, weights_only=False)["optimizer_state_dict"]["state"]
    )
    dde.saveplot(losshistory, train_state, issave=True, isplot=False, output_dir=str(tmp_path))
    assert (tmp_path / "loss.dat").exists()


def test_euler_beam_fourth_derivative_as_deepxde_writes_it():
    """DeepXDE's Euler beam example: u'''' = -1 on [0, 1], u(0) = u'(0) = 0, u''(1) = u'''(1) = 0,
    its fourth derivative a hessian of a hessian, the third a jacobian of one; and a KdV-like
    third derivative by jacobians of jacobians. Loss and gradient are DeepXDE's own."""

    def pde(x, y):
        dy_xx = dde.grad.hessian(y, x)
        dy_xxxx = dde.grad.hessian(dy_xx, x)
        dy_x = dde.grad.jacobian(y, x)
        dy_xxx = dde.grad.jacobian(dde.grad.jacobian(dy_x, x), x)
        return dy_xxxx + 1 + 0.01 * dy_xxx

    def d2(x, y, _):
        return dde.grad.hessian(y, x)

    def d3(x, y, _):
        return dde.grad.jacobian(dde.grad.hessian(y, x), x)

    geom = dde.geometry.Interval(0, 1)

    def left(x, on):
        return on and np.isclose(x[0], 0)

    def right(x, on):
        return on and np.isclose(x[0], 1)

    bcs = [
        dde.icbc.DirichletBC(geom, lambda x: 0, left),
        dde.icbc.NeumannBC(geom, lambda x: 0, left),
        dde.icbc.OperatorBC(geom, d2, right),
        dde.icbc.OperatorBC(geom, d3, right),
    ]
    data = dde.data.PDE(geom, pde, bcs, num_domain=20, num_boundary=2)
    model = dde.Model(data, dde.nn.FNN([1, 10, 10, 1], "tanh", "Glorot uniform"))
    opt = _compiled(model)
    _assert_same_loss_and_gradient(model, opt)
    model.train(iterations=30, verbose=0)
    x = np.linspace(0, 1, 50)[:, None]
    exact = -(x**4) / 24 + x**3 / 6 - x**2 / 4
    # (the small u''' term moves the solution a little from the pure beam's)
    assert np.abs(model.predict(x) - exact).max() < 5e-3
    assert opt.problem.residuals.factors_follow


def test_a_pde_whose_residuals_turn_nan_is_named_not_taken_for_another_loss():
    model = _poisson()
    pde = model.data.pde
    model.data.pde = lambda x, y: pde(x, y) * torch.log(x[:, 0:1] - 0.5)  # NaN left of x = 0.5
    model.compile(torch_sgn.deepxde.SGN(model))
    before = [p.detach().clone() for p in model.net.parameters()]
    with pytest.raises(FloatingPointError, match="not finite in block 'pde' at [0-9]+ of its"):
        model.train(iterations=1, verbose=0)
    for p, q in zip(before, model.net.parameters()):
        assert torch.equal(p, q)


def _inverse_style_model():
    """A PDE written as PINNacle's inverse problems write theirs: the output's columns sliced
    (u, a) and the divergence of a product of them differentiated, besides a quotient, a sine,
    an exponential and a power of the output."""

    def pde(x, ua):
        u, a = ua[:, 0:1], ua[:, 1:2]
        u_x = dde.grad.jacobian(u, x, i=0, j=0)
        u_y = dde.grad.jacobian(u, x, i=0, j=1)
        d_au = dde.grad.jacobian(a * u_x, x, i=0, j=0) + dde.grad.jacobian(a * u_y, x, i=0, j=1)
        odd = dde.grad.jacobian(
            torch.sin(u) / (2 + a * a) - torch.exp(-x[:, 0:1]) * u**2, x, i=0, j=1
        )
        return [-d_au - torch.sin(PI * x[:, 0:1]), odd + 0.5 * a - 1]

    geom = dde.geometry.Rectangle([0, 0], [1, 1])
    bc = dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on, component=0)
    data = dde.data.PDE(geom, pde, [bc], num_domain=30, num_boundary=12)
    return dde.Model(data, dde.nn.FNN([2, 8, 8, 2], "tanh", "Glorot uniform"))


def test_a_pde_that_differentiates_a_product_of_its_outputs_gets_deepxdes_loss_and_gradient():
    model = _inverse_style_model()
    opt = _compiled(model)
    _assert_same_loss_and_gradient(model, opt)
    start = _our_loss_and_grad(opt)[0]
    model.train(iterations=5, verbose=0)
    assert _our_loss_and_grad(opt)[0] < 0.5 * start
    assert opt.problem.residuals.factors_follow  # exact steps by the layers' factors


def test_a_product_differentiated_twice_is_refused_with_what_it_is():
    def pde(x, ua):
        u, a = ua[:, 0:1], ua[:, 1:2]
        au_x = dde.grad.jacobian(a * u, x, i=0, j=0)
        return dde.grad.jacobian(au_x, x, i=0, j=0) - a

    geom = dde.geometry.Rectangle([0, 0], [1, 1])
    data = dde.data.PDE(geom, pde, [], num_domain=10)
    model = dde.Model(data, dde.nn.FNN([2, 8, 2], "tanh", "Glorot uniform"))
    with pytest.raises(NotImplementedError, match="differentiates such a derivative again"):
        torch_sgn.deepxde.SGN(model)  # (its PDE is evaluated once when it is built)


def test_balance_starts_every_term_at_its_weight_and_keeps_its_scales():
    """balance=True: at the first step each block's weight is DeepXDE's loss weight divided by
    the term's value there (DeepXDE's own loss terms, nested autograd, are the reference), so
    the loss SGN steps on starts at the sum of the loss weights; the scales stay fixed and
    DeepXDE's loss check still holds (it sees its own weights)."""
    model = _poisson()
    opt = torch_sgn.deepxde.SGN(model, balance=True)
    model.compile(opt, loss_weights=[1, 10])
    model.train_state.set_data_train(*model.data.train_next_batch())
    params = list(opt.problem.residuals.parameters())
    _, _, their_terms = _their_loss_and_grad(model, params)  # weighted by [1, 10]
    assert opt.scales is None
    model.train(iterations=1, verbose=0)
    expected = [w / t for w, t in zip([1, 10], their_terms)]  # 1 / the unweighted term
    assert opt.scales == pytest.approx(expected, rel=1e-10)
    assert opt.last_info.loss == pytest.approx(11.0, rel=1e-10)
    assert [b.weight for b in opt.problem.residuals.blocks] == pytest.approx(
        [w * s for w, s in zip([1, 10], opt.scales)], rel=1e-15
    )
    scales = list(opt.scales)
    model.train(iterations=2, verbose=0)
    assert opt.scales == scales
    assert opt.last_info.loss < 11.0
    model.compile(opt, loss_weights=[1, 10])  # compiled again: DeepXDE's check runs again
    model.train(iterations=1, verbose=0)
    assert opt.scales == scales


def test_balance_off_is_the_default_step_and_its_scales_resume_from_the_state_dict():
    runs = []
    for kw in ({}, {"balance": False}, {"balance": True}):
        torch.manual_seed(0)
        model = _poisson()
        opt = torch_sgn.deepxde.SGN(model, **kw)
        model.compile(opt)
        model.train(iterations=3, verbose=0)
        runs.append((model, opt, [p.detach().clone() for p in model.net.parameters()]))
    for p, q in zip(runs[0][2], runs[1][2]):
        assert torch.equal(p, q)
    assert any(not torch.equal(p, q) for p, q in zip(runs[0][2], runs[2][2]))
    model, opt, _ = runs[2]
    state = copy.deepcopy(opt.state_dict())
    assert state["balance_scales"] == opt.scales
    params = [p.detach().clone() for p in model.net.parameters()]
    model.train(iterations=2, verbose=0)
    after = [p.detach().clone() for p in model.net.parameters()]
    fresh = torch_sgn.deepxde.SGN(model, balance=True)  # a resumed run: a new optimizer
    model.compile(fresh)
    with torch.no_grad():
        for p, q in zip(model.net.parameters(), params):
            p.copy_(q)
    fresh.load_state_dict(state)
    assert fresh.scales == opt.scales
    model.train(iterations=2, verbose=0)
    for p, q in zip(model.net.parameters(), after):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_balance_must_be_a_bool():
    with pytest.raises(TypeError, match="balance must be True or False"):
        torch_sgn.deepxde.SGN(_poisson(), balance="start")
