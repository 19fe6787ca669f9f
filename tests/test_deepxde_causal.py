"""torch_sgn.deepxde.SGN(model, causal=...): the PDE blocks of a TimePDE weighted along time."""

import numpy as np
import pytest
import torch
from deepxde_support import import_deepxde

dde = import_deepxde()

import torch_sgn.deepxde  # noqa: E402
from torch_sgn.pinn import Causal  # noqa: E402

PI = np.pi


#: every test here in DeepXDE's float64 (conftest's ``dde_float64``)
pytestmark = pytest.mark.usefixtures("dde_float64")


def _heat(seed=0):
    """u_t = u_xx / pi^2 on [0, 1] x [0, 2], u(x, 0) = sin(pi x), zero boundary values."""
    dde.config.set_random_seed(seed)

    def pde(x, y):
        return dde.grad.jacobian(y, x, i=0, j=1) - dde.grad.hessian(y, x, i=0, j=0) / PI**2

    domain = dde.geometry.GeometryXTime(dde.geometry.Interval(0, 1), dde.geometry.TimeDomain(0, 2))
    bcs = [
        dde.icbc.DirichletBC(domain, lambda x: 0, lambda _, on: on),
        dde.icbc.IC(domain, lambda x: np.sin(PI * x[:, 0:1]), lambda _, on: on),
    ]
    data = dde.data.TimePDE(domain, pde, bcs, num_domain=60, num_boundary=10, num_initial=10)
    return dde.Model(data, dde.nn.FNN([2, 8, 8, 1], "tanh", "Glorot uniform"))


def test_causal_steps_weight_the_pde_along_time_and_deepxde_shows_its_own_loss():
    model = _heat()
    opt = torch_sgn.deepxde.SGN(model, causal=Causal(slabs=4, epsilon=1.0))
    model.compile(opt)  # the first step checks DeepXDE's loss against the unweighted blocks'
    losshistory, _ = model.train(iterations=8, display_every=8, verbose=0)
    residuals = opt.problem.residuals
    pde, *conditions = residuals.blocks
    assert pde.causal == Causal(time=-1, slabs=4, epsilon=1.0, span=(0.0, 2.0))
    assert all(block.causal is None for block in conditions)
    assert losshistory.loss_train[-1].sum() < losshistory.loss_train[0].sum()

    inputs, targets = residuals.batch()
    slabs = residuals.causal_weights()["pde"].slabs
    assert slabs[0] == 1.0 and bool((slabs[1:] <= slabs[:-1]).all() and (slabs > 0).all())
    causal = float(residuals.loss(residuals(*inputs), targets).detach())
    means = residuals.losses(inputs)
    unweighted = sum(b.weight * means[n] for n, b in zip(residuals.names, residuals.blocks))
    # DeepXDE's loss terms are the unweighted block means; the causal loss weighs the PDE less
    _, terms = model.outputs_losses_train(
        model.train_state.X_train, model.train_state.y_train, model.train_state.train_aux_vars
    )
    assert float(terms.sum().detach()) == pytest.approx(unweighted, rel=1e-10)
    assert causal < unweighted


def test_epsilon_0_takes_the_same_steps_as_no_causal_weighting():
    out = []
    for causal in (False, Causal(epsilon=0.0)):
        model = _heat(seed=1)
        model.compile(torch_sgn.deepxde.SGN(model, causal=causal))
        model.train(iterations=3, display_every=3, verbose=0)
        out.append(torch.cat([p.detach().reshape(-1) for p in model.net.parameters()]))
    assert torch.equal(out[0], out[1])


def test_causal_weighting_of_a_model_without_time_is_refused_with_what_to_do():
    geom = dde.geometry.Rectangle([0, 0], [1, 1])
    bcs = [dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on: on)]
    data = dde.data.PDE(
        geom, lambda x, y: dde.grad.hessian(y, x), bcs, num_domain=10, num_boundary=4
    )
    model = dde.Model(data, dde.nn.FNN([2, 4, 1], "tanh", "Glorot uniform"))
    with pytest.raises(ValueError, match="needs a dde.data.TimePDE.*leave causal=False"):
        torch_sgn.deepxde.SGN(model, causal=True)
    timed = _heat()
    with pytest.raises(ValueError, match="time is the last of the points' 2 columns"):
        torch_sgn.deepxde.SGN(timed, causal=Causal(time=0))
    with pytest.raises(TypeError, match="True, False or a torch_sgn.pinn.Causal"):
        torch_sgn.deepxde.SGN(timed, causal="time")
