"""Loss callables built from torch.nn.functional, against the dense float64 reference.

The reference is independent of torch_sgn: ``J`` by ``torch.autograd.functional.jacobian`` of
the outputs w.r.t. the flat parameters, ``H`` by ``torch.autograd.functional.hessian`` of the
callable w.r.t. the outputs, ``G = J^T H J`` (:func:`cases.dense_ggn`).
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cases import BranchesOnValues, dense_ggn
from torch_sgn import GGN, SGN
from torch_sgn.engines.selection import select_engine
from torch_sgn.engines.traced.opaque_loss import calls_opaque_loss
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel

D = torch.float64
ENGINES = ["layerwise", "traced", "functional", "auto"]


class _TwoBlocks(nn.Module):
    """A physics-informed style loss of its own: a data block and a weighted residual block."""

    def __init__(self, weight: float = 0.5):
        super().__init__()
        self.weight = weight

    def forward(self, outputs, targets):
        data = F.mse_loss(outputs[:4], targets[:4])
        return data + self.weight * F.smooth_l1_loss(outputs[4:], targets[4:], beta=0.5)


class _ScaledMSE(nn.MSELoss):
    """A subclass of a loss module that the closed forms know, with a forward of its own."""

    def forward(self, outputs, targets):
        return 3.0 * F.mse_loss(outputs, targets) + ((outputs - targets) ** 4).mean()


def _half_var(t):
    return torch.full_like(t, 0.5)


# name -> (loss, targets): "real" (N, 2), "index" (N,), "unit" (N, 2) in [0, 1], "probs" rows
LOSSES = {
    "mse_loss": (lambda o, t: F.mse_loss(o, t), "real"),
    "mse_loss-sum": (lambda o, t: F.mse_loss(o, t, reduction="sum"), "real"),
    "mse_loss-blocks": (lambda o, t: F.mse_loss(o[:4], t[:4]) + 0.5 * F.mse_loss(o[4:], t[4:]),
                        "real"),
    "MSELoss-in-lambda": (lambda o, t: nn.MSELoss()(o, t), "real"),
    "l1_loss": (lambda o, t: F.l1_loss(o, t), "real"),
    "smooth_l1_loss": (lambda o, t: F.smooth_l1_loss(o, t, beta=0.8), "real"),
    "huber_loss": (lambda o, t: F.huber_loss(o, t, delta=0.5), "real"),
    "cross_entropy": (lambda o, t: F.cross_entropy(o, t), "index"),
    "cross_entropy-smoothed": (lambda o, t: F.cross_entropy(o, t, label_smoothing=0.1), "index"),
    "bce_with_logits": (lambda o, t: F.binary_cross_entropy_with_logits(o, t), "unit"),
    "binary_cross_entropy-of-sigmoid": (
        lambda o, t: F.binary_cross_entropy(torch.sigmoid(o), t), "unit"),
    "cross_entropy-probabilities": (lambda o, t: F.cross_entropy(o, t), "probs"),
    "multilabel_soft_margin_loss": (lambda o, t: F.multilabel_soft_margin_loss(o, t), "unit"),
    "log_cosh": (lambda o, t: torch.log(torch.cosh(o - t)).mean(), "real"),
    "gaussian_nll_loss": (lambda o, t: F.gaussian_nll_loss(o, t, _half_var(t)), "real"),
    "poisson_nll_loss": (lambda o, t: F.poisson_nll_loss(o, t), "unit"),
    "kl_div-log_softmax": (
        lambda o, t: F.kl_div(F.log_softmax(o, 1), t, reduction="batchmean"), "probs"),
    "weighted-blocks": (
        lambda o, t: 2.0 * F.mse_loss(o[:, :1], t[:, :1]) + 0.25 * F.huber_loss(o[:, 1:], t[:, 1:]),
        "real"),
    "module-of-its-own": (_TwoBlocks(), "real"),
    "MSELoss-subclass": (_ScaledMSE(), "real"),
}  # fmt: skip


def _batch(kind: str, dtype=D, n: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, 3, generator=g, dtype=dtype)
    if kind == "index":
        y = torch.randint(0, 2, (n,), generator=g)
    elif kind == "unit":
        y = torch.rand(n, 2, generator=g, dtype=dtype)
    elif kind == "probs":
        y = torch.softmax(torch.randn(n, 2, generator=g, dtype=dtype), 1)
    else:
        y = 1.5 * torch.randn(n, 2, generator=g, dtype=dtype)  # residuals on both sides of 1
    return model, x, y


@functools.cache
def _reference(name: str):
    loss, kind = LOSSES[name]
    model, x, y = _batch(kind)
    G_ref, g_ref, _ = dense_ggn(model, loss, x, y)
    return G_ref, g_ref


def _cases():
    for name in LOSSES:
        for engine in ENGINES:
            yield pytest.param(name, engine, id=f"{name}-{engine}")


@pytest.mark.parametrize("name,engine", list(_cases()))
def test_ggn_of_a_loss_callable_is_exactly_jt_h_j(name, engine):
    loss, kind = LOSSES[name]
    model, x, y = _batch(kind)
    G_ref, g_ref = _reference(name)
    G = GGN(model, loss, x, y, engine=engine)
    torch.testing.assert_close(G.loss, loss(model(x), y), rtol=1e-12, atol=0)
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G.to_dense(), G_ref, rtol=1e-10, atol=1e-12)


def test_a_loss_that_branches_on_values_runs_as_it_is_inside_the_traced_graphs():
    """F.gaussian_nll_loss checks torch.any(var < 0), which a trace cannot follow: the traced
    engine calls the loss from its graphs (the model's part stays traced), exactly, and the
    loss's own check still runs at every step."""
    loss, kind = LOSSES["gaussian_nll_loss"]
    model, x, y = _batch(kind)
    opt = SGN(model, loss, engine="traced", solver="cg")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hand-over to another engine
        info = opt.step(x, y)
    assert info.loss_after < info.loss
    (traced,) = opt._engine.engines[0]._cache.values()
    assert calls_opaque_loss(traced.setup) and calls_opaque_loss(traced.product)

    def negative_variance(o, t):
        return F.gaussian_nll_loss(o, t, torch.full_like(t, -0.5 if t.sum() > 0 else 0.5))

    model, x, y = _batch(kind)
    opt = SGN(model, negative_variance, engine="traced")
    opt.step(x, -y.abs())  # a variance of 0.5: traced, and a step taken
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="var has negative entry"):  # the loss's own check
        opt.step(x, y.abs())  # same shapes: the same graphs, the loss's check inside them
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_model_that_branches_on_values_is_refused_by_the_traced_engine_with_the_fix():
    model, x, y = _batch("real")
    model = BranchesOnValues().to(D)
    expected = r"branches on a tensor's values.*engine='auto' \(the default\)"
    with pytest.raises(ValueError, match=expected):
        GGN(model, "mse", x, y, engine="traced")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=expected):
        SGN(model, "mse", engine="traced").step(x, y)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_reference_hessians_have_curvature_where_the_losses_do():
    """The table is not vacuous: every loss but L1 has a nonzero G on its batch."""
    for name in LOSSES:
        G_ref, _ = _reference(name)
        eigenvalues = torch.linalg.eigvalsh(G_ref)
        assert eigenvalues.min() > -1e-12, name  # positive semi-definite
        assert (eigenvalues.max() > 1e-3) == (name != "l1_loss"), name


@pytest.mark.parametrize("name", list(LOSSES))
def test_layerwise_dense_matrix_of_a_loss_callable(name):
    """The layer-wise engine's own route to ``G`` (the output Jacobian, then ``H`` applied to
    its columns at once), taken by the direct solver where the batch has more outputs than
    the model has parameters."""
    loss, kind = LOSSES[name]
    model, x, y = _batch(kind)
    fmodel = FunctionalModel(model)
    lin = select_engine(fmodel, resolve_loss(loss), "layerwise")(fmodel.flat(), Batch(x, y))
    assert lin.dense_ggn is not None
    torch.testing.assert_close(lin.ggn_matrix(), _reference(name)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine", ["layerwise", "auto"])
def test_l1_loss_callable_direct_step_in_float32(engine):
    """float32, more outputs than parameters: the direct solver forms ``G`` from the output
    Jacobian, whose columns the Hessian products take at once. ``G = 0`` for L1, so the step is
    ``-lr g / damping``."""
    model, x, y = _batch("real", torch.float32, n=64)
    fn = lambda o, t: F.l1_loss(o, t)  # noqa: E731
    start = fn(model(x), y).item()
    opt = SGN(model, fn, solver="direct", engine=engine, damping=1.0, line_search=False)
    info = opt.step(x, y)
    assert info.solver == "direct"
    assert fn(model(x), y).item() < start


REGRESSION = [
    "mse_loss", "mse_loss-blocks", "MSELoss-in-lambda", "smooth_l1_loss", "huber_loss",
    "gaussian_nll_loss", "weighted-blocks", "module-of-its-own", "MSELoss-subclass",
]  # fmt: skip


@pytest.mark.parametrize("solver", ["cg", "direct"])
@pytest.mark.parametrize("name", REGRESSION)
def test_sgn_lowers_a_loss_callable_on_a_smooth_regression(name, solver):
    loss, _ = LOSSES[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 2)).to(D)
    x = torch.linspace(-2, 2, 40, dtype=D).unsqueeze(1)
    y = torch.cat([torch.sin(2 * x), torch.cos(x)], 1)
    start = loss(model(x), y).item()
    opt = SGN(model, loss, solver=solver, cg_iters=20)
    for _ in range(5):
        opt.step(x, y)
    assert loss(model(x), y).item() < 0.5 * start


def test_no_warning_for_a_loss_callable_without_closed_form():
    model, x, y = _batch("real")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GGN(model, LOSSES["huber_loss"][0], x, y).to_dense()
        GGN(model, LOSSES["mse_loss"][0], x, y).to_dense()


# --- a penalty on the parameters inside the loss ---------------------------------------------


def _penalized(model):
    def loss(outputs, targets):
        penalty = sum((p**2).sum() for p in model.parameters())
        return F.cross_entropy(outputs, targets) + 100 * penalty

    return loss


def test_a_penalty_on_the_parameters_inside_the_loss_is_refused_before_the_step():
    model, x, y = _batch("index")
    before = [p.detach().clone() for p in model.parameters()]
    opt = SGN(model, _penalized(model))
    with pytest.raises(ValueError, match=r"'loss'.*parameters.*weight_decay.*residual"):
        opt.step(x, y)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="not part of the Gauss-Newton model"):
        GGN(model, _penalized(model), x, y)


def test_a_penalty_on_one_trainable_parameter_is_refused():
    model, x, y = _batch("real")
    model[0].bias.requires_grad_(False)  # a frozen parameter may be read: it never moves
    frozen = lambda o, t: F.mse_loss(o, t) + model[0].bias.abs().sum()  # noqa: E731
    torch.testing.assert_close(
        GGN(model, frozen, x, y).to_dense(), dense_ggn(model, F.mse_loss, x, y)[0]
    )
    trained = lambda o, t: F.mse_loss(o, t) + model[2].weight.norm()  # noqa: E731
    with pytest.raises(ValueError, match="depends on the model's parameters"):
        GGN(model, trained, x, y)


def test_the_parameter_check_runs_once_per_loss(monkeypatch):
    import torch_sgn.losses as losses

    calls = []
    check = losses.parameters_read

    def counted(*args):
        calls.append(1)
        return check(*args)

    monkeypatch.setattr(losses, "parameters_read", counted)
    model, x, y = _batch("real")
    opt = SGN(model, lambda o, t: F.mse_loss(o, t))
    for _ in range(3):
        opt.step(x, y)
    assert len(calls) == 1


@pytest.mark.parametrize("option", ["cuda_graphs", "compile"])
def test_graphs_and_compile_do_not_apply_where_the_loss_runs_as_it_is(option, cpu_graph_captures):
    loss, kind = LOSSES["gaussian_nll_loss"]
    model, x, y = _batch(kind)
    eager = copy.deepcopy(model)
    opt = SGN(model, loss, engine="traced", **{option: True})
    with pytest.warns(UserWarning, match=f"{option}=True does not apply.*loss is called"):
        info = opt.step(x, y)
    assert cpu_graph_captures == []  # nothing captured
    expected = SGN(eager, loss, engine="traced").step(x, y)
    assert info.loss_after == expected.loss_after
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p, q)
