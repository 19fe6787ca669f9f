"""The direct solver: against torch.linalg.solve on dense G + rho I built independently (float64),
its fallbacks, the memory limit, solver="auto"'s choice, and its place in SGN's step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from cases import (
    LOSS,
    LOSSES,
    MODELS,
    ModelCase,
    dense_ggn,
    dense_parts,
    flat_parameters,
    make_batch,
    normal,
)
from torch_sgn import SGN, linearization
from torch_sgn.engines import functional as jacobian
from torch_sgn.engines.layerwise import engine as layerwise
from torch_sgn.engines.selection import select_engine
from torch_sgn.linearization import Batch, ggn_matrix
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.solve import direct
from torch_sgn.solve.direct import DirectResult, solve_damped

#: The plain step, taken whatever its loss: these tests check its math.
EXACT = dict(line_search=False, trust_region=False, lr=1.0, momentum=0.0, reject_uphill=False)


def _spd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return a @ a.T / n


# --- the pure solve ------------------------------------------------------------------------------
def test_a_float32_step_is_solved_in_float64_where_float32_cholesky_fails():
    # G = J^T J (summed in float64, as the engines do) with singular values of J from 1 down
    # to 1e-6, and a float32 gradient: in float32 G + 1e-10 I is indefinite to rounding; the
    # solve runs in float64 and returns float32.
    g = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(36, 12, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))
    J = q1 @ torch.diag(torch.logspace(0, -6, 12, dtype=torch.float64)) @ q2.T
    G, rhs = J.T @ J, torch.randn(12, generator=g)
    _, info = torch.linalg.cholesky_ex(G.float() + 1e-10 * torch.eye(12))
    assert int(info) != 0  # float32's own factorization fails: the test means something
    result = solve_damped(G, rhs, 1e-10)
    assert result.reason == "cholesky" and result.x.dtype == torch.float32
    A = G + 1e-10 * torch.eye(12, dtype=torch.float64)

    def relative_error(x, b):  # against the float64 solve (condition number 1e10)
        expected = -torch.linalg.solve(A, b.double())
        return float(torch.linalg.vector_norm(x.double() - expected) / expected.norm())

    assert relative_error(result.x, rhs) < 1e-6
    b = torch.randn(12, generator=g)
    again = result.again(b)
    assert again.dtype == torch.float32 and relative_error(again, b) < 1e-6


def test_a_float32_chain_sums_its_G_in_float64():
    # The layer-wise engine's G of a float32 model, against the float64 model's dense G: the
    # float32 Jacobian's rounding alone (about 1e-7), not that of float32 sums over samples.
    model, x, y = make_batch(MODELS[0], LOSS["mse"])
    G64, _, _ = dense_ggn(model, "mse", x, y)
    model32 = copy.deepcopy(model).float()
    fm = FunctionalModel(model32)
    engine = select_engine(fm, resolve_loss("mse"), "layerwise")
    lin = engine(fm.flat(), Batch(x.float(), y.float()))
    G = lin.ggn_matrix()
    assert G.dtype == torch.float64
    torch.testing.assert_close(G, G64, rtol=0, atol=1e-6 * float(G64.abs().max()))


def test_cholesky_solution_matches_linalg_solve_and_its_residual_is_the_true_one():
    G = _spd(9)
    rhs = torch.randn(9, dtype=torch.float64)
    result = solve_damped(G, rhs, 1e-3)
    A = G + 1e-3 * torch.eye(9, dtype=torch.float64)
    assert result.reason == "cholesky" and not result.breakdown and result.iterations == 0
    torch.testing.assert_close(result.x, torch.linalg.solve(A, -rhs), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result.residual, A @ result.x + rhs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_an_exactly_symmetric_matrix_said_so_is_solved_to_the_bit_as_without(layout):
    """``symmetric=True`` skips forming the symmetric part, which is the matrix itself: the
    same solution, residual and re-solve to the bit, whichever the matrix's memory layout."""
    G = _spd(40)
    G = (G + G.T) * 0.5
    G = G if layout == "rows" else G.T.contiguous().T  # a transposed (column-major) layout
    assert torch.equal(G, G.T)
    rhs, other = torch.randn(40, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    said, plain = solve_damped(G, rhs, 1e-3, symmetric=True), solve_damped(G, rhs, 1e-3)
    assert said.reason == plain.reason == "cholesky"
    assert torch.equal(said.x, plain.x) and torch.equal(said.residual, plain.residual)
    assert torch.equal(said.again(other), plain.again(other))


def test_indefinite_matrix_takes_the_eigenvalue_fallback_and_gives_a_descent_step():
    # G with negative eigenvalues (a custom loss not convex in the outputs): G + rho I is
    # indefinite, Cholesky fails; the fallback solves with max(lambda, 0) + rho.
    g = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    eigs = torch.tensor([3.0, 1.0, 0.5, 0.0, -0.2, -2.0], dtype=torch.float64)
    G = q @ torch.diag(eigs) @ q.T
    rhs = torch.randn(6, generator=g, dtype=torch.float64)
    rho = 1e-2
    result = solve_damped(G, rhs, rho)
    clipped = q @ torch.diag(eigs.clamp_min(0) + rho) @ q.T
    assert result.reason == "eigh"
    torch.testing.assert_close(result.x, torch.linalg.solve(clipped, -rhs), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(result.residual, clipped @ result.x + rhs, rtol=0, atol=1e-10)
    assert float(rhs @ result.x) < 0  # a descent direction for rhs


def test_float32_singular_matrix_with_a_tiny_damping_never_gives_nan():
    # J^T J of rank 2 in 30 dimensions, damping far below float32's resolution of its scale:
    # G + rho I is singular to rounding.
    g = torch.Generator().manual_seed(2)
    J = torch.randn(2, 30, generator=g) * 1e3
    G = J.T @ J
    G[0, 1] -= 1.0  # rounding-sized asymmetry and indefiniteness
    rhs = torch.randn(30, generator=g)
    result = solve_damped(G, rhs, 1e-30)
    assert result.reason in ("cholesky", "eigh")
    assert torch.isfinite(result.x).all() and torch.isfinite(result.residual).all()


@pytest.mark.parametrize(
    "where", ["matrix_nan", "matrix_inf_diagonal", "matrix_inf", "rhs_nan", "rhs_inf"]
)
def test_non_finite_matrix_or_rhs_gives_no_step_and_a_breakdown(where):
    G = _spd(4)
    rhs = torch.ones(4, dtype=torch.float64)
    if where == "matrix_nan":
        G[1, 2] = math.nan
    elif where == "matrix_inf_diagonal":  # Cholesky may pass it, with a zero entry of x
        G[0, 0] = math.inf
    elif where == "matrix_inf":
        G[2, 1] = G[1, 2] = math.inf
    else:
        rhs[3] = math.nan if where == "rhs_nan" else -math.inf
    result = solve_damped(G, rhs, 1.0)
    assert result.breakdown and result.reason == "non_finite"
    assert torch.equal(result.x, torch.zeros(4, dtype=torch.float64))


def test_finite_entries_whose_sum_overflows_are_solved():
    # the finiteness test sums the entries (one copy to the host); where the sum overflows,
    # the entries themselves are tested
    G = torch.diag(torch.tensor([1e308, 1e308, 1.0], dtype=torch.float64))
    rhs = torch.ones(3, dtype=torch.float64)
    result = solve_damped(G, rhs, 1.0)
    assert result.reason == "cholesky" and not result.breakdown
    torch.testing.assert_close(result.x, -rhs / torch.diagonal(G + torch.eye(3, dtype=G.dtype)))


def test_eigh_failure_falls_back_to_a_scaled_gradient(monkeypatch):
    G = -_spd(5)  # indefinite: Cholesky fails, then eigh is made to fail
    rhs = torch.randn(5, dtype=torch.float64)

    def no_convergence(*args, **kwargs):
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "eigh", no_convergence)
    result = solve_damped(G, rhs, 0.5)
    scale = 0.5 + float(torch.linalg.matrix_norm(G))
    assert result.reason == "scaled_gradient"
    torch.testing.assert_close(result.x, -rhs / scale)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="does not match"):
        solve_damped(torch.eye(3), torch.ones(4), 1.0)


# --- forming G ------------------------------------------------------------------------------------
# Every loss on the MLP (the layer-wise engine's Jacobian route, the functional engine's
# products); the CNN and the sequence model (products in both engines) on a few.
MATRIX_CASES = [(MODELS[0], case) for case in LOSSES] + [
    (MODELS[1], LOSS["cross_entropy"]),
    (MODELS[1], LOSS["mse"]),
    (MODELS[2], LOSS["CE-ignore-index"]),
    (MODELS[2], LOSS["BCE-sum"]),
]


@pytest.mark.usefixtures("each_engine")
@pytest.mark.parametrize(
    "model_case,loss_case", MATRIX_CASES, ids=[f"{m.name}-{c.name}" for m, c in MATRIX_CASES]
)
def test_ggn_matrix_matches_the_dense_reference(each_engine, model_case, loss_case):
    model, x, y = make_batch(model_case, loss_case)
    loss = loss_case.make()
    fmodel = FunctionalModel(model)
    engine = select_engine(fmodel, resolve_loss(loss), each_engine)
    lin = engine(fmodel.flat(), Batch(x, y))
    G_ref, _, _ = dense_ggn(model, loss, x, y)
    torch.testing.assert_close(lin.ggn_matrix(), G_ref, rtol=1e-9, atol=1e-12)
    if model_case is MODELS[0]:  # the products route, in chunks that do not divide P
        products = ggn_matrix(lin.ggn_vp, fmodel.numel, fmodel.flat(), chunk=5)
        torch.testing.assert_close(products, G_ref, rtol=1e-9, atol=1e-12)


def test_the_layerwise_engine_forms_G_from_the_jacobian_only_for_per_sample_chains():
    mse = resolve_loss("mse")
    mlp, x, y = make_batch(MODELS[0], LOSS["mse"])
    fm = FunctionalModel(mlp)
    assert select_engine(fm, mse, "layerwise")(fm.flat(), Batch(x, y)).dense_ggn is not None
    cnn, x, y = make_batch(MODELS[1], LOSS["mse"])
    fm = FunctionalModel(cnn)
    assert select_engine(fm, mse, "layerwise")(fm.flat(), Batch(x, y)).dense_ggn is None


def _tied(samples: int, outputs: int):
    """A chain using one linear layer twice, a batch for it and its layer-wise linearization."""
    torch.manual_seed(3)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Sigmoid(), nn.Linear(4, outputs)).double()
    x = torch.randn(samples, 4, dtype=torch.float64)
    y = torch.randn(samples, outputs, dtype=torch.float64)
    fm = FunctionalModel(model)
    return model, x, y, select_engine(fm, resolve_loss("mse"), "layerwise")(fm.flat(), Batch(x, y))


def test_tied_weights_add_up_in_the_jacobian_route():
    model, x, y, lin = _tied(samples=7, outputs=2)
    assert lin.dense_ggn is not None
    G_ref, _, _ = dense_ggn(model, "mse", x, y)
    torch.testing.assert_close(lin.ggn_matrix(), G_ref, rtol=1e-9, atol=1e-12)


# --- SGN(solver="direct") -------------------------------------------------------------------------
@pytest.mark.usefixtures("each_engine")
@pytest.mark.parametrize("momentum", [0.0, 0.5], ids=["outputs-or-G", "G"])
@pytest.mark.parametrize("loss_case", LOSSES, ids=[c.name for c in LOSSES])
def test_direct_step_solves_the_damped_system_for_every_loss(loss_case, momentum):
    # Without momentum the layer-wise engine solves through the batch's outputs (fewer than
    # the parameters); a gradient average (the first one is the gradient itself) goes
    # through G. Both must give the dense solution.
    models = (MODELS[0], MODELS[2]) if loss_case.targets != "real" else (MODELS[0],)
    for model_case in models:
        model, x, y = make_batch(model_case, loss_case)
        loss = loss_case.make()
        G, g, theta = dense_ggn(model, loss, x, y)
        rho = 1e-3
        A = G + rho * torch.eye(len(theta), dtype=G.dtype)
        expected = theta - torch.linalg.solve(A, g)
        options = {**EXACT, "momentum": momentum}
        opt = SGN(model, loss, damping=rho, solver="direct", cg_iters=1, **options)
        info = opt.step(x, y)
        torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-9, atol=1e-11)
        assert info.solver == "direct" and info.iterations == 0
        assert info.stop_reason in ("cholesky", "lu")  # through G, or through the outputs
        d = expected - theta
        predicted = float(g @ d + 0.5 * d @ A @ d)
        assert info.predicted_change == pytest.approx(predicted, rel=1e-9, abs=1e-14)


def test_direct_step_on_a_non_convex_custom_loss_takes_the_fallback_and_stays_finite():
    model, x, y = make_batch(MODELS[0], LOSS["mse"])

    def concave(outputs, targets):  # H = -2/n I: G is negative semi-definite
        return -((outputs - targets) ** 2).mean()

    opt = SGN(model, concave, damping=1e-4, solver="direct", **EXACT)
    info = opt.step(x, y)
    assert info.stop_reason == "eigh" and info.solver == "direct"
    assert torch.isfinite(flat_parameters(model)).all() and info.predicted_change < 0


def test_a_failing_direct_solve_leaves_everything_unchanged(monkeypatch):
    model, x, y = make_batch(MODELS[0], LOSS["mse"])
    opt = SGN(model, "mse", solver="direct")
    opt.step(x, y)
    before_model = copy.deepcopy(model.state_dict())
    before_opt = copy.deepcopy(opt.state_dict())

    def broken(*args, **kwargs):
        raise RuntimeError("factorization broke")

    monkeypatch.setattr(direct, "solve_damped", broken)
    with pytest.raises(RuntimeError, match="factorization broke"):
        opt.step(x + 1, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_model[k])
    assert str(opt.state_dict()) == str(before_opt)


def test_curvature_subset_forms_G_on_the_subset():
    model, x, y = make_batch(MODELS[0], LOSS["mse"])
    x, y = torch.cat([x, x.flip(0) * 2]), torch.cat([y, -y])  # 12 samples
    n, m, rho = 12, 6, 1e-2
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:m].sort().values
    G_sub, _, theta = dense_ggn(model, "mse", x[idx], y[idx])
    _, g, _ = dense_ggn(model, "mse", x, y)
    expected = theta - torch.linalg.solve(G_sub + rho * torch.eye(len(theta)).double(), g)
    SGN(model, "mse", damping=rho, solver="direct", curvature_fraction=0.5, **EXACT).step(x, y)
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-9, atol=1e-11)


def test_direct_with_the_cpu_graph_stand_in_matches_the_eager_step(cpu_graph_captures):
    model, x, y = make_batch(MODELS[0], LOSS["cross_entropy"])
    twin = copy.deepcopy(model)
    a = SGN(model, "cross_entropy", solver="direct", cuda_graphs=True)
    b = SGN(twin, "cross_entropy", solver="direct")
    for k in range(3):
        info_a, info_b = a.step(x + k, y), b.step(x + k, y)
        assert info_a.solver == info_b.solver == "direct"
    assert cpu_graph_captures  # the captured path ran
    torch.testing.assert_close(
        flat_parameters(model), flat_parameters(twin), rtol=1e-10, atol=1e-12
    )


def test_float32_direct_training_fits_a_small_regression_at_least_as_well_as_cg():
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 200).unsqueeze(1)
    y = torch.sin(3 * x)
    results = {}
    for solver in ("direct", "cg"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1, 10), nn.Tanh(), nn.Linear(10, 1))
        opt = SGN(model, "mse", solver=solver, damping_min=1e-10)
        for _ in range(60):
            info = opt.step(x, y)
        assert info.solver == solver
        results[solver] = info.loss_after
    assert math.isfinite(results["direct"])
    assert results["direct"] < 1e-7 and results["direct"] <= results["cg"]


# --- memory limit and solver="auto" ---------------------------------------------------------------
def test_direct_on_a_model_too_large_raises_at_construction_naming_count_and_bytes():
    # Where no step can go through the batch's outputs (here: the functional engine), the
    # P x P matrices must fit: refused when SGN is built.
    torch.manual_seed(0)
    model = nn.Linear(1000, 1000)  # 1,001,000 parameters: 3 x n^2 x 8 bytes (float64) = 24 TB
    before = flat_parameters(model)
    need = 3 * 1_001_000**2 * 8
    with pytest.raises(ValueError) as err:
        SGN(model, "mse", solver="direct", engine="functional")
    message = str(err.value)
    assert "1,001,000 parameters" in message and f"{need:,} bytes" in message
    assert "solver='cg'" in message
    assert torch.equal(flat_parameters(model), before)
    # The layer-wise engine's chain may go through the outputs instead: built, and a batch of
    # one sample (30 outputs) takes an exact step, where G would need 195 GB.
    model = nn.Linear(3000, 30)
    before = flat_parameters(model)
    opt = SGN(model, "mse", solver="direct")
    x, y = torch.randn(1, 3000), torch.randn(1, 30)
    assert opt.step(x, y).solver == "direct" and not torch.equal(flat_parameters(model), before)


def test_the_memory_check_compares_with_the_free_memory(monkeypatch):
    model, x, y = make_batch(MODELS[0], LOSS["mse"])  # 43 parameters: 44,376 bytes in float64
    monkeypatch.setattr(direct, "available_memory", lambda device: 44_375)
    with pytest.raises(ValueError, match="43 parameters"):
        SGN(model, "mse", solver="direct", engine="functional")
    monkeypatch.setattr(direct, "available_memory", lambda device: 44_376)
    SGN(model, "mse", solver="direct", engine="functional")
    # auto does not raise: it takes CG where the matrix does not fit
    monkeypatch.setattr(direct, "available_memory", lambda device: 100)
    assert SGN(model, "mse", solver="auto").step(x, y).solver == "cg"


def test_direct_checks_the_matrix_at_a_step_that_cannot_go_through_the_outputs(monkeypatch):
    # A chain on the layer-wise engine: built without the P x P check; its batch of 6 x 3
    # outputs (fewer than the 43 parameters) goes through the outputs; a batch of 20 x 3 would
    # need G, which does not fit: that step raises and changes nothing.
    model, x, y = make_batch(MODELS[0], LOSS["mse"])
    monkeypatch.setattr(direct, "available_memory", lambda device: 44_375)
    opt = SGN(model, "mse", solver="direct")
    assert opt.step(x, y).solver == "direct"
    big_x, big_y = torch.cat([x, x, x, x[:2]]), torch.cat([y, y, y, y[:2]])
    before_model, before_opt = flat_parameters(model), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="43 parameters.*through the batch's outputs"):
        opt.step(big_x, big_y)
    assert torch.equal(flat_parameters(model), before_model)
    assert str(opt.state_dict()) == str(before_opt)


def _count_calls(monkeypatch, name: str) -> list:
    calls = []
    original = getattr(direct, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(direct, name, counted)
    return calls


def test_auto_probes_direct_within_the_limit_and_only_cg_above_it(monkeypatch):
    # solver="auto" (the default) steps by CG and probes the exact step beside it (through the
    # outputs here), where the direct solver is within the limit; above it, CG alone.
    model, x, y = make_batch(MODELS[0], LOSS["mse"])  # 43 parameters, 6 x 3 outputs
    samples = _count_calls(monkeypatch, "solve_in_sample_space")
    info = SGN(copy.deepcopy(model), "mse").step(x, y)
    assert info.solver == "cg" and samples
    samples.clear()
    info = SGN(model, "mse", direct_max_params=17).step(x, y)  # 18 outputs, 43 parameters
    assert info.solver == "cg" and info.iterations > 0 and not samples


def test_auto_forms_G_by_products_only_where_they_cost_at_most_cg(monkeypatch):
    # Without the layer-wise engine's Jacobian route G costs P products: auto never takes the
    # direct solver there (not even to probe it), unless P is within CG's budget of products.
    model, x, y = make_batch(MODELS[0], LOSS["mse"])  # 43 parameters
    matrix = _count_calls(monkeypatch, "solve_damped")
    SGN(copy.deepcopy(model), "mse", engine="functional").step(x, y)
    assert not matrix
    SGN(copy.deepcopy(model), "mse", engine="functional", cg_iters=43).step(x, y)
    assert matrix
    matrix.clear()
    cnn, x, y = make_batch(MODELS[1], LOSS["cross_entropy"])  # products on every engine
    SGN(cnn, "cross_entropy").step(x, y)
    assert not matrix


def test_direct_solves_through_the_outputs_where_they_are_fewer_than_the_parameters(monkeypatch):
    # 43 parameters: within the limit either way; 18 outputs: the smaller system is taken,
    # and the step is the dense solution all the same.
    model, x, y = make_batch(MODELS[0], LOSS["mse"])
    G, g, theta = dense_ggn(model, "mse", x, y)
    rho = 1e-3
    expected = theta - torch.linalg.solve(G + rho * torch.eye(len(theta)).double(), g)
    samples = _count_calls(monkeypatch, "solve_in_sample_space")
    info = SGN(model, "mse", damping=rho, solver="direct", **EXACT).step(x, y)
    assert samples and info.solver == "direct"
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-9, atol=1e-11)


def test_a_gradient_average_goes_through_G_not_through_the_outputs(monkeypatch):
    # m_hat is not of the form J^T e, which the outputs' system needs.
    model, x, y = make_batch(MODELS[0], LOSS["mse"])
    samples = _count_calls(monkeypatch, "solve_in_sample_space")
    matrix = _count_calls(monkeypatch, "solve_damped")
    SGN(copy.deepcopy(model), "mse", solver="direct").step(x, y)
    assert samples  # (whose symmetric R x R system goes through solve_damped too)
    samples.clear()
    matrix.clear()
    opt = SGN(model, "mse", momentum=0.5, solver="direct")
    assert opt.step(x, y).solver == "direct"
    assert matrix and not samples


def _kernel_both_ways(monkeypatch, model, x, y):
    """The layer-wise outputs kernel as the engine forms it, the same factors' kernel pair by
    pair, and for each parameter (slot) whether its pairs go at once."""
    stack, kernel_of, add = (
        layerwise.stacked_factors,
        layerwise.kernel_of_factors,
        layerwise.add_stacked_pairs,
    )
    by_pairs, stacked, added = [], {}, []

    def both(factors, z):
        by_pairs.append(kernel_of(factors, z, by_pairs=True))
        stacked.update({slot: stack(e, z[0].numel()) is not None for slot, e in factors.items()})
        return kernel_of(factors, z)

    monkeypatch.setattr(layerwise, "kernel_of_factors", both)
    monkeypatch.setattr(layerwise, "add_stacked_pairs", lambda *a: added.append(1) or add(*a))
    fm = FunctionalModel(model)
    lin = select_engine(fm, resolve_loss("mse"), "layerwise")(fm.flat(), Batch(x, y))
    assert lin.sample_space is not None
    K = lin.sample_space.kernel_matrix()
    assert len(added) == sum(stacked.values())  # the engine's kernel took the stacked route
    return K, by_pairs[0], stacked


def _dense_kernel(model, x, y) -> torch.Tensor:
    _, J, _, _, _ = dense_parts(model, "mse", x, y)
    return J @ J.T


def _mlp7() -> nn.Module:  # three layers: the blocks of two output units are not symmetric
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 7))


def _frozen_cnn() -> nn.Module:  # the route goes through the trainable layers only
    model = MODELS[1].build()
    model[0].requires_grad_(False)
    return model.extend([nn.Tanh(), nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 4)])


def _sequence() -> nn.Module:  # a linear layer on (samples, steps, features): rows formed
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Flatten(), nn.Linear(10, 3))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(
    "case",
    [
        MODELS[0],
        ModelCase("mlp-7", _mlp7, normal(5, 4)),
        ModelCase("frozen-cnn", _frozen_cnn, MODELS[1].inputs),
        ModelCase("sequence", _sequence, normal(4, 2, 3)),
    ],
    ids=lambda c: c.name,
)
def test_the_outputs_kernel_adds_all_pairs_of_output_units_at_once(monkeypatch, case, dtype):
    # Every trainable parameter has one entry per output unit: its pairs go at once, and give
    # the loop's kernel to rounding and J J^T built by autograd.
    model, x, y = make_batch(case, LOSS["mse"], dtype=dtype)
    K, K_pairs, stacked = _kernel_both_ways(monkeypatch, model, x, y)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    assert list(stacked.values()) == [True] * n_params and y[0].numel() >= 3
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    scale = float(K.abs().max())
    torch.testing.assert_close(K, K_pairs, rtol=rtol, atol=rtol * scale)
    reference = _dense_kernel(copy.deepcopy(model).double(), x.double(), y.double())
    rtol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(K, reference, rtol=rtol, atol=rtol * scale)


def test_the_outputs_kernel_is_J_J_transposed_for_tied_weights_and_several_outputs(monkeypatch):
    # The layer used twice has two entries per output unit: its pairs go one by one, the last
    # layer's at once.
    torch.manual_seed(3)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Sigmoid(), nn.Linear(4, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    K, K_pairs, stacked = _kernel_both_ways(monkeypatch, model, x, y)
    assert K.shape == (15, 15) and stacked == {0: False, 1: False, 2: True, 3: True}
    torch.testing.assert_close(K, _dense_kernel(model, x, y), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(K, K_pairs, rtol=1e-12, atol=1e-12 * float(K.abs().max()))


@pytest.mark.parametrize("outputs", [1, 3])
def test_the_outputs_kernel_of_a_layer_on_samples_and_on_sequences(monkeypatch, outputs):
    # One linear layer on (samples, features), its rows factored, and on (samples, 1,
    # features), its rows formed: pairs of a factored row and a formed one.
    torch.manual_seed(5)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(
        shared, nn.Tanh(), nn.Unflatten(1, (1, 4)), shared, nn.Flatten(), nn.Linear(4, outputs)
    ).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, outputs, dtype=torch.float64)
    K, K_pairs, stacked = _kernel_both_ways(monkeypatch, model, x, y)
    assert stacked == {0: False, 1: False, 2: outputs > 1, 3: outputs > 1}
    torch.testing.assert_close(K, _dense_kernel(model, x, y), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(K, K_pairs, rtol=1e-12, atol=1e-12 * float(K.abs().max()))


def test_the_outputs_kernel_of_one_output_unit_goes_pair_by_pair(monkeypatch):
    model, x, _ = make_batch(MODELS[0], LOSS["mse"])
    model[-1] = nn.Linear(5, 1).double()
    y = torch.randn(6, 1, dtype=torch.float64)
    K, K_pairs, stacked = _kernel_both_ways(monkeypatch, model, x, y)
    assert list(stacked.values()) == [False] * 4 and torch.equal(K, K_pairs)
    torch.testing.assert_close(K, _dense_kernel(model, x, y), rtol=1e-10, atol=1e-12)


def test_only_one_factor_per_output_unit_with_one_right_factor_goes_at_once():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 3, generator=g, dtype=torch.float64)
    lefts = [torch.randn(4, 2, generator=g, dtype=torch.float64) for _ in range(3)]
    z = torch.zeros(4, 3, dtype=torch.float64)  # 4 samples, 3 output units

    def entries(rights, units=(0, 1, 2)):
        return [(o, left, right) for o, left, right in zip(units, lefts, rights)]

    shared = [a.reshape(4, -1) for _ in range(3)]  # a new tensor each, one memory
    for factors in (entries(shared), entries([None] * 3)):
        assert layerwise.stacked_factors(factors, 3) is not None
        K = layerwise.kernel_of_factors({0: factors}, z)
        torch.testing.assert_close(
            K, layerwise.kernel_of_factors({0: factors}, z, by_pairs=True), rtol=1e-12, atol=0
        )
    declined = [
        entries([a, a.clone(), a]),  # equal values, other memory
        entries([a, a.as_strided((4, 3), (1, 4)), a]),  # the same memory read otherwise
        entries(shared, units=(0, 1, 1)),  # a unit twice (tied weights)
        entries(shared)[:2],  # a unit missing
    ]
    for factors in declined:
        assert layerwise.stacked_factors(factors, 3) is None
        K = layerwise.kernel_of_factors({0: factors}, z)
        assert torch.equal(K, layerwise.kernel_of_factors({0: factors}, z, by_pairs=True))
    assert layerwise.stacked_factors(entries(shared)[:1], 1) is None  # one output unit


def test_the_outputs_kernel_of_a_sequence_model_forms_the_rows():
    # Linear layers on (samples, steps, features): a sample's row sums over the steps.
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Flatten(), nn.Linear(10, 2)).double()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    fm = FunctionalModel(model)
    lin = select_engine(fm, resolve_loss("mse"), "layerwise")(fm.flat(), Batch(x, y))
    assert lin.sample_space is not None
    params = list(model.parameters())
    J = torch.stack(
        [torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
         for o in model(x).reshape(-1)]
    )  # fmt: skip
    torch.testing.assert_close(lin.sample_space.kernel_matrix(), J @ J.T, rtol=1e-10, atol=1e-12)
    G, g, theta = dense_ggn(model, "mse", x, y)
    for rho in (1e-1, 1e-6):
        ref = torch.linalg.solve(G + rho * torch.eye(len(theta)).double(), -g)
        result = direct.solve_in_sample_space(lin.sample_space, lin.grad, rho, lin.ggn_vp)
        torch.testing.assert_close(result.x, ref, rtol=1e-7, atol=1e-9)
        assert result.residual.norm() <= 1e-10 * g.norm()


def test_a_frozen_parameter_restricts_the_direct_step():
    model, x, y = make_batch(MODELS[0], LOSS["mse"])
    opt = SGN(model, "mse", damping=1e-2, solver="direct", **EXACT)
    first = next(model.parameters())
    first.requires_grad_(False)  # frozen after construction
    G, g, theta = dense_ggn(model, "mse", x, y)  # over the trainable parameters only
    expected = theta - torch.linalg.solve(G + 1e-2 * torch.eye(len(theta)).double(), g)
    frozen = first.detach().clone()
    assert opt.step(x, y).solver == "direct"
    assert torch.equal(first, frozen)
    rest = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(rest, expected, rtol=1e-9, atol=1e-11)


def test_the_damping_floor_follows_the_solver():
    # A linear least-squares fit: every prediction is exact, so the trust-region rule lowers
    # the damping at each step down to the floor of the solver that runs.
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.1
    floors = {}
    for solver in ("direct", "cg"):
        model = nn.Linear(3, 1).double()
        opt = SGN(model, "mse", solver=solver)
        for _ in range(120):
            info = opt.step(x, y + 0.01 * torch.randn(40, 1, dtype=torch.float64))
        floors[solver] = info.next_damping
    assert floors["cg"] == pytest.approx(1e-6)
    assert floors["direct"] < 1e-12
    paper = SGN.paper(nn.Linear(3, 1).double(), "mse")
    assert paper.param_groups[0]["damping_min"] == 1e-6 and paper._setup.solver == "cg"


def test_state_dict_round_trip_continues_bit_identically():
    model, x, y = make_batch(MODELS[1], LOSS["cross_entropy"], dtype=torch.float32)
    batches = [(x + 0.1 * k, y) for k in range(6)]
    opt = SGN(model, "cross_entropy", solver="direct")
    infos = [opt.step(*b) for b in batches[:3]]
    assert {i.solver for i in infos} == {"direct"}
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    reference = [opt.step(*b) for b in batches[3:]]
    resumed = MODELS[1].build()
    resumed.load_state_dict(saved_model)
    opt2 = SGN(resumed, "cross_entropy", solver="direct")
    opt2.load_state_dict(saved_opt)
    assert [opt2.step(*b) for b in batches[3:]] == reference
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(solver="exact"), "solver"),
        (dict(direct_max_params=-1), "direct_max_params"),
        (dict(direct_max_params=2.5), "direct_max_params"),
    ],
)
def test_bad_solver_arguments_are_refused(kwargs, match):
    model, _, _ = make_batch(MODELS[0], LOSS["mse"])
    with pytest.raises(ValueError, match=match):
        SGN(model, "mse", **kwargs)


def test_direct_result_is_shaped_like_a_cg_result():
    result = DirectResult(torch.zeros(2), torch.zeros(2), 0, "cholesky")
    assert not result.breakdown
    assert DirectResult(torch.zeros(2), torch.zeros(2), 0, "non_finite").breakdown


def test_levenberg_marquardt_re_solves_reuse_the_matrix(monkeypatch):
    model, x, y = make_batch(MODELS[1], LOSS["mse"])  # the CNN: G from J's rows
    formed, solved = [], []
    solve = direct.solve_damped
    monkeypatch.setattr(
        linearization, "ggn_matrix", lambda *a, **k: formed.append(1) or ggn_matrix(*a, **k)
    )
    rows = jacobian.jacobian_rows  # with solver="direct" the CNN's G comes from J's rows
    monkeypatch.setattr(jacobian, "jacobian_rows", lambda *a: formed.append(1) or rows(*a))
    monkeypatch.setattr(
        direct, "solve_damped", lambda *a, **k: solved.append(a[2]) or solve(*a, **k)
    )
    opt = SGN(model, "mse", solver="direct", lr=30.0, attempts=4, line_search=False)
    info = opt.step(x, y)
    assert info.attempts > 1 and len(solved) == info.attempts and len(formed) == 1
    assert solved == sorted(solved) and solved[-1] > solved[0]  # more damping each attempt
    assert info.damping == solved[-1]
