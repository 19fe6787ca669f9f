"""Residual least squares (torch_sgn.pinn.Residuals) and exact steps from the row-batched
Jacobian (torch_sgn.engines.functional), against dense float64 references built by reverse mode
alone."""

import math

import pytest
import torch
from torch import nn

from cases import library_calls, pointwise_laplacian
from torch_sgn import GGN, SGN
from torch_sgn.engines.functional import jacobian_rows, per_sample, with_jacobian
from torch_sgn.linearization import ENGINE, ROWS, Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.pinn import Residual, Residuals, laplacian

D = torch.float64


def _net(seed=0, width=6):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 1)).to(D)


def _f(x):
    return 2 * math.pi**2 * torch.sin(math.pi * x[:, :1]) * torch.sin(math.pi * x[:, 1:])


def _problem(net, lap=laplacian, weights=(1.0, 3.0), prior=None):
    g = torch.Generator().manual_seed(1)
    x_in, x_bd = torch.rand(7, 2, generator=g, dtype=D), torch.rand(4, 2, generator=g, dtype=D)
    x_bd[:, 0] = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=D)
    blocks = {
        "interior": Residual(lambda u, x: -lap(u, x) - _f(x), points=x_in, weight=weights[0]),
        "boundary": Residual(lambda u, x: u(x), points=x_bd, weight=weights[1]),
    }
    if prior is not None:
        blocks["prior"] = Residual(lambda u: u[0].bias - 0.5, weight=prior)
    return Residuals(net, blocks), (x_in, x_bd)


def _dense_reference(problem, inputs, reference_problem):
    """(residual vector, J, G = 2 J^T J) with J by torch.autograd.functional.jacobian of the
    reference problem (nested-autograd Laplacian)."""
    fm = FunctionalModel(reference_problem)
    flat = fm.flat()
    r = fm(flat, inputs)
    J = torch.autograd.functional.jacobian(lambda p: fm(p, inputs), flat)
    return r, J, 2 * J.T @ J


def test_residuals_output_is_the_weighted_blocks_and_its_loss_the_weighted_mean_squares():
    problem, (x_in, x_bd) = _problem(_net(), prior=2.0)
    inputs, targets = problem.batch()
    out = problem(*inputs)
    net = problem.network
    r_in = -laplacian(net, x_in) - _f(x_in)
    r_bd = net(x_bd)
    r_p = net[0].bias - 0.5
    expected = torch.cat(
        [
            r_in.reshape(-1) * math.sqrt(1.0 / 7),
            r_bd.reshape(-1) * math.sqrt(3.0 / 4),
            r_p.reshape(-1) * math.sqrt(2.0),
        ]
    )
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=0)
    assert targets.shape == out.shape and not targets.any()
    loss = problem.loss(out, targets)
    means = problem.losses()
    torch.testing.assert_close(
        loss.item(),
        means["interior"] + 3 * means["boundary"] + 2 * means["prior"],
        rtol=1e-12,
        atol=0,
    )


@pytest.mark.parametrize("engine", ["auto", "traced", "functional"])
def test_ggn_of_a_poisson_problem_matches_the_dense_reference(engine):
    problem, _ = _problem(_net(), prior=0.5)
    reference, _ = _problem(problem.network, lap=pointwise_laplacian, prior=0.5)
    inputs, targets = problem.batch()
    _, J, G_ref = _dense_reference(problem, inputs, reference)
    G = GGN(problem, problem.loss, inputs, targets, engine=engine)
    torch.testing.assert_close(G.to_dense(), G_ref, rtol=1e-10, atol=1e-12)
    r = reference(*inputs)
    torch.testing.assert_close(G.gradient, 2 * J.T @ r, rtol=1e-10, atol=1e-12)


def test_the_rows_engines_g_v_from_the_layers_factors_matches_the_dense_reference():
    problem, _ = _problem(_net())
    reference, _ = _problem(problem.network, lap=pointwise_laplacian)
    inputs, targets = problem.batch()
    _, _, G_ref = _dense_reference(problem, inputs, reference)
    G = GGN(problem, problem.loss, inputs, targets)  # the rows engine's products
    v = torch.randn(G_ref.shape[0], dtype=D, generator=torch.Generator().manual_seed(2))
    products = []
    by_factors = library_calls(lambda: products.append(G @ v))
    assert ("pinn/layer_kernel.py", "LayerFactors.jvp") in by_factors  # G v from the factors
    torch.testing.assert_close(products[0], G_ref @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("solver", ["auto", "cg"])
def test_a_residual_problem_is_linearized_by_its_rows_engine_first(solver):
    """The rows engine takes a residual problem before any other engine: with exact steps
    nothing is traced (G and G v from the rows); steps by CG alone take the traced engine's
    products (it replays them), through the rows engine all the same."""
    problem, _ = _problem(_net())
    inputs, targets = problem.batch()
    opt = SGN(problem, problem.loss, solver=solver)
    infos = []
    calls = library_calls(lambda: infos.extend(opt.step(inputs, targets) for _ in range(2)))
    files = {file for file, _ in calls}
    assert ("engines/functional.py", "RowsEngine.__call__") in calls
    chain = ("engines/layerwise/", "engines/traced/")  # the engines of other models
    assert any(f.startswith(chain) for f in files) == (solver == "cg")
    assert any(f.startswith("engines/traced/") for f in files) == (solver == "cg")
    assert infos[-1].plan.jacobian == (ENGINE if solver == "cg" else ROWS)


def test_jacobian_rows_match_reverse_mode_on_residual_blocks():
    problem, _ = _problem(_net(), prior=0.5)
    reference, _ = _problem(problem.network, lap=pointwise_laplacian, prior=0.5)
    inputs, targets = problem.batch()
    r, J, _ = _dense_reference(problem, inputs, reference)
    fm = FunctionalModel(problem)
    outputs, rows = jacobian_rows(fm, fm.flat(), Batch(inputs, targets))
    torch.testing.assert_close(outputs, r, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rows, J, rtol=1e-10, atol=1e-12)


class _TwoPath(nn.Module):
    """A per-sample model that is no Sequential chain (the traced engine takes it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 5), nn.Linear(5, 4), nn.Linear(3, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * torch.sigmoid(self.c(x))


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_with_jacobian_forms_g_and_the_sample_space_exactly(loss):
    torch.manual_seed(0)
    model = _TwoPath().to(D)
    x = torch.randn(6, 3, dtype=D)
    y = torch.randn(6, 4, dtype=D) if loss == "mse" else torch.randint(0, 4, (6,))
    fm, out_loss = FunctionalModel(model), resolve_loss(loss)
    flat, batch = fm.flat(), Batch(x, y)
    G_ref = GGN(model, loss, x, y, engine="functional").to_dense()
    lin = GGN(model, loss, x, y, engine="functional")._lin
    assert per_sample(fm, flat, batch)
    lin = with_jacobian(lin, fm, out_loss, flat, batch)
    torch.testing.assert_close(lin.ggn_matrix(), G_ref, rtol=1e-10, atol=1e-12)
    J = torch.autograd.functional.jacobian(lambda p: fm(p, x).reshape(-1), flat)
    torch.testing.assert_close(lin.sample_space.kernel_matrix(), J @ J.T, rtol=1e-10, atol=1e-12)
    k = lin.sample_space.kernel_matrix()
    assert torch.equal(k, k.T)  # the sample space's Cholesky route needs it exactly


def test_a_model_whose_samples_interact_is_not_per_sample():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(D)
    fm = FunctionalModel(model)
    batch = Batch(torch.randn(8, 3, dtype=D), torch.randn(8, 2, dtype=D))
    assert not per_sample(fm, fm.flat(), batch)
    model.eval()  # running statistics: each sample alone again
    assert per_sample(fm, fm.flat(), batch)


def test_direct_steps_from_the_row_jacobian_equal_the_layerwise_engines():
    """The traced engine's model (no chain) and the same network as a chain (the layer-wise
    engine's own J) take the same exact steps."""

    class Chain(nn.Module):
        def __init__(self, seq):
            super().__init__()
            self.seq = seq

        def forward(self, x):
            return self.seq(x)

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(D)
    wrapped = Chain(seq)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)  # 10 outputs < 50 parameters
    x2, y2 = torch.randn(40, 3, dtype=D), torch.randn(40, 2, dtype=D)  # 80 outputs > 50
    for xs, ys in ((x, y), (x2, y2)):
        a, b = Chain(_copy(seq)), _copy(seq)
        opt_a = SGN(a, "mse", solver="direct", engine="traced")
        opt_b = SGN(b, "mse", solver="direct", engine="layerwise")
        for _ in range(3):
            ia, ib = opt_a.step(xs, ys), opt_b.step(xs, ys)
            assert ia.solver == ib.solver == "direct"
            assert ia.plan.jacobian == ROWS  # the traced model's J by rows: it is per-sample
            torch.testing.assert_close(ia.loss_after, ib.loss_after, rtol=1e-9, atol=1e-14)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-12)
    del wrapped


def _copy(module):
    import copy

    return copy.deepcopy(module)


def test_auto_takes_exact_steps_at_once_on_a_residual_problem_and_lowers_the_loss():
    problem, _ = _problem(_net(width=8))
    opt = SGN(problem, problem.loss)  # solver="auto"
    losses = []
    for step in range(8):
        info = opt.step(*problem.batch(step))
        assert info.solver == "direct"
        losses.append(info.loss_after)
    assert losses[-1] < 1e-3 * losses[0]


def test_a_block_drawn_anew_at_each_step_and_a_block_of_zero_points():
    net = _net()
    draws = []

    def sample(step):
        g = torch.Generator().manual_seed(step)
        draws.append(step)
        return torch.rand(5, 2, generator=g, dtype=D)

    problem = Residuals(
        net,
        {
            "interior": Residual(lambda u, x: -laplacian(u, x) - _f(x), sample=sample),
            "empty": Residual(lambda u, x: u(x) + 1.0, points=torch.zeros(0, 2, dtype=D)),
        },
    )
    (a,), _ = problem.batch(3)[0][:1], None
    b = problem.batch(4)[0][0]
    assert not torch.equal(a, b) and draws[-2:] == [3, 4]
    inputs, targets = problem.batch(5)
    assert problem(*inputs).shape == (5,)  # the empty block adds nothing
    opt = SGN(problem, problem.loss)
    info = opt.step(inputs, targets)
    assert info.loss_after < info.loss


def test_bad_residual_blocks_raise_clear_errors_and_change_nothing():
    net = _net()
    before = [p.clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="weight"):
        Residual(lambda u, x: u(x), points=torch.zeros(3, 2, dtype=D), weight=-1.0)
    with pytest.raises(ValueError, match="leading dimension"):
        Residual(lambda u, x, y: u(x), points=(torch.zeros(3, 2), torch.zeros(4, 1)))
    rows = Residuals(net, {"b": Residual(lambda u, x: u(x)[:2], points=torch.rand(3, 2, dtype=D))})
    with pytest.raises(ValueError, match="one row per point"):
        SGN(rows, rows.loss).step(*rows.batch())
    problem, _ = _problem(net)
    inputs, targets = problem.batch()
    with pytest.raises(ValueError, match="point tensors"):
        SGN(problem, problem.loss).step(inputs[:1], targets)
    bad = Residuals(net, {"b": Residual(lambda u, x: u(x) / 0.0, points=torch.rand(3, 2, dtype=D))})
    with pytest.raises((ValueError, FloatingPointError)):
        SGN(bad, bad.loss).step(*bad.batch())
    for p, q in zip(net.parameters(), before):
        assert torch.equal(p, q)


def test_a_residual_that_does_not_depend_on_the_parameters_or_points_of_the_wrong_shape():
    net = _net()
    before = [p.clone() for p in net.parameters()]
    free = Residuals(net, {"a": Residual(lambda u, x: 2 * x[:, :1], points=torch.rand(5, 2))})
    with pytest.raises(ValueError, match="does not depend on its trainable parameters"):
        SGN(free, free.loss).step(*free.batch())
    wide = Residuals(net, {"a": Residual(lambda u, x: u(x), points=torch.rand(5, 3, dtype=D))})
    with pytest.raises(RuntimeError, match=r"block 'a' on points of shape \[\(5, 3\)\]"):
        SGN(wide, wide.loss).step(*wide.batch())
    for p, q in zip(net.parameters(), before):
        assert torch.equal(p, q)


def test_a_nan_residual_is_named_with_its_block_and_point_and_nothing_changes():
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).to(D)
    x = torch.linspace(-1, 1, 9, dtype=D)[:, None]  # x = -1, -0.75, ..., 1
    problem = Residuals(net, {
        "fit": Residual(lambda u, x: u(x) - x, points=x),
        "root": Residual(lambda u, x: u(x) - torch.sqrt(x), points=x),  # NaN where x < 0
    })  # fmt: skip
    opt = SGN(problem, problem.loss)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(FloatingPointError) as raised:
        opt.step(*problem.batch())
    message = str(raised.value)
    assert "block 'root' at 4 of its 9 points (the first: point 0, [-1.0])" in message
    assert "'fit'" not in message
    for p, q in zip(before, net.parameters()):
        assert torch.equal(p, q)
    problem.blocks[1].fn = lambda u, x: u(x) - x.abs().sqrt()
    assert problem.non_finite(problem.batch()[0]) is None
