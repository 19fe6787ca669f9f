import functools

import pytest
import torch
from torch import nn

from cases import LOSSES, MODELS, dense_ggn, make_batch
from torch_sgn import GGN

pytestmark = pytest.mark.usefixtures("each_engine")  # every test, once per engine

CASES = [(m, lc) for m in MODELS for lc in LOSSES]
IDS = [f"{m.name}-{lc.name}" for m, lc in CASES]


@functools.cache
def _ggn_of_case(model_case, loss_case, engine):
    """(model, x, y, G, G's dense matrix) of one case on one engine, built once for the tests
    below (the dense matrix is one product per parameter)."""
    model, x, y = make_batch(model_case, loss_case)
    G = GGN(model, loss_case.make(), x, y, engine=engine)
    return model, x, y, G, G.to_dense()


@pytest.mark.parametrize("model_case,loss_case", CASES, ids=IDS)
def test_ggn_matches_dense_jacobian_reference(model_case, loss_case, each_engine):
    model, x, y, G, dense = _ggn_of_case(model_case, loss_case, each_engine)
    G_ref, g_ref, _ = dense_ggn(model, loss_case.make(), x, y)
    assert G.shape == G_ref.shape
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)
    v = torch.randn(G.shape[0], dtype=torch.float64)
    torch.testing.assert_close(G @ v, G_ref @ v, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("model_case,loss_case", CASES, ids=IDS)
def test_ggn_is_symmetric_positive_semidefinite(model_case, loss_case, each_engine):
    dense = _ggn_of_case(model_case, loss_case, each_engine)[-1]
    torch.testing.assert_close(dense, dense.T, rtol=1e-10, atol=1e-12)
    eigs = torch.linalg.eigvalsh(dense)
    assert eigs.min() >= -1e-10 * max(1.0, eigs.max().item())


def test_ggn_vector_order_matches_parameters_to_vector():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    G = GGN(model, "mse", x, y)
    g = torch.func.grad(
        lambda p: torch.nn.functional.mse_loss(torch.func.functional_call(model, p, (x,)), y)
    )(dict(model.named_parameters()))
    expected = nn.utils.parameters_to_vector(g.values())
    torch.testing.assert_close(G.gradient, expected)


def test_ggn_skips_frozen_parameters():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    model[0].weight.requires_grad_(False)
    G = GGN(model, "mse", x, y)
    assert G.shape[0] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_ggn_rejects_wrong_vector_length():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    G = GGN(model, "mse", x, y)
    with pytest.raises(ValueError, match="cannot multiply"):
        G @ torch.ones(3, dtype=torch.float64)


def test_ggn_with_dropout_uses_one_mask_for_every_product():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2)).double()
    x, y = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    dense = GGN(model, "mse", x, y).to_dense()
    # Different masks for J and J^T would break symmetry.
    torch.testing.assert_close(dense, dense.T, rtol=1e-10, atol=1e-12)


def test_ggn_leaves_batchnorm_buffers_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    before = {k: b.clone() for k, b in model.named_buffers()}
    G = GGN(model, "mse", x, y)
    G @ torch.randn(G.shape[0], dtype=torch.float64)
    for k, b in model.named_buffers():
        assert torch.equal(b, before[k]), k


@pytest.mark.filterwarnings("ignore:forward-mode AD has no rule for huber_loss_backward")
@pytest.mark.parametrize("kind", ["nll", "l1"])
def test_losses_linear_in_the_outputs_warn_that_their_ggn_is_zero(kind):
    """NLLLoss on log-probabilities and L1Loss have no curvature in the outputs: G = 0, as the
    warning says (checked against the dense reference), with the fix it names."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=torch.float64)
    logits = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    if kind == "nll":
        model, loss, y = nn.Sequential(logits, nn.LogSoftmax(1)), nn.NLLLoss(), torch.arange(6) % 4
        match, fix, fixed_model = "NLLLoss is linear.*'cross_entropy'", "cross_entropy", logits
    else:
        model, loss, y = logits, nn.L1Loss(), torch.randn(6, 4, dtype=torch.float64)
        match, fix, fixed_model = "L1Loss is piecewise linear.*HuberLoss", nn.HuberLoss(), logits
    with pytest.warns(UserWarning, match=match):
        G = GGN(model, loss, x, y)
    G_ref, g_ref, _ = dense_ggn(model, loss, x, y)
    assert torch.count_nonzero(G_ref) == 0 and torch.count_nonzero(G.to_dense()) == 0
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    G_ref, _, _ = dense_ggn(fixed_model, fix, x, y)
    assert G_ref.abs().max() > 1e-3
    torch.testing.assert_close(GGN(fixed_model, fix, x, y).to_dense(), G_ref, rtol=1e-9, atol=1e-11)


def test_kl_div_batchmean_is_supported_and_warns_that_its_ggn_is_zero():
    """KLDivLoss is linear in its input, so G = J^T 0 J; the warning names the user's line
    and the fix, whose G (softmax inside the loss) matches the dense reference."""
    model, x, y = make_batch(MODELS[0], LOSSES[5])  # probability targets
    with pytest.warns(UserWarning, match="KLDivLoss is linear.*log_softmax") as record:
        G = GGN(nn.Sequential(model, nn.LogSoftmax(1)), nn.KLDivLoss(reduction="batchmean"), x, y)
    assert [r.filename for r in record if "KLDivLoss" in str(r.message)] == [__file__]
    G_ref, g_ref, _ = dense_ggn(
        nn.Sequential(model, nn.LogSoftmax(1)), nn.KLDivLoss(reduction="batchmean"), x, y
    )
    assert torch.count_nonzero(G_ref) == 0 and torch.count_nonzero(G.to_dense()) == 0
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)

    def fix(z, t):
        return nn.functional.kl_div(nn.functional.log_softmax(z, dim=1), t, reduction="batchmean")

    G_ref, g_ref, _ = dense_ggn(model, fix, x, y)
    assert G_ref.abs().max() > 1e-3
    torch.testing.assert_close(GGN(model, fix, x, y).to_dense(), G_ref, rtol=1e-9, atol=1e-11)
