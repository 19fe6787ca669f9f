"""The fast layer-wise engine against the functional engine and the dense reference."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cases import MODELS, dense_ggn
from torch_sgn import GGN, SGN
from torch_sgn.engines.functional import FunctionalEngine
from torch_sgn.engines.layerwise.engine import LayerwiseEngine, Unsupported, plan
from torch_sgn.engines.layerwise.rules import RULES
from torch_sgn.experiments.models import PRESETS
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel

D = torch.float64


def _batch(model, in_shape, n, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *in_shape), generator=g, dtype=D)
    with torch.no_grad():
        out = model(x)
    if kind == "index":
        return x, torch.randint(0, out.shape[1], (n, *out.shape[2:]), generator=g)
    return x, torch.randn(out.shape, generator=g, dtype=D)


def _assert_engines_agree(model, loss, x, y, n_vectors=2):
    fast = GGN(model, loss, x, y, engine="layerwise")
    ref = GGN(model, loss, x, y, engine="functional")
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(fast.gradient, ref.gradient, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    for _ in range(n_vectors):
        v = torch.randn(fast.shape[0], generator=g, dtype=D)
        torch.testing.assert_close(fast @ v, ref @ v, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fast_engine_matches_functional_on_paper_models(name):
    p = PRESETS[name]
    model = p.build().to(D)
    x, y = _batch(model, p.input_shape, 6, "index" if p.loss == "cross_entropy" else "real")
    _assert_engines_agree(model, p.loss, x, y)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sgn_picks_the_fast_engine_for_paper_models(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = SGN(PRESETS[name].build(), PRESETS[name].loss)
    layerwise = opt._engine.engines[0]  # the first of the chain auto tries
    assert isinstance(layerwise, LayerwiseEngine) and layerwise._steps is not None


@pytest.mark.parametrize("case", MODELS, ids=[m.name for m in MODELS])
def test_shared_case_models_are_planned(case):
    plan(FunctionalModel(case.build()))  # so the engine-parametrized core tests run it


def _zoo():
    """(name, model, input shape, target kind): every supported layer type at least once."""
    acts = [
        nn.Sigmoid(), nn.Tanh(), nn.ReLU(), nn.LeakyReLU(0.1), nn.ELU(0.7), nn.Hardtanh(-0.5, 0.5),
        nn.ReLU6(), nn.Softplus(beta=2.0), nn.GELU(), nn.GELU("tanh"), nn.SiLU(), nn.Mish(),
        nn.Softsign(), nn.LogSigmoid(), nn.Tanhshrink(), nn.Identity(),
    ]  # fmt: skip
    mlp = nn.Sequential(nn.Linear(3, 6))
    for a in acts:
        mlp.append(a)
        mlp.append(nn.Linear(6, 6, bias=len(mlp) % 4 == 1))
    mlp.append(nn.Linear(6, 2))
    conv1d = nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2, padding=1, padding_mode="circular"),
        nn.ReLU(inplace=True),
        nn.MaxPool1d(2, ceil_mode=True),
        nn.Conv1d(4, 4, 2, dilation=2, groups=2),
        nn.AvgPool1d(2),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(4, 3),
    )
    conv2d = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Sequential(nn.Conv2d(3, 2, 2, bias=False), nn.Sigmoid()),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Unflatten(1, (2, 4)),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    conv3d = nn.Sequential(
        nn.Conv3d(1, 2, 2), nn.ELU(), nn.MaxPool3d(2), nn.AvgPool3d(1), nn.AdaptiveAvgPool3d(1),
        nn.Flatten(), nn.Linear(2, 2),
    )  # fmt: skip
    avg_pools = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.AvgPool2d(2, stride=1), nn.Sigmoid(), nn.Flatten(2),
        nn.AdaptiveAvgPool1d(3), nn.Flatten(), nn.Linear(6, 2),
    )  # fmt: skip
    return [
        ("mlp-all-activations", mlp, (3,), "real"),
        ("conv1d-pool-dropout", conv1d.eval(), (2, 16), "index"),
        ("conv2d-nested", conv2d, (1, 7, 7), "index"),
        ("conv3d", conv3d, (1, 5, 5, 5), "real"),
        ("bare-linear", nn.Linear(4, 2), (4,), "real"),
        ("avg-pools", avg_pools, (1, 6, 6), "real"),
    ] + _by_hand_zoo()


def _by_hand_zoo():
    """Convolution chains whose every layer has a hand-made cotangent (no autograd graph):
    zero padding in numbers or "valid", strides, dilations, groups, no bias, overlapping and
    padded max-pooling windows (one input picked by two windows), ceil mode."""
    conv1d = nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.MaxPool1d(3, stride=1, ceil_mode=True),
        nn.Conv1d(4, 4, 2, dilation=2, groups=2, bias=False),
        nn.Flatten(),
        nn.Dropout(0.3),
        nn.Linear(16, 3),
    )
    conv2d = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding="valid"),
        nn.Tanh(),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(4, 2, 2, stride=(1, 2), dilation=(2, 1), groups=2),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    conv3d = nn.Sequential(
        nn.Conv3d(1, 2, 2, padding=1), nn.Softplus(), nn.MaxPool3d(2, stride=1),
        nn.Flatten(), nn.Linear(2 * 64, 2),
    )  # fmt: skip
    return [
        ("by-hand-conv1d", conv1d.eval(), (2, 15), "index"),
        ("by-hand-conv2d", conv2d, (1, 9, 9), "index"),
        ("by-hand-conv3d", conv3d, (1, 4, 4, 4), "real"),
    ]


@pytest.mark.parametrize(
    "name,model,in_shape,kind", _by_hand_zoo(), ids=[z[0] for z in _by_hand_zoo()]
)
def test_zero_padded_conv_chains_run_by_hand_and_others_through_autograd(
    name, model, in_shape, kind
):
    assert all(step.by_hand for step in plan(FunctionalModel(model)))


def test_other_paddings_and_average_pooling_go_through_autograd():
    for other in (
        nn.Conv2d(1, 2, 4, padding="same"),  # pads unevenly before the convolution
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.AvgPool2d(2)),
    ):
        assert not all(step.by_hand for step in plan(FunctionalModel(nn.Sequential(other))))


def _assert_matches_reference(lin, model, loss, x, y):
    G_ref, g_ref, _ = dense_ggn(model, loss, x, y)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    columns = [lin.ggn_vp(e) for e in torch.eye(len(g_ref), dtype=D)]
    torch.testing.assert_close(torch.stack(columns, 1), G_ref, rtol=1e-9, atol=1e-11)


def test_convolution_settings_changed_after_planning_are_followed():
    # One engine across the change, as in an optimizer: the plan stays, the settings are read
    # at every step.
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 2, 3, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(2 * 9, 2)).to(D)
    x, y = torch.randn(4, 1, 6, 6, dtype=D), torch.randn(4, 2, dtype=D)
    fmodel = FunctionalModel(model)
    engine = LayerwiseEngine(fmodel, resolve_loss("mse"), strict=True)
    conv.stride = (2, 2)
    _assert_matches_reference(engine(fmodel.flat(), Batch(x, y)), model,
                              "mse", x, y)  # fmt: skip
    conv.padding_mode = "reflect"  # now through autograd, with the reflected padding
    _assert_matches_reference(engine(fmodel.flat(), Batch(x, y)), model,
                              "mse", x, y)  # fmt: skip


def test_unbatched_convolution_by_hand():
    # The 5 "samples" are the convolution's 5 channels; its output's 4 channels are the loss's
    # rows (aten's convolution backward wants a batch dimension, added and removed by hand).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(5, 4, 3), nn.Tanh(), nn.Linear(6, 2)).to(D)
    x = torch.randn(5, 8, dtype=D)
    y = torch.randn(4, 2, dtype=D)
    fmodel = FunctionalModel(model)
    lin = LayerwiseEngine(fmodel, resolve_loss("mse"), strict=True)(fmodel.flat(), Batch(x, y))
    assert all(step.by_hand for step in plan(fmodel))
    _assert_matches_reference(lin, model, "mse", x, y)


def test_frozen_weight_with_a_trainable_bias_before_pooling():
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 2, 3)
    conv.weight.requires_grad_(False)
    model = nn.Sequential(conv, nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 2)).to(D)
    x, y = _batch(model, (1, 6, 6), 4, "real")
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    G = GGN(model, "mse", x, y, engine="layerwise")
    torch.testing.assert_close(G.to_dense(), G_ref, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,model,in_shape,kind", _zoo(), ids=[z[0] for z in _zoo()])
def test_fast_engine_matches_dense_reference_on_every_layer_type(name, model, in_shape, kind):
    torch.manual_seed(0)
    model = model.to(D)
    x, y = _batch(model, in_shape, 5, kind)
    loss = "cross_entropy" if kind == "index" else "mse"
    G_ref, g_ref, _ = dense_ggn(model, loss, x, y)
    G = GGN(model, loss, x, y, engine="layerwise")
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G.to_dense(), G_ref, rtol=1e-9, atol=1e-11)


def _trial_cases():
    torch.manual_seed(0)
    dropout = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2))
    return _zoo() + [("mlp-training-dropout", dropout, (3,), "real")]


@pytest.mark.parametrize(
    "name,model,in_shape,kind", _trial_cases(), ids=[z[0] for z in _trial_cases()]
)
def test_trial_point_loss_is_a_plain_forward_pass_with_the_steps_random_numbers(
    name, model, in_shape, kind
):
    model = model.to(D)
    x, y = _batch(model, in_shape, 7, kind)
    loss = resolve_loss("cross_entropy" if kind == "index" else "mse")
    fmodel = FunctionalModel(model)
    if model.training:
        fmodel.freeze_rng()  # the functional forward passes below replay the step's masks
    flat = fmodel.flat()
    lin = LayerwiseEngine(fmodel, loss, strict=True)(flat, Batch(x, y))
    assert lin.value_at is not None
    torch.testing.assert_close(lin.value_at(flat), lin.loss, rtol=1e-12, atol=0)
    g = torch.Generator().manual_seed(2)
    for scale in (0.1, 1.0):
        other = flat + scale * torch.randn(flat.shape, generator=g, dtype=D)
        expected = loss.value(fmodel(other, x), y)
        torch.testing.assert_close(lin.value_at(other), expected, rtol=1e-12, atol=1e-14)


def test_frozen_and_tied_parameters():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), shared, nn.Tanh(), shared, nn.Linear(4, 2))
    model = model.to(D)
    model[0].bias.requires_grad_(False)
    model[5].weight.requires_grad_(False)
    x, y = _batch(model, (3,), 5, "real")
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    G = GGN(model, "mse", x, y, engine="layerwise")
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G.to_dense(), G_ref, rtol=1e-9, atol=1e-11)


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x).tanh()


class _OwnForward(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 2


def _hooked():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[1].register_forward_hook(lambda m, i, o: o * 3)
    return model


def _backward_hooked():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2].register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] / 2,))
    return model


@pytest.mark.parametrize(
    "build,why",
    [
        (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)), "BatchNorm"),
        (_Custom, "not an nn.Sequential"),
        (lambda: _OwnForward(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "overrides"),
        (_hooked, "hooks"),
        (_backward_hooked, "backward hooks"),
        (lambda: nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)), "PReLU"),
    ],
    ids=[
        "batchnorm",
        "custom-module",
        "custom-forward",
        "hooks",
        "backward-hooks",
        "unknown-layer",
    ],
)
def test_models_the_fast_engine_cannot_plan_go_to_the_traced_engine_and_stay_exact(build, why):
    torch.manual_seed(0)
    model = build().to(D)
    x, y = _batch(model, (3,), 8, "real")
    with pytest.raises(ValueError, match=why):
        SGN(model, "mse", engine="layerwise")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        auto = SGN(copy.deepcopy(model), "mse", engine="auto", cg_iters=3)
        for _ in range(3):
            auto.step(x, y)
    assert not [r for r in record if "engine" in str(r.message)]  # the traced engine took it
    ref = SGN(model, "mse", engine="functional", cg_iters=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # backward hooks: the notice of double backward
        for _ in range(3):
            ref.step(x, y)
    for p, q in zip(auto._fmodel.params, ref._fmodel.params):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_model_changed_after_construction_is_planned_again():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, y = _batch(model, (3,), 8, "real")
    opt = SGN(model, "mse", engine="auto")
    opt.step(x, y)
    model[1].register_forward_hook(lambda m, i, o: o * 0)  # kills the gradient of model[0]
    lin = opt._engine(opt._fmodel.flat(), Batch(x, y))  # the traced engine runs the hook
    assert lin.grad[: 3 * 4 + 4].abs().max() == 0
    model[1]._forward_hooks.clear()
    model[2].register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 0,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice: J v by double backward
        lin = opt._engine(opt._fmodel.flat(), Batch(x, y))  # planned again: the hook runs
    # model[0] gets nothing through the hook; model[2]'s weight does (with the forward hook
    # still in place it would not: its input would be zero)
    assert lin.grad[: 3 * 4 + 4].abs().max() == 0 and lin.grad[16 : 16 + 8].abs().max() > 0


def test_a_changed_layer_setting_is_planned_again():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LeakyReLU(0.1), nn.Linear(4, 2)).to(D)
    x, y = _batch(model, (3,), 8, "real")
    opt = SGN(model, "mse", engine="layerwise")
    for slope in (0.1, 0.5):
        model[1].negative_slope = slope
        lin = opt._engine(opt._fmodel.flat(), Batch(x, y))
        assert torch.equal(lin.loss, F.mse_loss(model(x), y))
        reference = FunctionalEngine(opt._fmodel, resolve_loss("mse"))(
            opt._fmodel.flat(), Batch(x, y)
        )
        v = torch.randn(opt._fmodel.numel, dtype=D)
        torch.testing.assert_close(lin.ggn_vp(v), reference.ggn_vp(v), rtol=1e-9, atol=1e-11)


def _flip(module, inputs, output):  # control flow on values: no engine can trace it
    return output if output.sum() > 0 else -output


def test_warnings_name_the_users_line():
    """From a step (through torch's step wrapper and no_grad), from a constructor, and from a
    re-plan in a later step: each warning is attributed to this file."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)).to(D)
    model[1].register_forward_hook(_flip)
    x, y = _batch(model, (3,), 8, "real")
    chain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        SGN(model, "mse").step(x, y)
        GGN(model, "mse", x, y)
        SGN(chain, "mse", cuda_graphs=True).step(x, y)  # graphs do not apply on the CPU
        opt = SGN(chain, "mse")
        opt.step(x, y)
        chain[1].register_forward_hook(_flip)
        opt.step(x, y)  # planned again, then traced: neither applies
    record = [r for r in record if "engine" in str(r.message) or "cuda_graphs" in str(r.message)]
    messages = [str(r.message) for r in record]
    assert len(messages) == 4, messages
    assert all("cannot trace" in messages[i] for i in (0, 1, 3)), messages
    assert "cuda_graphs=True does not apply" in messages[2]
    assert [r.filename for r in record] == [__file__] * 4


#: every dropout type, each on a sample shape it drops over (whole channels where it does)
_DROPOUTS = [
    (nn.Dropout(0.5), (8,)),
    (nn.Dropout1d(0.5), (2, 4)),
    (nn.Dropout2d(0.5), (2, 2, 2)),
    (nn.Dropout3d(0.5), (2, 2, 1, 2)),
]


@pytest.mark.parametrize("dropout,shape", _DROPOUTS, ids=[type(d).__name__ for d, _ in _DROPOUTS])
def test_training_mode_dropout_matches_functional_engine_and_random_state(dropout, shape):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 8), nn.Unflatten(1, shape), dropout, nn.Flatten(), nn.Tanh(), nn.Linear(8, 2)
    ).to(D)
    x, y = _batch(model, (3,), 16, "real")
    twin = copy.deepcopy(model)
    states = []
    for m, engine in ((model, "layerwise"), (twin, "functional")):
        torch.manual_seed(3)
        opt = SGN(m, "mse", engine=engine, cg_iters=5, solver="cg")
        infos = [opt.step(x, y) for _ in range(3)]
        states.append(torch.get_rng_state())
    torch.testing.assert_close(dict(model.named_parameters()), dict(twin.named_parameters()))
    assert torch.equal(states[0], states[1])
    assert infos[-1].loss_after < infos[0].loss


def test_eval_mode_dropout_is_the_identity():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2)).to(D)
    model.eval()
    x, y = _batch(model, (3,), 6, "real")
    G_ref, _, _ = dense_ggn(model, "mse", x, y)
    torch.testing.assert_close(GGN(model, "mse", x, y, engine="layerwise").to_dense(), G_ref)


_WEIGHT = torch.tensor([1.0, 3.0, 0.5, 2.0], dtype=D)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["closed-form", "class-weights"])
@pytest.mark.parametrize("engine", ["layerwise", "functional"])
def test_curvature_subset_is_the_scaled_ggn_of_a_seeded_subset(reduction, weighted, engine):
    """A sum over a quarter of the batch is scaled by 4, a mean is not, whichever path the
    loss takes (class weights go through the generic autograd wrapper)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Sigmoid(), nn.Linear(5, 4)).to(D)
    x, y = _batch(model, (3,), 20, "index")
    loss = nn.CrossEntropyLoss(weight=_WEIGHT if weighted else None, reduction=reduction)
    opt = SGN(model, loss, engine=engine, curvature_fraction=0.25)
    step = 3  # the subset of step t comes from a generator seeded with t
    lin = opt._stepper.engine_for(step)(opt._fmodel.flat(), Batch(x, y))
    idx = torch.randperm(20, generator=torch.Generator().manual_seed(step))[:5].sort().values
    G_sub, _, _ = dense_ggn(model, loss, x[idx], y[idx])
    _, g_full, _ = dense_ggn(model, loss, x, y)
    scale = 4.0 if reduction == "sum" else 1.0
    v = torch.randn(G_sub.shape[0], dtype=D)
    torch.testing.assert_close(lin.ggn_vp(v), scale * G_sub @ v, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(lin.grad, g_full, rtol=1e-10, atol=1e-12)


def test_engine_arguments_are_checked():
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="invalid engine"):
        SGN(model, "mse", engine="jit")
    with pytest.raises(ValueError, match="invalid curvature_fraction"):
        SGN(model, "mse", curvature_fraction=0.0)
    with pytest.raises(ValueError, match="invalid engine"):
        GGN(model, "mse", torch.ones(2, 2), torch.ones(2, 1), engine="jit")


def test_unsupported_exception_is_internal():
    with pytest.raises(Unsupported):
        plan(FunctionalModel(_Custom()))


def test_frozen_first_layer_takes_no_cotangent_but_later_layers_do():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.Sigmoid(), nn.Linear(4, 3)).to(D)
    model[1].requires_grad_(False)
    x, y = _batch(model, (2, 3), 5, "index")
    G_ref, g_ref, _ = dense_ggn(model, "cross_entropy", x, y)
    G = GGN(model, "cross_entropy", x, y, engine="layerwise")
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G.to_dense(), G_ref, rtol=1e-9, atol=1e-11)


def test_every_registered_layer_type_is_checked_here():
    # A new rule in the registry must come with a model in the zoo (checked against the dense
    # reference) or, for dropout, a case in the dropout test.
    models = [case[1] for case in _trial_cases()] + [d for d, _ in _DROPOUTS]
    checked = {type(m) for model in models for m in model.modules()}
    assert set(RULES) - checked == set()


def test_the_former_engine_name_fast_is_the_layerwise_engine_with_a_warning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    with pytest.warns(FutureWarning, match="engine='layerwise'"):
        old = GGN(model, "mse", x, y, engine="fast")
    with pytest.warns(FutureWarning, match="engine='layerwise'"):
        SGN(model, "mse", engine="fast")
    new = GGN(model, "mse", x, y, engine="layerwise")
    torch.testing.assert_close(old.to_dense(), new.to_dense(), rtol=0, atol=0)
