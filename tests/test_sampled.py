"""Exact steps on more rows than an exact step takes (torch_sgn.solve.sampled): the sample's
sizes and seeding, the preconditioner and the all-rows linearization against dense float64
references, convergence to the full problem's least-squares solution, resuming bit for bit,
and a problem whose Gram matrix could not be formed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cases import poisson_residuals
from torch_sgn import SGN, route_plan
from torch_sgn.engines.functional import by_factors, jacobian_rows
from torch_sgn.linearization import Batch, RowSample
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.pinn import Residual, Residuals
from torch_sgn.route_plan import StallTest
from torch_sgn.solve import sampled
from torch_sgn.solve.state import DampingState, StepState

D = torch.float64


def _linear_fit(n: int = 300, features: int = 30, seed: int = 0):
    """A linear least-squares fit written as a residual problem: residuals ``x w + b - y``,
    inconsistent (noise), and its solution by a dense float64 solve."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g, dtype=D) * torch.logspace(0, -1, features, dtype=D)
    y = x @ torch.randn(features, 1, generator=g, dtype=D) + 0.1 * torch.randn(
        n, 1, generator=g, dtype=D
    )
    torch.manual_seed(seed)
    net = nn.Linear(features, 1).to(D)
    problem = Residuals(net, {"data": Residual(lambda u, x, y: u(x) - y, points=(x, y))})
    a = torch.cat([x, torch.ones(n, 1, dtype=D)], 1)
    solution = torch.linalg.lstsq(a, y).solution.reshape(-1)
    return problem, net, solution


# --- the sample ----------------------------------------------------------------------------------
def test_allocate_keeps_a_share_of_every_block_and_all_of_a_small_one():
    assert sampled.allocate([10_000, 400], 1000) == [750, 250]
    assert sampled.allocate([10_000, 400], 2000) == [1600, 400]
    assert sampled.allocate([10_000, 100], 1000) == [900, 100]  # all of the small block
    assert sampled.allocate([50, 60], 1000) == [50, 60]  # everything fits
    assert sampled.allocate([0, 500], 100) == [0, 100]  # a block without points draws none
    assert sampled.allocate([], 10) == []


def test_draw_is_seeded_by_the_step():
    first = sampled.draw([1000, 40], 100, seed=3, device=torch.device("cpu"))
    again = sampled.draw([1000, 40], 100, seed=3, device=torch.device("cpu"))
    other = sampled.draw([1000, 40], 100, seed=4, device=torch.device("cpu"))
    assert [len(i) for i in first] == sampled.allocate([1000, 40], 100)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
    for idx, count in zip(first, [1000, 40]):
        assert idx.unique().numel() == idx.numel() and 0 <= idx.min() and idx.max() < count
        assert torch.equal(idx, idx.sort().values)


def test_stall_test_compares_two_windows():
    test = route_plan.SAMPLE_STALL
    w = test.window
    assert not test.stalled([1.0] * (2 * w - 1))
    assert test.stalled([1.0] * (2 * w))
    assert not test.stalled([1.0] * w + [0.5] * w)


# --- the all-rows linearization and the preconditioner, against dense references --------------
def _dense(problem: Residuals, flat: torch.Tensor, inputs):
    fm = FunctionalModel(problem)
    outputs, j = jacobian_rows(fm, flat, Batch(inputs, torch.zeros(0)))
    return fm, outputs, j.to(D)


def test_all_rows_linearization_matches_dense_float64():
    problem = poisson_residuals(60, 12)
    inputs, targets = problem.batch()
    fm = FunctionalModel(problem)
    flat = fm.flat()
    loss = SGN(problem, problem.loss)._loss
    lin = by_factors(fm, loss, flat, Batch(inputs, targets), 20)
    _, r, j = _dense(problem, flat, inputs)
    assert torch.allclose(lin.outputs, r, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lin.loss, r.square().sum(), rtol=1e-12)
    assert torch.allclose(lin.grad, 2 * j.T @ r, rtol=1e-10, atol=1e-12)
    v = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(1), dtype=D)
    assert torch.allclose(lin.ggn_vp(v), 2 * j.T @ (j @ v), rtol=1e-10, atol=1e-12)

    # A sample of every point is J itself; a sample of some is its rows weighted by N_b / n_b.
    whole = by_factors(fm, loss, flat, Batch(inputs, targets), 10_000).rows(0)
    assert torch.allclose(whole.kernel, j @ j.T, rtol=1e-10, atol=1e-12)
    part = lin.rows(5)
    index = sampled.draw([60, 12], 20, 5, flat.device)
    rows = torch.cat([index[0], 60 + index[1]])
    weights = torch.cat(
        [torch.full_like(i, n / i.numel(), dtype=D) for i, n in zip(index, [60, 12])]
    )
    jt = weights.sqrt()[:, None] * j[rows]
    assert part.points == [len(i) for i in index] and part.hessian == pytest.approx(2.0)
    assert torch.allclose(part.kernel, jt @ jt.T, rtol=1e-10, atol=1e-12)
    assert torch.allclose(part.jvp(v), jt @ v, rtol=1e-10, atol=1e-12)
    w = torch.randn(part.size, generator=torch.Generator().manual_seed(2), dtype=D)
    assert torch.allclose(part.vjp(w), jt.T @ w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("damping", [1e-8, 1e-3, 1.0])
def test_preconditioner_is_the_inverse_of_the_damped_sample_matrix(damping):
    g = torch.Generator().manual_seed(0)
    jt = torch.randn(7, 15, generator=g, dtype=D)
    sample = RowSample(
        kernel=jt @ jt.T, jvp=lambda v: jt @ v, vjp=lambda w: jt.T @ w, hessian=2.0, points=[7]
    )
    precond = sampled.SampledPreconditioner(sample)
    lam = torch.linalg.eigvalsh(jt @ jt.T)
    assert precond.shift == pytest.approx(2.0 * float(lam[0]), rel=1e-10)
    m = 2.0 * jt.T @ jt + (damping + precond.shift) * torch.eye(15, dtype=D)
    v = torch.randn(15, generator=g, dtype=D)
    got = precond.preconditioner(damping)(v)
    assert torch.allclose(got, torch.linalg.solve(m, v), rtol=1e-9, atol=1e-12)
    # symmetric positive definite, as conjugate gradient needs
    dense = torch.stack([precond.preconditioner(damping)(e) for e in torch.eye(15, dtype=D)])
    assert torch.allclose(dense, dense.T, atol=1e-10)
    assert torch.linalg.eigvalsh(0.5 * (dense + dense.T)).min() > 0


# --- the route -----------------------------------------------------------------------------------
def test_a_problem_that_fits_an_exact_step_keeps_its_route():
    problem = poisson_residuals(60, 12)  # 72 residuals, 105 parameters: the Gram route
    opt = SGN(problem, problem.loss)
    info = opt.step(*problem.batch())
    assert info.solver == "direct" and info.sample is None


def test_many_rows_per_parameter_take_the_stages_where_the_matrix_fits():
    """105 parameters, within ``direct_max_params``: 440 rows (< 16 per parameter) keep the
    exact route on every row; 1,760 rows (>= 16 per parameter, above the limit) are sampled."""
    max_params = 400
    fewer, more = poisson_residuals(400, 40), poisson_residuals(1600, 160)
    numel = sum(p.numel() for p in fewer.parameters())
    assert 440 < sampled.ROWS_PER_PARAMETER * numel <= 1760
    state = StepState(step=0, damping=DampingState(1e-4))
    assert route_plan.row_stage(fewer, Batch(*fewer.batch()), numel, max_params, state) is None
    assert (
        route_plan.row_stage(more, Batch(*more.batch()), numel, max_params, state)
        == route_plan.SAMPLE
    )
    info = SGN(more, more.loss, direct_max_params=max_params).step(*more.batch())
    assert info.sample == tuple(sampled.allocate([1600, 160], min(sampled.POINTS, max_params)))
    assert info.taken and info.loss_after < info.loss


def test_many_rows_take_sampled_exact_steps_then_all_rows():
    problem = poisson_residuals(400, 40)  # 440 residuals, 105 parameters, both above 50
    opt = SGN(problem, problem.loss, direct_max_params=50)
    inputs, targets = problem.batch()
    info = opt.step(inputs, targets)
    assert info.solver == "direct" and info.sample == tuple(sampled.allocate([400, 40], 50))
    assert info.loss_after < info.loss
    state = opt.state[next(problem.parameters())]
    assert "stalls" not in state and len(state["sampled_losses"]) == 1
    state["stalls"] = 1  # as after a stall of the largest sample (50 rows at most)
    with torch.no_grad():
        full = float(problem(*inputs).square().sum())
    info = opt.step(inputs, targets)
    assert info.solver == "cg" and info.sample == tuple(sampled.allocate([400, 40], 50))
    assert info.loss == pytest.approx(full, rel=1e-12)  # on all rows
    assert info.taken and info.loss_after < info.loss


def test_the_sample_doubles_at_each_stall_then_all_rows(monkeypatch):
    monkeypatch.setattr(sampled, "POINTS", 8)
    problem = poisson_residuals(400, 40)
    batch = Batch(*problem.batch())
    sizes = [route_plan.sample_points(problem, batch, 40, stalls) for stalls in range(6)]
    assert sizes == [8, 16, 32, 40, 0, 0]  # 0: the largest sample stalled, all rows
    two = poisson_residuals(400, 40)  # two rows a point: at most 20 points
    two.blocks[0].fn = lambda u, x: torch.cat([u(x), 2 * u(x)], 1)
    assert [route_plan.sample_points(two, Batch(*two.batch()), 40, k) for k in range(4)] == [
        8, 16, 20, 0,
    ]  # fmt: skip


def test_the_combined_steps_converge_to_the_full_least_squares_solution():
    """Sampled steps stall at their samples' noise; the steps on all rows then reach the
    minimizer of the whole problem (a dense float64 solve), not a neighbourhood of it."""
    problem, net, solution = _linear_fit()
    opt = SGN(problem, problem.loss, direct_max_params=20)  # samples of 20 of 300 points
    inputs, targets = problem.batch()
    kinds = []
    for _ in range(150):
        kinds.append(opt.step(inputs, targets).solver)
        if kinds[-1] == "cg" and kinds[-5:] == ["cg"] * 5:
            break
    assert kinds[0] == "direct" and "cg" in kinds  # sampled, then all rows
    theta = torch.cat([net.weight.detach().reshape(-1), net.bias.detach()])
    assert torch.allclose(theta, solution, rtol=1e-7, atol=1e-9), (theta - solution).abs().max()


def test_a_resumed_run_takes_the_same_steps(monkeypatch):
    """The samples, the stall test and the switch to all rows resume from the state dict, and
    the steps are the same to the bit (fails where anything of them lives outside it, or where
    a sum's order follows the objects' addresses)."""
    share = route_plan.SAMPLE_STALL.share
    monkeypatch.setattr(route_plan, "SAMPLE_STALL", StallTest(2, share))  # all rows soon
    problem = poisson_residuals(300, 30)
    inputs, targets = problem.batch()
    opt = SGN(problem, problem.loss, direct_max_params=40)
    for _ in range(3):
        opt.step(inputs, targets)
    saved_model, saved_opt = copy.deepcopy(problem.state_dict()), copy.deepcopy(opt.state_dict())
    straight = [opt.step(inputs, targets) for _ in range(5)]

    resumed = poisson_residuals(300, 30)
    resumed.load_state_dict(saved_model)
    opt2 = SGN(resumed, resumed.loss, direct_max_params=40)
    opt2.load_state_dict(saved_opt)
    again = [opt2.step(inputs, targets) for _ in range(5)]
    assert [i.solver for i in straight] == ["direct", "direct", "direct", "cg", "cg"]
    assert [(i.solver, i.sample) for i in again] == [(i.solver, i.sample) for i in straight]
    for a, b in zip(problem.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_a_problem_whose_gram_matrix_would_not_fit_runs():
    """200,000 residuals: their R x R Gram matrix would take 320 GB; a step holds a sample."""
    problem = poisson_residuals(200_000, 2000)
    inputs, targets = problem.batch()
    opt = SGN(problem, problem.loss, direct_max_params=64)
    with torch.no_grad():
        before = float(problem(*inputs).square().sum())
    infos = [opt.step(inputs, targets) for _ in range(3)]
    with torch.no_grad():
        after = float(problem(*inputs).square().sum())
    assert all(i.sample == tuple(sampled.allocate([200_000, 2000], 64)) for i in infos)
    assert after < before


def test_count_takes_each_blocks_rows_per_point_from_two_points():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(50, 2, generator=g, dtype=D), torch.rand(7, 2, generator=g, dtype=D)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).to(D)
    problem = Residuals(
        net,
        {
            "three": Residual(lambda u, x: u(x), points=x),  # three rows a point
            "one": Residual(lambda u, x: u(x)[:, 0], points=y),
            "prior": Residual(lambda u: torch.cat([p.reshape(-1) for p in u.parameters()])),
            "off": Residual(lambda u, x: u(x), points=y, weight=0.0),
        },
    )
    inputs = problem.batch()[0]
    with torch.no_grad():
        assert problem.count(inputs) == problem(*inputs).numel() == 150 + 7 + 27


@pytest.mark.parametrize("factors", [True, False])
def test_past_the_largest_sample_all_rows_only_where_the_layer_factors_follow(factors):
    """A network the layers' factors cannot follow (a parameter outside linear layers) has its
    sampled steps form J row by row; past the largest sample they go on, not to CG on every
    row (the slow path the stages replace)."""
    problem = poisson_residuals(300, 30)
    if not factors:
        problem.network.register_parameter("scale", nn.Parameter(torch.ones((), dtype=D)))
        fn = problem.blocks[1].fn
        problem.blocks[1].fn = lambda u, x: fn(u, x) * u.scale
    opt = SGN(problem, problem.loss, direct_max_params=40)
    inputs, targets = problem.batch()
    opt.step(inputs, targets)
    state = opt.state[next(problem.parameters())]
    window = route_plan.SAMPLE_STALL.window
    state["sampled_losses"] = [0.0] * (2 * window - 1)  # the next step stalls
    opt.step(inputs, targets)
    assert state.get("stalls", 0) == (1 if factors else 0)
    assert problem.factors_follow == factors
    after = opt.step(inputs, targets)
    assert after.solver == ("cg" if factors else "direct") and after.sample is not None


def _to(problem: Residuals, device: str) -> Residuals:
    """A copy of ``problem`` on ``device``: its network and its blocks' points."""
    problem = copy.deepcopy(problem).to(device)
    for block in problem.blocks:
        block.points = tuple(p.to(device) for p in block.points)
    return problem


def test_points_on_another_device_than_the_network_are_refused():
    problem = poisson_residuals(20, 4)
    problem.blocks[1].points = tuple(p.to("meta") for p in problem.blocks[1].points)
    with pytest.raises(ValueError, match="'boundary': its points are on meta"):
        problem.batch()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", ["gram", "sampled"])
def test_cuda_steps_match_cpu_steps(rows):
    """The exact steps through the Gram matrix, on all rows and on samples, on CUDA as on the
    CPU (float64)."""
    problem = poisson_residuals(60, 12) if rows == "gram" else poisson_residuals(400, 40)
    gpu = _to(problem, "cuda")
    infos = []
    for p in (problem, gpu):
        opt = SGN(p, p.loss, direct_max_params=4000 if rows == "gram" else 50)
        infos.append(
            [(i.solver, i.sample, i.taken) for i in (opt.step(*p.batch()) for _ in range(3))]
        )
    assert infos[0] == infos[1] and infos[0][-1][:2] == (
        ("direct", None) if rows == "gram" else ("direct", tuple(sampled.allocate([400, 40], 50)))
    )
    for a, b in zip(problem.parameters(), gpu.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-8, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_all_rows_linearization_matches_cpu_and_its_steps_descend():
    """The steps on all rows: their linearization (loss, gradient, ``G v``, a sample's Gram
    matrix) on CUDA as on the CPU, and CUDA's steps lower the loss. (The steps themselves are
    not compared: a conjugate-gradient step on all rows here moves by 1e-3 for a change of the
    parameters by 1e-15, so the two devices' rounding gives different, equally good steps.)"""
    problem = poisson_residuals(400, 40)
    gpu = _to(problem, "cuda")
    lins = []
    for p in (problem, gpu):
        fm = FunctionalModel(p)
        loss = SGN(p, p.loss)._loss
        lins.append(by_factors(fm, loss, fm.flat(), Batch(*p.batch()), 20))
    cpu, cuda = lins
    v = torch.randn(cpu.grad.numel(), generator=torch.Generator().manual_seed(1), dtype=D)
    close = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cuda.loss.cpu(), cpu.loss, **close)
    torch.testing.assert_close(cuda.grad.cpu(), cpu.grad, **close)
    torch.testing.assert_close(cuda.ggn_vp(v.cuda()).cpu(), cpu.ggn_vp(v), **close)
    torch.testing.assert_close(cuda.rows(5).kernel.cpu(), cpu.rows(5).kernel, **close)

    opt = SGN(gpu, gpu.loss, direct_max_params=50)
    opt.state[next(gpu.parameters())]["stalls"] = 1  # the largest sample stalled: all rows
    infos = [opt.step(*gpu.batch()) for _ in range(3)]
    assert [i.solver for i in infos] == ["cg"] * 3
    assert all(i.loss_after < i.loss for i in infos if i.taken) and infos[0].taken


def test_the_stall_test_keeps_two_windows_and_compares_their_means():
    test = StallTest(3, 0.1)
    losses: list = []
    for loss in [9.0, 8.0, 7.0, 1.0, 1.0, 1.0, 0.95]:
        losses = test.kept(losses, loss)
    assert losses == [8.0, 7.0, 1.0, 1.0, 1.0, 0.95]
    assert not test.stalled(losses)  # 16 -> 2.95: a fall
    assert test.stalled([1.0, 1.0, 1.0, 1.0, 1.0, 0.95])  # 3 -> 2.95: less than 10%
    assert not test.stalled([1.0] * 5)  # the windows not yet full
