"""What a loss object knows besides its value: reduction, normalizer, closed-form Hessian."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cases import LOSSES, MODELS, make_batch
from torch_sgn.losses import resolve_loss

W = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)

# (name, loss, targets kind) beyond the shared table: the generic wrappers of torch.nn modules.
EXTRA = [
    ("CE-weight-sum-ignore", nn.CrossEntropyLoss(weight=W, reduction="sum"), "index-ignored"),
    ("CE-weight-ignore-7", nn.CrossEntropyLoss(weight=W, ignore_index=2), "index"),
    ("CE-weight-probs", nn.CrossEntropyLoss(weight=W), "probs"),
    ("NLL-weight", nn.NLLLoss(weight=W), "index-ignored"),
    ("BCE-pos-weight", nn.BCEWithLogitsLoss(pos_weight=W.view(3, 1)), "binary"),
    ("Huber", nn.HuberLoss(), "real"),
    ("KLDiv-batchmean", nn.KLDivLoss(reduction="batchmean"), "probs"),
    ("KLDiv-sum", nn.KLDivLoss(reduction="sum"), "probs"),
]
TABLE = [(c.name, c.make(), c.targets) for c in LOSSES if not callable(c.make()) or
         isinstance(c.make(), nn.Module)] + EXTRA  # fmt: skip


def _as_module(loss):
    return {"mse": nn.MSELoss(), "cross_entropy": nn.CrossEntropyLoss(),
            "bce_with_logits": nn.BCEWithLogitsLoss()}.get(loss, loss)  # fmt: skip


def _with_reduction(module, reduction):
    other = copy.deepcopy(module)
    other.reduction = reduction
    return other


@pytest.mark.filterwarnings(
    "ignore:nn.KLDivLoss is linear",
    "ignore:nn.NLLLoss is linear",
    "ignore:reduction. .mean. divides",
)
@pytest.mark.parametrize("name,loss,kind", TABLE, ids=[t[0] for t in TABLE])
def test_normalizer_is_what_torchs_mean_divides_by(name, loss, kind):
    case = next(c for c in LOSSES if c.targets == kind)
    _, _, y = make_batch(MODELS[2], case)  # (N, C, L) outputs: the extra dimension counts too
    z = torch.randn(y.shape if y.is_floating_point() else (*y.shape[:1], 3, *y.shape[1:]),
                    dtype=torch.float64)  # fmt: skip
    module = _as_module(loss)
    mean = "batchmean" if module.reduction == "batchmean" else "mean"
    total = _with_reduction(module, "sum")(z, y)
    expected = (total / _with_reduction(module, mean)(z, y)).item()
    out = resolve_loss(loss)
    assert out.normalizer(y) == pytest.approx(expected, rel=1e-12)
    assert out.reduction == ("sum" if module.reduction == "sum" else "mean")
    assert out.normalizer(y[:0]) == 0


def test_a_callable_is_a_mean_over_samples():
    out = resolve_loss(lambda z, t: (z - t).square().mean())
    assert out.reduction == "mean" and out.normalizer(torch.zeros(7, 2)) == 7


def test_closed_form_hessians_are_the_named_losses_without_weights():
    assert all(resolve_loss(n).closed_form for n in ("mse", "cross_entropy", "bce_with_logits"))
    assert resolve_loss(nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1)).closed_form
    assert not resolve_loss(nn.CrossEntropyLoss(weight=W)).closed_form
    assert not resolve_loss(nn.BCEWithLogitsLoss(pos_weight=W)).closed_form
    assert not resolve_loss(F.mse_loss).closed_form


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_hessian_on_multi_hot_rows_matches_autograd(smoothing, reduction):
    """Rows summing to 0, 1, 2 and 3, with a non-default ignore_index (unused by floats)."""
    z = torch.randn(4, 3, 2, dtype=torch.float64)
    y = torch.tensor([[0.0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    y = y.unsqueeze(-1).expand(4, 3, 2)
    loss = resolve_loss(nn.CrossEntropyLoss(reduction=reduction, label_smoothing=smoothing))
    fn = lambda z_: F.cross_entropy(z_, y, reduction=reduction, label_smoothing=smoothing)  # noqa: E731
    H = torch.autograd.functional.hessian(fn, z).reshape(z.numel(), z.numel())
    U = torch.eye(z.numel(), dtype=torch.float64).view(-1, *z.shape)
    product = loss.hessian(z, y)
    dense = torch.stack([product(u).reshape(-1) for u in U], 1)
    torch.testing.assert_close(dense, H, rtol=1e-12, atol=1e-14)
