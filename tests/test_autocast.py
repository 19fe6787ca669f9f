"""Mixed precision: SGN's steps and ``G v`` products under ``torch.autocast`` (bf16 on the CPU),
on the default engine (the layer-wise engine for these chains)."""

import warnings

import pytest
import torch
from torch import nn

from cases import dense_ggn
from torch_sgn import GGN, SGN
from torch_sgn.engines.layerwise.engine import LayerwiseEngine

STEPS = 5


def _cnn():
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3, stride=2), nn.Tanh(),
        nn.Flatten(), nn.Linear(18, 4),
    )  # fmt: skip


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))


MODELS = [pytest.param(_cnn, id="cnn"), pytest.param(_mlp, id="mlp")]


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


@pytest.mark.parametrize("solver", ["cg", "auto"])
@pytest.mark.parametrize("build", MODELS)
def test_bf16_autocast_trains_on_the_default_engine(build, solver):
    x, y = _batch()
    model = build()
    opt = SGN(model, "cross_entropy", solver=solver)
    assert isinstance(opt._engine.engines[0], LayerwiseEngine)

    def handed_over(*args, **kwargs):
        raise AssertionError("the layer-wise engine handed the step over to another engine")

    opt._engine.engines[1:] = [handed_over]  # not routed elsewhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning on the way
        infos = []
        for _ in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                infos.append(opt.step(x, y))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # kept in float32
    for info in infos:
        assert torch.isfinite(torch.tensor([info.loss, info.loss_after, info.grad_norm])).all()
        assert info.loss_after <= info.loss
    assert infos[-1].loss_after < 0.5 * infos[0].loss


@pytest.mark.parametrize("build", MODELS)
def test_bf16_autocast_product_matches_the_float64_reference(build):
    """``G v`` under bf16 autocast against the dense float64 ``J^T H J``: equal to bf16's
    precision (its 8-bit mantissa: a relative error of a few 1e-3 per operation)."""
    x, y = _batch()
    model = build()
    reference = build().double()
    reference.load_state_dict(model.state_dict())
    G, _, _ = dense_ggn(reference, "cross_entropy", x.double(), y)
    v = torch.randn(G.shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        Gv = GGN(model, "cross_entropy", x, y, engine="layerwise") @ v
    assert Gv.dtype == torch.float32
    expected = G @ v.double()
    error = torch.linalg.vector_norm(Gv.double() - expected) / torch.linalg.vector_norm(expected)
    assert error < 3e-2
