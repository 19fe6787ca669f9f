"""The randomized Nystrom approximation and preconditioner against dense float64 references."""

import copy
import math

import pytest
import torch
from torch import nn

from cases import LOSSES, MODELS, dense_ggn, make_batch
from torch_sgn import GGN, SGN, conjugate_gradient, nystrom

D = torch.float64


def _psd(eigenvalues: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``Q diag(eigenvalues) Q^T`` for a random orthogonal ``Q``."""
    n = eigenvalues.shape[0]
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=D))
    a = q @ torch.diag(eigenvalues) @ q.T
    return 0.5 * (a + a.T)


def _decaying(n: int, rate: float = 0.7) -> torch.Tensor:
    """A fast (geometric) decay, ``1, rate, rate^2, ...``, with a floor far below the top."""
    return torch.clamp(rate ** torch.arange(n, dtype=D), min=1e-14)


def _dense(apply, n: int) -> torch.Tensor:
    return torch.stack([apply(e) for e in torch.eye(n, dtype=D).unbind(1)], 1)


def _effective_dimension(eigenvalues: torch.Tensor, damping: float) -> float:
    return float((eigenvalues / (eigenvalues + damping)).sum())


@pytest.mark.parametrize("vmap", [True, False])
def test_full_rank_reproduces_the_matrix(vmap):
    eigenvalues = torch.logspace(2, -6, 40, dtype=D)
    a = _psd(eigenvalues, seed=1)
    g = torch.Generator().manual_seed(0)
    approx = nystrom(lambda v: a @ v, 40, 40, a, generator=g, vmap=vmap)
    assert approx.rank == 40
    torch.testing.assert_close(approx @ torch.eye(40, dtype=D), a, rtol=0, atol=1e-11)
    torch.testing.assert_close(approx.eigenvalues, eigenvalues, rtol=1e-6, atol=1e-11)
    u = approx.eigenvectors
    torch.testing.assert_close(u.T @ u, torch.eye(40, dtype=D), rtol=0, atol=1e-12)


def test_rank_r_error_lies_between_the_best_and_the_expected_bound():
    # Tropp, Yurtsever, Udell, Cevher (2017), Theorem 4.1, as Frangella et al. use it: for a
    # sketch of size s and any r <= s - 2, E ||A - A_nys||_* <= (1 + r / (s - r - 1)) * tail_r,
    # tail_r = sum_{j > r} lambda_j. A - A_nys is PSD, so the nuclear norm is the trace; and
    # A_nys has rank s, so the error is at least tail_s (Eckart-Young).
    n, s = 120, 30
    eigenvalues = 1.0 / torch.arange(1, n + 1, dtype=D) ** 2  # polynomial decay: a real tail
    a = _psd(eigenvalues, seed=2)

    def tail(r):
        return float(eigenvalues[r:].sum())

    bound = min((1 + r / (s - r - 1)) * tail(r) for r in range(1, s - 1))
    errors = []
    for seed in range(8):
        approx = nystrom(lambda v: a @ v, n, s, a, generator=torch.Generator().manual_seed(seed))
        residual = a - approx @ torch.eye(n, dtype=D)
        assert torch.linalg.eigvalsh(residual).min() > -1e-12  # A_nys <= A in Loewner order
        errors.append(float(torch.trace(residual)))
    assert all(tail(s) <= e for e in errors)
    assert all(e <= 2.0 * bound for e in errors)  # a single draw: Markov's factor
    assert sum(errors) / len(errors) <= bound  # the expectation, by the mean of 8 draws
    assert sum(errors) / len(errors) > 1.5 * tail(s)  # a random sketch does not find the best


def test_preconditioner_is_symmetric_positive_definite_with_the_predicted_spectrum():
    n, s, damping = 80, 20, 1e-4
    a = _psd(_decaying(n), seed=3)
    approx = nystrom(lambda v: a @ v, n, s, a, generator=torch.Generator().manual_seed(1))
    m = _dense(approx.preconditioner(damping), n)
    torch.testing.assert_close(m, m.T, rtol=0, atol=1e-14)
    lam = approx.eigenvalues
    spectrum = torch.linalg.eigvalsh(m)
    # eigenvalues (lam_s + rho) / (lam_i + rho) on U, 1 on its complement
    expected = torch.cat([(lam[-1] + damping) / (lam + damping), torch.ones(n - s, dtype=D)])
    torch.testing.assert_close(spectrum, expected.sort().values, rtol=1e-10, atol=1e-14)
    assert spectrum.min() > 0


@pytest.mark.parametrize("damping", [1e-3, 1e-6])
def test_preconditioned_condition_number_is_small_past_the_effective_dimension(damping):
    n = 200
    eigenvalues = _decaying(n)
    a = _psd(eigenvalues, seed=4)
    a_damped = a + damping * torch.eye(n, dtype=D)
    d_eff = _effective_dimension(eigenvalues, damping)
    s = 2 * math.ceil(1.5 * d_eff) + 1  # Frangella et al., Proposition 5.3
    approx = nystrom(lambda v: a @ v, n, s, a, generator=torch.Generator().manual_seed(2))
    m = _dense(approx.preconditioner(damping), n)
    w, v = torch.linalg.eigh(m)
    m_half = v @ torch.diag(w.sqrt()) @ v.T
    preconditioned = torch.linalg.eigvalsh(m_half @ a_damped @ m_half)
    kappa = float(preconditioned.max() / preconditioned.min())
    kappa_plain = float(torch.linalg.cond(a_damped))
    assert kappa_plain > 0.5 / damping  # the system really is ill-conditioned
    assert kappa < 10.0
    # with a sketch far below d_eff, the preconditioner cannot flatten the spectrum
    small = nystrom(lambda v: a @ v, n, 3, a, generator=torch.Generator().manual_seed(2))
    w, v = torch.linalg.eigh(_dense(small.preconditioner(damping), n))
    m_half = v @ torch.diag(w.sqrt()) @ v.T
    weak = torch.linalg.eigvalsh(m_half @ a_damped @ m_half)
    assert float(weak.max() / weak.min()) > 10 * kappa


def test_preconditioned_cg_converges_in_far_fewer_iterations():
    n, damping = 300, 1e-6
    eigenvalues = _decaying(n, rate=0.8)
    a = _psd(eigenvalues, seed=5)
    b = torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(6))

    def matvec(v):
        return a @ v + damping * v

    s = 2 * math.ceil(1.5 * _effective_dimension(eigenvalues, damping)) + 1
    approx = nystrom(lambda v: a @ v, n, s, a, generator=torch.Generator().manual_seed(3))
    plain = conjugate_gradient(matvec, b, max_iters=5000, rtol=1e-8)
    pcg = conjugate_gradient(
        matvec, b, max_iters=5000, rtol=1e-8, preconditioner=approx.preconditioner(damping)
    )
    assert plain.reason == pcg.reason == "converged"
    x_star = torch.linalg.solve(a + damping * torch.eye(n, dtype=D), b)
    assert float(torch.linalg.vector_norm(matvec(pcg.x) - b) / b.norm()) <= 1e-8 * (1 + 1e-6)
    torch.testing.assert_close(pcg.x, x_star, rtol=1e-4, atol=1e-4 * float(x_star.abs().max()))
    assert pcg.iterations < 40
    assert 5 * pcg.iterations < plain.iterations


def test_one_approximation_serves_several_dampings():
    n = 150
    eigenvalues = _decaying(n)
    a = _psd(eigenvalues, seed=7)
    approx = nystrom(lambda v: a @ v, n, 60, a, generator=torch.Generator().manual_seed(4))
    b = torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(8))
    for damping in (1e-2, 1e-5, 1e-8):

        def matvec(v, damping=damping):
            return a @ v + damping * v

        res = conjugate_gradient(
            matvec, b, max_iters=n, rtol=1e-8, preconditioner=approx.preconditioner(damping)
        )
        assert res.reason == "converged" and res.iterations < 30


def test_ggn_products_reproduce_the_dense_ggn():
    model, x, y = make_batch(MODELS[1], LOSSES[2])
    G = GGN(model, "cross_entropy", x, y)
    n = G.shape[0]
    dense = G.to_dense()
    g = torch.Generator().manual_seed(5)
    approx = nystrom(lambda v: G @ v, n, n, G.gradient, generator=g)
    torch.testing.assert_close(approx @ torch.eye(n, dtype=D), dense, rtol=0, atol=1e-10)


def test_products_loop_where_vmap_fails_and_agree_with_the_batched_ones():
    n = 30
    a = _psd(_decaying(n), seed=6)
    calls = []

    def not_vmappable(v):
        calls.append(float(v.norm()))  # data-dependent Python control: vmap refuses it
        return a @ v

    with pytest.raises(RuntimeError):
        torch.func.vmap(not_vmappable, in_dims=1)(torch.eye(n, dtype=D))
    calls.clear()
    looped = nystrom(not_vmappable, n, 10, a, generator=torch.Generator().manual_seed(0))
    assert len(calls) == 10  # one product per column
    batched = nystrom(
        lambda v: a @ v, n, 10, a, generator=torch.Generator().manual_seed(0), chunk_size=3
    )
    torch.testing.assert_close(looped.eigenvalues, batched.eigenvalues, rtol=1e-12, atol=0)
    torch.testing.assert_close(looped @ torch.eye(n, dtype=D), batched @ torch.eye(n, dtype=D))


def test_float32_products_give_a_float32_preconditioner():
    n = 50
    a = _psd(_decaying(n), seed=9)
    a32 = a.float()
    approx = nystrom(lambda v: a32 @ v, n, 20, a32, generator=torch.Generator().manual_seed(0))
    assert approx.eigenvalues.dtype == D
    v = torch.randn(n)
    out = approx.preconditioner(1e-4)(v)
    assert out.dtype == torch.float32
    exact = _dense(
        nystrom(
            lambda v: a @ v, n, 20, a, generator=torch.Generator().manual_seed(0)
        ).preconditioner(1e-4),
        n,
    )
    torch.testing.assert_close(out.double(), exact @ v.double(), rtol=1e-3, atol=1e-3)


def test_arguments_are_checked():
    a = _psd(_decaying(10))
    with pytest.raises(ValueError, match="rank"):
        nystrom(lambda v: a @ v, 10, 11, a)
    with pytest.raises(ValueError, match="rank"):
        nystrom(lambda v: a @ v, 10, 0, a)
    with pytest.raises(ValueError, match="damping"):
        nystrom(lambda v: a @ v, 10, 4, a).preconditioner(0.0)
    with pytest.raises(ValueError, match="positive"):
        nystrom(lambda v: -(a @ v), 10, 4, a)
    with pytest.raises(TypeError, match="preconditioner"):
        conjugate_gradient(lambda v: a @ v, torch.ones(10, dtype=D), max_iters=3, preconditioner=2)


# --- SGN(preconditioner="nystrom") ----------------------------------------------------------


def _fit_problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()  # 38 params
    x = torch.randn(40, 3, dtype=D)
    y = torch.randn(40, 2, dtype=D)
    return model, x, y


def test_sgn_nystrom_step_is_the_damped_gauss_newton_step():
    # A full-rank approximation makes P^-1 (G + rho I) the identity on G's range: CG then
    # reaches the dense float64 solution of (G + rho I) d = -g in a few iterations.
    model, x, y = _fit_problem()
    G, g, theta = dense_ggn(model, "mse", x, y)
    damping = 1e-3
    opt = SGN(
        model, "mse", solver="cg", preconditioner="nystrom", preconditioner_rank=theta.numel(),
        cg_iters=5, cg_tol=0.0, cg_rtol=1e-12, damping=damping, line_search=False,
        trust_region=False, geodesic_acceleration=False, reject_uphill=False,
    )  # fmt: skip
    info = opt.step(x, y)  # the plain step, whatever its loss (reject_uphill off)
    d = torch.linalg.solve(G + damping * torch.eye(theta.numel(), dtype=D), -g)
    moved = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - theta
    torch.testing.assert_close(moved, d, rtol=1e-7, atol=1e-10)
    assert info.stop_reason == "converged" and info.iterations <= 3


def test_sgn_nystrom_needs_fewer_iterations_than_plain_cg():
    model, x, y = _fit_problem(1)
    iterations = {}
    for kind in (False, "nystrom"):
        m = copy.deepcopy(model)
        opt = SGN(
            m, "mse", solver="cg", preconditioner=kind, preconditioner_rank=20, cg_iters=200,
            cg_tol=0.0, cg_rtol=1e-8, damping=1e-6, line_search=False, trust_region=False,
        )  # fmt: skip
        iterations[kind] = opt.step(x, y).iterations
    assert iterations["nystrom"] < iterations[False] / 2


def test_sgn_nystrom_is_rebuilt_every_preconditioner_every_steps(monkeypatch):
    import torch_sgn.solve.nystrom as nystrom_module

    builds = []
    real = nystrom_module.nystrom

    def counted(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(nystrom_module, "nystrom", counted)
    model, x, y = _fit_problem()
    opt = SGN(model, "mse", solver="cg", preconditioner="nystrom", preconditioner_rank=8,
              preconditioner_every=3)  # fmt: skip
    for _ in range(7):
        opt.step(x, y)
    assert len(builds) == 3  # steps 0, 3, 6
    copy.deepcopy(opt).step(x, y)  # a copy builds its own
    opt.load_state_dict(opt.state_dict())
    opt.step(x, y)
    assert len(builds) == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(preconditioner="kfac"), "preconditioner"),
        (dict(preconditioner="nystrom", preconditioner_rank=0), "preconditioner_rank"),
        (dict(preconditioner="nystrom", preconditioner_every=1.5), "preconditioner_every"),
    ],
)
def test_sgn_nystrom_options_are_checked(kwargs, match):
    model, _, _ = _fit_problem()
    with pytest.raises(ValueError, match=match):
        SGN(model, "mse", **kwargs)
