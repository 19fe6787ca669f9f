"""Mixed precision: SGN's steps and ``G v`` products under ``torch.autocast`` (bf16 on the CPU;
bf16 and fp16 on CUDA, where one is present), on the default engine (the layer-wise engine for
these chains)."""

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

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
#: (device, autocast dtype): CPU autocast takes bfloat16 alone.
PRECISIONS = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=_CUDA),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=_CUDA),
]


def _batch(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    return x.to(device), y.to(device)


@pytest.mark.parametrize("device, dtype", PRECISIONS)
@pytest.mark.parametrize("solver", ["cg", "auto"])
@pytest.mark.parametrize("build", MODELS)
def test_autocast_trains_on_the_default_engine(build, solver, device, dtype):
    x, y = _batch(device=device)
    model = build().to(device)
    opt = SGN(model, "cross_entropy", solver=solver)
    assert isinstance(opt._engine.engines[0], LayerwiseEngine)

    def handed_over(*args, **kwargs):
        raise AssertionError("the layer-wise engine handed the step over to another engine")

    opt._engine.engines[1:] = [handed_over]  # not routed elsewhere
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning on the way
        infos = []
        for _ in range(STEPS):
            with torch.autocast(device, dtype=dtype):
                infos.append(opt.step(x, y))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # kept in float32
    for info in infos:
        assert torch.isfinite(torch.tensor([info.loss, info.loss_after, info.grad_norm])).all()
        assert info.loss_after <= info.loss
    assert infos[-1].loss_after < 0.5 * infos[0].loss


@pytest.mark.parametrize("device, dtype", PRECISIONS)
@pytest.mark.parametrize("build", MODELS)
def test_autocast_product_matches_the_float64_reference(build, device, dtype):
    """``G v`` under autocast against the dense float64 ``J^T H J`` (on the CPU): equal to the
    autocast dtype's precision (bf16's 8-bit mantissa: a relative error of a few 1e-3 per
    operation; fp16's 11 bits, finer)."""
    x, y = _batch()
    model = build()
    reference = build().double()
    reference.load_state_dict(model.state_dict())
    G, _, _ = dense_ggn(reference, "cross_entropy", x.double(), y)
    v = torch.randn(G.shape[0])
    model, x, y = model.to(device), x.to(device), y.to(device)
    with torch.autocast(device, dtype=dtype):
        Gv = GGN(model, "cross_entropy", x, y, engine="layerwise") @ v.to(device)
    assert Gv.dtype == torch.float32
    expected = G @ v.double()
    Gv = Gv.cpu()
    error = torch.linalg.vector_norm(Gv.double() - expected) / torch.linalg.vector_norm(expected)
    assert error < 3e-2


@pytest.mark.parametrize("device, dtype", PRECISIONS)
def test_a_grad_scaler_is_refused_with_what_to_use_instead(device, dtype):
    x, y = _batch(device=device)
    model = _mlp().to(device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = SGN(model, "cross_entropy")
    scaler = torch.amp.GradScaler(device)
    with torch.autocast(device, dtype=dtype):  # a torch.amp training loop, ported to SGN
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    with pytest.raises(TypeError, match=r"GradScaler.*torch\.autocast alone.*bf16-mixed"):
        with torch.autocast(device, dtype=dtype):
            scaler.step(opt, x, y)
    for p, q in zip(model.parameters(), before):  # nothing changed
        assert torch.equal(p, q)
    with torch.autocast(device, dtype=dtype):  # without the scaler, SGN steps as before
        info = opt.step(x, y)
    assert info.loss_after < info.loss
