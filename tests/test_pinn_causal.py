"""Causal weighting of residual blocks along time (torch_sgn.pinn.Causal), against a float64
reference built with nested autograd and weights computed by hand from the slab means."""

import copy
import math

import pytest
import torch
from torch import nn

from torch_sgn import SGN
from torch_sgn.engines.functional import jacobian_rows
from torch_sgn.linearization import FACTORS, Batch
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.pinn import Causal, Residual, Residuals, laplacian, time_derivative
from torch_sgn.pinn.causal import slab_weights
from torch_sgn.route_plan import ALL, SAMPLE

D = torch.float64
T = 2.0  # the time range [0, T]


def _net(seed=0, width=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1)).to(D)


def _heat(u, x):
    """u_t - u_xx - f on points (x, t)."""
    return time_derivative(u, x, dim=1) - laplacian(u, x, dims=(0,)) - torch.sin(x[:, :1])


def _points(n=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=D)
    x[:, 1] *= T
    x0 = torch.rand(6, 2, generator=g, dtype=D)
    x0[:, 1] = 0.0
    return x, x0


def _problem(net, causal, n=40, weight=2.0):
    x, x0 = _points(n)
    return Residuals(
        net,
        {
            "pde": Residual(_heat, points=x, weight=weight, causal=causal),
            "initial": Residual(lambda u, x: u(x) - torch.cos(x[:, :1]), points=x0),
        },
    )


def _reference_loss(net, causal, weight=2.0):
    """The causal loss by an independent route: residuals by nested autograd, each point's slab
    and the weights exp(-epsilon sum_{k<i} L_k) by hand, held constant."""
    x, x0 = _points()
    x = x.clone().requires_grad_(True)
    u = net(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (d2u,) = torch.autograd.grad(du[:, 0].sum(), x, create_graph=True)
    r = du[:, 1:2] - d2u[:, :1] - torch.sin(x[:, :1].detach())
    sq = r.square().sum(1).tolist()
    times = x[:, 1].tolist()
    m = causal.slabs
    lo, hi = min(times), max(times)
    slab = [min(m - 1, int((t - lo) / (hi - lo) * m)) for t in times]
    means = []
    for i in range(m):
        members = [s for s, k in zip(sq, slab) if k == i]
        means.append(sum(members) / len(members) if members else 0.0)
    w = [math.exp(-causal.epsilon * sum(means[:i])) for i in range(m)]
    point_w = torch.tensor([w[k] for k in slab], dtype=D)
    pde = weight * (point_w * r.square().sum(1)).sum() / len(times)
    initial = (net(x0) - torch.cos(x0[:, :1])).square().mean()
    return pde + initial, w


def test_the_causal_loss_and_its_gradient_match_a_nested_autograd_reference():
    causal = Causal(time=1, slabs=5, epsilon=3.0)
    net = _net()
    problem = _problem(net, causal)
    inputs, targets = problem.batch()
    loss = problem.loss(problem(*inputs), targets)
    grad = torch.autograd.grad(loss, list(net.parameters()))
    reference, w = _reference_loss(net, causal)
    grad_ref = torch.autograd.grad(reference, list(net.parameters()))
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=0)
    for g, g_ref in zip(grad, grad_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(
        problem.causal_weights()["pde"].slabs, torch.tensor(w, dtype=D), rtol=1e-12, atol=0
    )
    assert min(w) < 0.5  # the weighting is not trivial here

    # J's rows (row by row) and the layers' factors carry the same weights: 2 J^T r is the
    # gradient, and J J^T from the factors is the rows' own.
    fm = FunctionalModel(problem)
    r, jac = jacobian_rows(fm, fm.flat(), Batch(inputs, targets))
    flat_grad = torch.cat([g.reshape(-1) for g in grad_ref])
    torch.testing.assert_close(2 * jac.T @ r, flat_grad, rtol=1e-10, atol=1e-13)
    factors = problem.layer_factors(fm, fm.flat(), inputs)
    assert factors is not None and problem.factors_follow
    torch.testing.assert_close(factors.kernel(), jac @ jac.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(factors.vjp(r), jac.T @ r, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 10.0])
def test_the_weights_lie_in_0_1_start_at_1_and_do_not_increase_in_time(epsilon):
    g = torch.Generator().manual_seed(0)
    times = torch.rand(200, generator=g, dtype=D) * 5
    squares = torch.rand(200, generator=g, dtype=D)
    weights, losses, per_point = slab_weights(times, squares, 8, epsilon)
    assert weights[0] == 1.0
    assert bool((weights > 0).all() and (weights <= 1).all())
    assert bool((weights[1:] <= weights[:-1]).all())
    if epsilon == 0:
        assert bool((weights == 1).all())
    else:
        assert bool((weights[1:] < weights[:-1]).all())  # every slab has a positive mean
    # each point takes its slab's weight; the slab means are the points' means
    index = torch.floor((times - times.min()) / float(times.max() - times.min()) * 8)
    index = index.long().clamp(max=7)
    torch.testing.assert_close(per_point, weights[index], rtol=0, atol=0)
    for i in range(8):
        torch.testing.assert_close(losses[i], squares[index == i].mean())


def test_epsilon_0_takes_the_non_causal_problems_steps_to_the_bit():
    steps = []
    for causal in (None, Causal(time=1, slabs=4, epsilon=0.0)):
        net = _net(seed=3)
        problem = _problem(net, causal)
        opt = SGN(problem, problem.loss)
        losses = [opt.step(*problem.batch(k)).loss for k in range(2)]
        steps.append((losses, [p.detach().clone() for p in net.parameters()]))
    assert steps[0][0] == steps[1][0]
    assert all(torch.equal(a, b) for a, b in zip(steps[0][1], steps[1][1]))


def test_the_weights_are_held_through_a_step_and_recomputed_at_the_next_batch():
    net = _net(seed=4)
    problem = _problem(net, Causal(time=1, slabs=4, epsilon=5.0))
    inputs, targets = problem.batch()
    before = problem.causal_weights()["pde"].slabs.clone()
    first = problem.loss(problem(*inputs), targets)
    assert torch.equal(first, problem.loss(problem(*inputs), targets))
    saved = copy.deepcopy(net.state_dict())
    with torch.no_grad():  # other parameters: the step's inputs keep their weights
        for p in net.parameters():
            p.add_(0.3)
    problem(*inputs)
    net.load_state_dict(saved)
    assert torch.equal(first, problem.loss(problem(*inputs), targets))

    info = SGN(problem, problem.loss).step(inputs, targets)
    assert info.loss == pytest.approx(first.item(), rel=1e-12)
    assert problem.loss(problem(*inputs), targets).item() < info.loss  # on the step's objective
    problem.batch()
    assert not torch.equal(problem.causal_weights()["pde"].slabs, before)


def test_losses_are_the_unweighted_block_means_and_leave_the_weights_alone():
    net = _net(seed=5)
    problem = _problem(net, Causal(time=1, slabs=4, epsilon=(0.0, 1.0)))
    plain = _problem(net, None)
    assert problem.losses() == plain.losses()
    assert problem.causal_weights() == {}  # losses computed no weights
    problem.batch()  # epsilon 0: every weight 1 > 0.99, so the schedule moves on at once
    assert problem.causal_weights()["pde"].epsilon == 1.0
    assert problem.losses(problem.batch()[0]) == plain.losses()


def test_steps_on_many_points_by_a_sample_then_by_the_layers_factors_lower_the_loss():
    net = _net(seed=6)
    problem = _problem(net, Causal(time=1, slabs=8, epsilon=1.0), n=300)
    opt = SGN(problem, problem.loss, direct_max_params=20)  # 306 residuals, 33 parameters
    inputs, targets = problem.batch()
    first = opt.step(inputs, targets)
    assert first.plan.rows == SAMPLE  # the step on a subset of the points and their weights
    opt.state[next(problem.parameters())]["stalls"] = 1  # past the largest sample
    info = opt.step(inputs, targets)
    assert info.plan.rows == ALL and info.plan.jacobian == FACTORS
    assert problem.factors_follow  # checked against J's rows, causal weights included
    assert info.loss_after < info.loss < first.loss


def test_bad_causal_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="slabs=0 must be an integer >= 1"):
        Causal(slabs=0)
    with pytest.raises(ValueError, match="epsilon=-1.0 must be finite and >= 0"):
        Causal(epsilon=-1.0)
    with pytest.raises(ValueError, match="empty schedule"):
        Causal(epsilon=())
    with pytest.raises(ValueError, match="span"):
        Causal(span=(1.0, 1.0))
    with pytest.raises(ValueError, match="needs the block's points"):
        Residual(lambda u: u[0].bias, causal=Causal())
    with pytest.raises(TypeError, match="torch_sgn.pinn.Causal"):
        Residual(_heat, points=_points()[0], causal=True)
    problem = _problem(_net(), Causal(time=2))
    with pytest.raises(ValueError, match="time=2 is not a column"):
        problem.batch()
