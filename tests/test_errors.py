"""Bad input: a clear error, and the step leaves everything as it was."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from cases import LOSSES, MODELS, make_batch
from torch_sgn import GGN, SGN

pytestmark = pytest.mark.usefixtures("each_engine")  # every test, once per engine


def _snapshot(model, opt):
    return (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        torch.get_rng_state(),
    )


def _assert_unchanged(model, opt, snap):
    params, state, rng = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    assert _state_equal(opt.state_dict(), state)
    assert torch.equal(torch.get_rng_state(), rng)


def _state_equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def _trained(model_case=MODELS[0], loss_case=LOSSES[0], loss="mse", **kw):
    """A model and optimizer that already took two steps, so the state is not empty."""
    model, x, y = make_batch(model_case, loss_case)
    model = nn.Sequential(*model, nn.Dropout(0.1))  # training-mode randomness too
    opt = SGN(model, loss, momentum=0.5, warm_start=0.5, **kw)
    opt.step(x, y)
    opt.step(x, y)
    return model, opt, x, y


@pytest.mark.parametrize("where", ["inputs", "targets"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_batch_is_rejected_and_nothing_changes(where, bad):
    model, opt, x, y = _trained()
    x, y = x.clone(), y.clone()
    (x if where == "inputs" else y)[0, 0] = bad
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match=f"{where} contain NaN or infinite"):
        opt.step(x, y)
    _assert_unchanged(model, opt, snap)


def test_non_finite_loss_is_rejected_and_nothing_changes():
    model, opt, x, y = _trained()
    snap = _snapshot(model, opt)
    with pytest.raises(FloatingPointError, match="loss is (inf|nan)"):
        opt.step(x, y * 1e200)  # finite targets, but the squared error overflows
    _assert_unchanged(model, opt, snap)


class _NanGrad(nn.Module):
    def forward(self, h):
        return h + torch.sqrt(h * 0)  # the identity, but its derivative is 1 + inf * 0 = nan


def test_non_finite_gradient_is_rejected_and_nothing_changes():
    model, opt, x, y = _trained()
    model.insert(1, _NanGrad())
    snap = _snapshot(model, opt)
    with pytest.raises(FloatingPointError, match="gradient has non-finite"):
        opt.step(x, y)
    _assert_unchanged(model, opt, snap)


def test_batchnorm_buffers_untouched_by_a_failed_step():
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    opt = SGN(model, "cross_entropy")
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match="class index out of range"):
        opt.step(x, torch.tensor([0, 1, 2, 3, 0, 1]))
    _assert_unchanged(model, opt, snap)


@pytest.mark.parametrize(
    "targets,match",
    [
        (torch.rand(6), "expects integer class indices of shape \\(6,\\)"),
        (torch.tensor([0, 1, 2, 3, 0, 1]), "class index out of range.*valid indices 0..2"),
        (torch.tensor([0, 1, -1, 0, 0, 1]), "class index out of range"),
        (torch.zeros(6, 1, dtype=torch.long), "class indices of shape \\(6,\\)"),
    ],
    ids=["float", "too-large", "negative", "wrong-shape"],
)
def test_bad_cross_entropy_targets(targets, match):
    model, opt, x, y = _trained(MODELS[0], LOSSES[2], loss="cross_entropy")
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.step(x, targets)
    _assert_unchanged(model, opt, snap)


def test_sequence_logits_with_classes_last_get_the_layout_hint():
    """(N, L, C) logits, the transformer's layout, against (N, L) targets: the error says the
    classes go along dimension 1, and the step changes nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5)).double()  # (N, L, 4) -> (N, L, 5)
    x, y = torch.randn(3, 7, 4, dtype=torch.float64), torch.randint(0, 5, (3, 7))
    opt = SGN(model, "cross_entropy")
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match="shape \\(3, 5\\), got \\(3, 7\\).*movedim"):
        opt.step(x, y)
    _assert_unchanged(model, opt, snap)


@pytest.mark.parametrize(
    "loss,targets,match",
    [
        ("mse", torch.randn(6), "mse expects targets of the outputs' shape \\(6, 3\\)"),
        ("mse", torch.zeros(6, 3, dtype=torch.long), "mse expects floating-point targets"),
        ("bce_with_logits", torch.ones(6, 3, dtype=torch.long), "floating-point targets"),
        ("bce_with_logits", 2 * torch.ones(6, 3), "targets in \\[0, 1\\]"),
    ],
)
def test_bad_regression_and_binary_targets(loss, targets, match):
    model, x, _ = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, loss)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.step(x, targets.to(torch.float64) if targets.is_floating_point() else targets)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=0.0), "invalid lr=0.0"),
        (dict(lr=-1.0), "invalid lr=-1.0"),
        (dict(lr=math.inf), "invalid lr=inf: must be > 0 and finite"),
        (dict(lr=math.nan), "invalid lr=nan"),
        (dict(damping=0.0), "invalid damping=0.0"),
        (dict(damping=math.inf), "invalid damping=inf: must be > 0 and finite"),
        (dict(damping=math.nan), "invalid damping=nan"),
        (dict(cg_tol=math.inf), "invalid cg_tol=inf"),
        (dict(momentum=math.nan), "invalid momentum=nan"),
        (dict(damping=1e-4, damping_min=1e-3), "invalid damping_min=0.001"),
        (dict(cg_iters=0), "invalid cg_iters=0"),
        (dict(cg_iters=2.5), "invalid cg_iters=2.5"),
        (dict(cg_tol=-1.0), "invalid cg_tol"),
        (dict(momentum=1.0), "invalid momentum=1.0"),
        (dict(warmup_cg_iters=0), "invalid warmup_cg_iters=0"),
        (dict(damping_schedule="exp"), "invalid damping_schedule='exp'"),
        (dict(damping_schedule="linear"), "needs trust_region=False"),
        (dict(damping_decay_steps=0, trust_region=False), "invalid damping_decay_steps=0"),
        (dict(preconditioner_exponent=0.0), "invalid preconditioner_exponent"),
        (dict(warm_start=1.5), "invalid warm_start=1.5"),
        (dict(ls_c=1.0), "invalid ls_c=1.0"),
        (dict(ls_shrink=1.0), "invalid ls_shrink=1.0"),
        (dict(ls_max_evals=0), "invalid ls_max_evals=0"),
        (dict(cg_rtol=-1e-3), "invalid cg_rtol=-0.001"),
        (dict(cg_rtol=1.0), "invalid cg_rtol=1.0"),
        (dict(cg_progress_tol=-1.0), "invalid cg_progress_tol"),
        (dict(cg_progress_tol=float("nan")), "invalid cg_progress_tol"),
        (dict(attempts=0), "invalid attempts=0"),
        (dict(attempts=2.0), "invalid attempts=2.0"),
        (dict(attempts=True), "invalid attempts=True"),
        (dict(damping_update="marquardt"), "invalid damping_update='marquardt'"),
        (dict(damping_update="nielsen", damping_min=0.0), "must be > 0 with damping_update"),
    ],
)
def test_invalid_hyperparameters_raise_in_the_constructor(kwargs, match):
    model, _, _ = make_batch(MODELS[0], LOSSES[0])
    with pytest.raises(ValueError, match=match):
        SGN(model, "mse", **kwargs)


def test_bad_loss_and_model_arguments():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        SGN(model, "hinge")
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        SGN(model, nn.MSELoss(reduction="none"))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        SGN([p for p in model.parameters()], "mse")
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        SGN(frozen, "mse")
    with pytest.raises(ValueError, match="doesn't support parameter groups"):
        SGN(model, "mse").add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="share one dtype and device"):
        SGN(mixed, "mse")
    with_complex = nn.Linear(2, 2)
    with_complex.scale = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="'scale' is complex .*view_as_complex"):
        SGN(with_complex, "mse")


def test_custom_loss_must_return_a_scalar():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    with pytest.raises(ValueError, match="must return a scalar"):
        GGN(model, lambda z, t: (z - t) ** 2, x, y)


def test_model_returning_a_tuple_is_rejected_with_advice(each_engine):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x), x

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match="forward returns one tensor"):
            SGN(Two(), "mse").step(torch.randn(4, 3), torch.randn(4, 2))
    # the error alone: engine="auto" tries the traced engine first, which fails on the tuple
    # too, but warns only where the functional engine then takes the model
    assert not [str(w.message) for w in caught]


def test_finiteness_check_survives_an_overflowing_sum():
    from torch_sgn.stepper import all_finite as _all_finite

    big = torch.full((8,), 3e38)  # finite, but the float32 sum overflows
    assert _all_finite(big)
    assert not _all_finite(torch.tensor([1.0, float("nan")]))
    assert not _all_finite(torch.tensor([1.0, float("-inf")]))


@pytest.mark.parametrize(
    "loss", ["cross_entropy", nn.CrossEntropyLoss(weight=torch.ones(1, dtype=torch.float64))]
)
def test_one_output_cross_entropy_is_refused_with_advice(loss):
    model = nn.Sequential(nn.Linear(4, 1)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.zeros(6, dtype=torch.long)
    opt = SGN(model, loss)
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match="single output is always 0.*give the model 2 outputs.*"
                       "loss='bce_with_logits'"):  # fmt: skip
        opt.step(x, y)
    _assert_unchanged(model, opt, snap)


def test_negative_probability_rows_are_refused():
    model, x, y = make_batch(MODELS[0], LOSSES[2])
    opt = SGN(model, "cross_entropy")
    probs = torch.softmax(torch.randn(6, 3, dtype=torch.float64), 1)
    probs[2] = -probs[2]
    with pytest.raises(ValueError, match="rows that sum to >= 0"):
        opt.step(x, probs)


def test_a_loss_class_is_refused_at_construction_with_the_fix():
    model, _, _ = make_batch(MODELS[0], LOSSES[0])
    with pytest.raises(TypeError, match=r"loss=MSELoss is a class; pass an instance, e\.g\. "
                       r"loss=MSELoss\(\)"):  # fmt: skip
        SGN(model, nn.MSELoss)
    with pytest.raises(TypeError, match="loss=CrossEntropyLoss is a class"):
        GGN(model, nn.CrossEntropyLoss, torch.randn(2, 4), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("lr", -1.0, "invalid param_groups\\[0\\]\\['lr'\\]=-1.0: must be > 0 and finite"),
        ("lr", math.inf, "\\['lr'\\]=inf"),
        ("damping", math.nan, "\\['damping'\\]=nan"),
        ("cg_iters", 0, "\\['cg_iters'\\]=0: must be an int >= 1"),
        ("gradient_averaging", 1.0, "\\['gradient_averaging'\\]=1.0: must be in \\[0, 1\\)"),
        ("damping_schedule", "linear", "needs trust_region=False"),
        ("ls_c", None, "\\['ls_c'\\]=None"),
    ],
)
def test_options_changed_in_param_groups_are_checked_at_the_step(key, value, match):
    model, opt, x, y = _trained()
    opt.param_groups[0][key] = value
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match + ".*changed after SGN was built.*not taken"):
        opt.step(x, y)
    _assert_unchanged(model, opt, snap)


@pytest.mark.parametrize(
    "targets,match",
    [
        (torch.zeros(0, dtype=torch.long), "the batch is empty.*skip empty batches"),
        (torch.full((6,), -100), "no target of this batch counts.*ignore_index.*skip such batches"),
    ],
    ids=["empty", "all-ignored"],
)
def test_batches_with_nothing_to_average_say_so(targets, match):
    model, opt, x, y = _trained(MODELS[0], LOSSES[2], loss="cross_entropy")
    x = x[: targets.shape[0]]
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match=match):
        opt.step(x, targets)
    _assert_unchanged(model, opt, snap)


@pytest.mark.parametrize(
    "other",
    [
        lambda ps: torch.optim.Adam(ps),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # has a "momentum" key too
        lambda ps: torch.optim.LBFGS(ps),
    ],
    ids=["Adam", "SGD", "LBFGS"],
)
def test_another_optimizers_state_dict_is_refused_at_load_time(other):
    model, opt, x, y = _trained()
    foreign = other(model.parameters())
    foreign.zero_grad()
    model[0](x).square().mean().backward()
    if not isinstance(foreign, torch.optim.LBFGS):
        foreign.step()
    snap = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"not a whole SGN state_dict.*lacks SGN's option\(s\)"
                       r".*another optimizer or edited; load it into the optimizer that saved "
                       r"it, or start SGN afresh"):  # fmt: skip
        opt.load_state_dict(foreign.state_dict())
    _assert_unchanged(model, opt, snap)
    for p in model.parameters():
        p.grad = None
    opt.step(x, y)  # still SGN's own state


def test_a_state_dict_lacking_an_option_is_refused_by_name():
    """No option is filled in with a default: a state without one is not SGN's."""
    model, opt, x, y = _trained()
    state = copy.deepcopy(opt.state_dict())
    del state["param_groups"][0]["weight_decay"]
    snap = _snapshot(model, opt)
    match = (
        r"lacks SGN's option\(s\) \['weight_decay'\]: it was saved by another optimizer or edited"
    )
    with pytest.raises(ValueError, match="not a whole SGN state_dict.*" + match):
        opt.load_state_dict(state)
    _assert_unchanged(model, opt, snap)


def test_a_state_dict_with_bad_values_is_refused_at_load_time():
    model, opt, x, y = _trained()
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0]["lr"] = math.inf
    with pytest.raises(ValueError, match="invalid lr=inf"):
        opt.load_state_dict(state)


def test_a_closure_gets_an_explanation():
    model, opt, x, y = _trained()

    def closure():
        return nn.functional.mse_loss(model(x), y)

    with pytest.raises(TypeError, match=r"takes the mini-batch, opt\.step\(inputs, targets\), "
                       "not a closure.*Gauss-Newton matrix"):  # fmt: skip
        opt.step(closure)
    with pytest.raises(TypeError, match="needs the targets"):
        opt.step(x)


def test_the_loss_is_a_required_argument():
    model, _, _ = make_batch(MODELS[0], LOSSES[0])
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'loss'"):
        SGN(model)
