import copy
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cases import LOSS, LOSSES, MODELS, dense_ggn, flat_parameters, make_batch
from torch_sgn import SGN, StepInfo

pytestmark = pytest.mark.usefixtures("each_engine")  # every test, once per engine

#: The plain step, taken whatever its loss: these tests check its math.
EXACT = dict(
    line_search=False, trust_region=False, lr=1.0, momentum=0.0, cg_tol=0.0, reject_uphill=False
)


def _exact_step(model, loss, x, y, damping):
    G, g, theta = dense_ggn(model, loss, x, y)
    A = G + damping * torch.eye(len(theta), dtype=G.dtype)
    return theta - torch.linalg.solve(A, g), G, g


@pytest.mark.parametrize(
    "model_case,loss_case",
    [
        (MODELS[0], LOSSES[0]),
        (MODELS[1], LOSSES[2]),
        (MODELS[2], LOSS["bce_with_logits"]),
        (MODELS[0], LOSS["log-cosh callable"]),
        (MODELS[2], LOSS["CE-ignore-index"]),
    ],
    ids=["mlp-mse", "cnn-ce", "seq-bce", "mlp-callable", "seq-ce-ignore-index"],
)
def test_exactness_contract(model_case, loss_case):
    model, x, y = make_batch(model_case, loss_case)
    loss = loss_case.make()
    damping = 1e-2
    expected, _, _ = _exact_step(model, loss, x, y, damping)
    n = expected.numel()
    opt = SGN(model, loss, damping=damping, cg_iters=n, **EXACT, solver="cg")
    info = opt.step(x, y)
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-8, atol=1e-10)
    assert info.step_size == 1.0 and info.tr_ratio is None


def test_huge_damping_gives_a_scaled_gradient_step():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    _, g, _ = dense_ggn(model, "mse", x, y)
    theta = flat_parameters(model)
    damping = 1e8
    SGN(model, "mse", damping=damping, cg_iters=3, **EXACT, solver="cg").step(x, y)
    step = flat_parameters(model) - theta
    torch.testing.assert_close(step * damping, -g, rtol=1e-6, atol=1e-12)


def test_linear_least_squares_model_is_exact_so_ratio_is_one():
    torch.manual_seed(0)
    model = nn.Linear(5, 2).double()
    x, y = torch.randn(20, 5, dtype=torch.float64), torch.randn(20, 2, dtype=torch.float64)
    opt = SGN(
        model, "mse", damping=1e-9, damping_min=1e-12, cg_iters=3, line_search=False, solver="cg"
    )
    info = opt.step(x, y)
    assert info.tr_ratio == pytest.approx(1.0, abs=1e-6)
    assert info.next_damping == pytest.approx(info.damping * 2 / 3)  # ratio > 3/4: expand
    assert info.loss_after == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-12)


@pytest.mark.parametrize("lr", [1.0, 0.5])
def test_linear_model_ratio_is_one_for_any_step_size(lr):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randn(30, 3, dtype=torch.float64)
    opt = SGN(
        model,
        "mse",
        lr=lr,
        damping=1e-9,
        damping_min=1e-12,
        cg_iters=2,
        line_search=False,
        solver="cg",
    )
    assert opt.step(x, y).tr_ratio == pytest.approx(1.0, abs=1e-6)


def test_one_preconditioned_cg_iteration_points_along_the_preconditioned_gradient():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    _, g, _ = dense_ggn(model, "mse", x, y)
    theta = flat_parameters(model)
    damping, exponent = 1e-3, 0.75
    SGN(
        model,
        "mse",
        damping=damping,
        cg_iters=1,
        preconditioner=True,
        preconditioner_exponent=exponent,
        **EXACT,
        solver="cg",
    ).step(x, y)
    step = flat_parameters(model) - theta
    direction = -(g.square() + damping).pow(-exponent) * g
    cosine = torch.dot(step, direction) / (step.norm() * direction.norm())
    assert cosine.item() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("c", [1e-4, 0.45])
def test_armijo_condition_holds_after_line_search(c):
    model, x, y = make_batch(MODELS[0], LOSSES[2])
    expected_full, _, g = _exact_step(model, "cross_entropy", x, y, 1e-3)
    theta = flat_parameters(model)
    d = expected_full - theta
    lr = 64.0  # far too long: the line search must cut it back
    opt = SGN(
        model,
        "cross_entropy",
        damping=1e-3,
        cg_iters=d.numel(),
        cg_tol=0.0,
        lr=lr,
        trust_region=False,
        ls_c=c,
        solver="cg",
    )
    info = opt.step(x, y)
    assert info.line_search_ok and info.step_size < lr and info.loss_evals > 1
    torch.testing.assert_close(
        flat_parameters(model), theta + info.step_size * d, rtol=1e-7, atol=1e-9
    )

    def loss_at(s):
        torch.nn.utils.vector_to_parameters(theta + s * d, model.parameters())
        return F.cross_entropy(model(x), y).item()

    slope = float(g @ d)
    assert loss_at(info.step_size) <= info.loss + c * info.step_size * slope
    assert loss_at(2 * info.step_size) > info.loss + c * 2 * info.step_size * slope
    assert info.loss_after == pytest.approx(loss_at(info.step_size), rel=1e-10)


def test_trust_region_raises_damping_after_a_bad_prediction():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    # tiny damping, many CG iterations: the step trusts a poor Gauss-Newton model
    opt = SGN(model, "mse", damping=1e-4, cg_iters=50, solver="cg")
    info = opt.step(x, y)
    assert info.predicted_change < 0 and info.loss_after - info.loss > 0.25 * info.predicted_change
    assert info.tr_ratio < 0.25 and info.next_damping == pytest.approx(1.5e-4)
    assert opt.state_dict()["state"][0]["damping"] == info.next_damping
    assert opt.step(x, y).damping == info.next_damping


def test_damping_stays_finite_once_the_batch_is_solved():
    # Repeating one batch drives the gradient to rounding level; the predicted change is then
    # noise, and reading it as a failed prediction would raise the damping until it overflows.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 1))  # can interpolate
    x, y = torch.randn(20, 3), torch.randn(20, 1)
    opt = SGN(model, "mse", cg_iters=5, line_search=False, solver="cg")
    infos = [opt.step(x, y) for _ in range(300)]
    assert infos[-1].loss < 1e-6 * infos[0].loss  # solved to rounding level
    assert all(math.isfinite(i.damping) and i.damping < 1.0 for i in infos)
    assert infos[-1].stop_reason != "non_finite"


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_damping_schedule_drives_the_damping_without_trust_region(schedule):
    from torch_sgn.solve.step import scheduled_damping

    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(
        model,
        "mse",
        trust_region=False,
        damping=1e-2,
        damping_min=1e-4,
        damping_schedule=schedule,
        damping_decay_steps=4,
        cg_iters=2,
        solver="cg",
    )
    used = [opt.step(x, y).damping for _ in range(6)]
    assert used == [scheduled_damping(schedule, 1e-2, 1e-4, t, 4) for t in range(6)]
    assert used[-1] == 1e-4


def test_cg_iteration_warmup_schedule():
    model, x, y = make_batch(MODELS[1], LOSSES[2])
    opt = SGN(
        model,
        "cross_entropy",
        cg_iters=2,
        warmup_cg_iters=6,
        warmup_steps=3,
        cg_tol=0.0,
        solver="cg",
    )
    iters = [opt.step(x, y).iterations for _ in range(5)]
    assert iters == [6, 6, 6, 2, 2]


def test_momentum_uses_bias_corrected_average_as_right_hand_side():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    x2 = x.flip(0) * 0.5
    beta, damping = 0.9, 1e-2
    twin = copy.deepcopy(model)
    opt = SGN(
        model, "mse", damping=damping, cg_iters=200, **{**EXACT, "momentum": beta}, solver="cg"
    )
    opt.step(x, y)
    # first step: m_hat = (1 - beta) g / (1 - beta) = g, so it is the plain step
    expected, _, g1 = _exact_step(twin, "mse", x, y, damping)
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-8, atol=1e-10)
    nn.utils.vector_to_parameters(expected, twin.parameters())
    G2, g2, theta2 = dense_ggn(twin, "mse", x2, y)
    m_hat = (beta * (1 - beta) * g1 + (1 - beta) * g2) / (1 - beta**2)
    expected2 = theta2 - torch.linalg.solve(
        G2 + damping * torch.eye(len(g2), dtype=G2.dtype), m_hat
    )
    opt.step(x2, y)
    torch.testing.assert_close(flat_parameters(model), expected2, rtol=1e-8, atol=1e-10)


def test_preconditioned_full_cg_keeps_the_exact_step():
    model, x, y = make_batch(MODELS[0], LOSSES[2])
    expected, _, _ = _exact_step(model, "cross_entropy", x, y, 1e-2)
    opt = SGN(
        model,
        "cross_entropy",
        damping=1e-2,
        cg_iters=500,
        preconditioner=True,
        **{**EXACT, "cg_tol": 1e-14},
        solver="cg",
    )
    opt.step(x, y)
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-7, atol=1e-9)


def test_warm_start_starts_cg_from_the_scaled_previous_direction():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    theta = flat_parameters(model)
    opt = SGN(
        model,
        "mse",
        warm_start=0.5,
        cg_iters=3,
        cg_tol=0.0,
        lr=0.5,
        line_search=False,
        trust_region=False,
        solver="cg",
    )
    opt.step(x, y)
    prev = opt.state[opt.param_groups[0]["params"][0]]["prev_direction"].clone()
    # the CG direction, not the step taken (which is lr times it)
    torch.testing.assert_close(theta + 0.5 * prev, flat_parameters(model))
    calls = []
    from torch_sgn.solve import core as optmod

    real = optmod.conjugate_gradient

    def spy(*args, **kwargs):
        calls.append(kwargs["x0"])
        return real(*args, **kwargs)

    optmod.conjugate_gradient = spy
    try:
        opt.step(x, y)
    finally:
        optmod.conjugate_gradient = real
    torch.testing.assert_close(calls[0], 0.5 * prev)


def _run(model, opt, batches):
    return [opt.step(x, y) for x, y in batches]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(momentum=0.9, warm_start=0.7, preconditioner=True),
        dict(trust_region=False, damping_schedule="cosine", damping_decay_steps=3),
        dict(curvature_fraction=0.5),
        dict(attempts=4, damping_update="nielsen", damping=1e-9, damping_min=1e-12),
    ],
    ids=["paper", "momentum-warmstart-precond", "cosine", "curvature-subset", "nielsen-retries"],
)
@pytest.mark.slow  # several seconds per case; the saved state, not the step's math
def test_state_dict_round_trip_continues_bit_identically(options):
    model, x, y = make_batch(MODELS[1], LOSSES[2], dtype=torch.float32)
    batches = [(x + 0.1 * k, y) for k in range(6)]
    opt = SGN(model, "cross_entropy", cg_iters=3, **options, solver="cg")
    _run(model, opt, batches[:3])
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    if options.get("damping_update") == "nielsen":
        assert saved_opt["state"][0]["damping_growth"] >= 2.0
    reference = _run(model, opt, batches[3:])

    resumed = MODELS[1].build()
    resumed.load_state_dict(saved_model)
    opt2 = SGN(resumed, "cross_entropy", cg_iters=3, **options, solver="cg")
    opt2.load_state_dict(saved_opt)
    again = _run(resumed, opt2, batches[3:])
    assert again == reference
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_lr_lives_in_param_groups_and_schedulers_drive_it():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse", line_search=False, trust_region=False, lr=1.0, reject_uphill=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sizes = []
    for _ in range(3):
        sizes.append(opt.step(x, y).step_size)
        sched.step()
    assert sizes == [1.0, 0.5, 0.25]


def test_no_grad_left_behind_unless_asked():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    SGN(model, "mse").step(x, y)
    assert all(p.grad is None for p in model.parameters())
    _, g, _ = dense_ggn(model, "mse", x, y)
    SGN(model, "mse", keep_grad=True).step(x, y)
    torch.testing.assert_close(
        nn.utils.parameters_to_vector([p.grad for p in model.parameters()]), g
    )


def test_step_info_fields_are_consistent():
    model, x, y = make_batch(MODELS[1], LOSSES[2])
    info = SGN(model, "cross_entropy", cg_iters=4, solver="cg").step(x, y)
    assert isinstance(info, StepInfo)
    assert info.loss_after <= info.loss
    assert info.loss_after == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-12)
    assert 1 <= info.iterations <= 4 and info.stop_reason in ("max_iters", "converged")
    assert info.predicted_change < 0 and info.grad_norm > 0 and info.loss_evals >= 1
    assert math.isfinite(info.residual)


def test_training_on_a_small_regression_problem_beats_its_start():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    y = torch.sin(3 * x)
    opt = SGN(model, "mse", cg_iters=5, solver="cg")
    first = opt.step(x, y).loss
    for _ in range(30):
        last = opt.step(x, y).loss_after
    assert last < 0.01 * first


def test_batchnorm_buffers_update_once_and_dropout_masks_are_consistent():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 1)
    ).double()
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    twin = copy.deepcopy(model)
    torch.manual_seed(5)
    with torch.no_grad():
        twin(x)  # one ordinary training-mode forward pass
    after_one_forward = torch.get_rng_state()
    torch.manual_seed(5)
    SGN(model, "mse", cg_iters=4, solver="cg").step(x, y)
    bn, bn_twin = model[1], twin[1]
    assert bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(bn.running_mean, bn_twin.running_mean)
    torch.testing.assert_close(bn.running_var, bn_twin.running_var)
    assert torch.equal(torch.get_rng_state(), after_one_forward)


def test_dropout_step_equals_exact_step_with_the_same_mask():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 2)).double()
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
    twin = copy.deepcopy(model)
    torch.manual_seed(7)
    with torch.no_grad():
        mask_probe = model[1](torch.ones(12, 6, dtype=torch.float64))
    # rebuild the twin with the mask baked in: dropout(h) = h * mask_probe
    twin[1] = _FixedMask(mask_probe)
    expected, _, _ = _exact_step(twin, "mse", x, y, 1e-2)
    torch.manual_seed(7)
    SGN(model, "mse", damping=1e-2, cg_iters=200, **EXACT, solver="cg").step(x, y)
    torch.testing.assert_close(flat_parameters(model), expected, rtol=1e-8, atol=1e-10)


class _FixedMask(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, h):
        return h * self.mask


def test_logging_reports_loss_and_cg(caplog):
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse", cg_iters=2, solver="cg")
    with caplog.at_level(logging.INFO, logger="torch_sgn"):
        opt.step(x, y)
    assert any("loss" in r.getMessage() for r in caplog.records)
    assert not any("CG" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="torch_sgn"):
        opt.step(x, y)
    messages = [r.getMessage() for r in caplog.records]
    assert any("CG 2 it" in m for m in messages) and any("line search" in m for m in messages)


def test_float32_training_works():
    model, x, y = make_batch(MODELS[1], LOSSES[2], dtype=torch.float32)
    opt = SGN(model, "cross_entropy", cg_iters=3, solver="cg")
    infos = [opt.step(x, y) for _ in range(5)]
    assert infos[-1].loss_after < infos[0].loss
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_matches_cpu_step():
    model, x, y = make_batch(MODELS[1], LOSSES[2])
    gpu = copy.deepcopy(model).cuda()
    SGN(model, "cross_entropy", cg_iters=3, solver="cg").step(x, y)
    SGN(gpu, "cross_entropy", cg_iters=3, solver="cg").step(x.cuda(), y.cuda())
    torch.testing.assert_close(
        flat_parameters(gpu).cpu(), flat_parameters(model), rtol=1e-8, atol=1e-10
    )


def _pair(options):
    model, x, y = make_batch(MODELS[0], LOSSES[2])
    model = nn.Sequential(*model, nn.Dropout(0.2))  # a random state to follow too
    opt = SGN(model, "cross_entropy", cg_iters=3, **options, solver="cg")
    batches = [(x + 0.1 * k, y) for k in range(4)]
    _run(model, opt, batches[:2])
    return model, opt, batches[2:]


def _same_future(model, opt, twin_model, twin_opt, batches):
    """The copy steps its own model only, and exactly as the original then does."""
    assert twin_model is not model and twin_opt._fmodel.model is twin_model
    state, before = torch.get_rng_state(), flat_parameters(model)
    copied = _run(twin_model, twin_opt, batches)
    assert torch.equal(flat_parameters(model), before)
    torch.set_rng_state(state)
    assert _run(model, opt, batches) == copied
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)


OPTIONS = [dict(), dict(momentum=0.9, warm_start=0.7, curvature_fraction=0.5)]


@pytest.mark.parametrize("options", OPTIONS, ids=["paper", "momentum-warmstart-subset"])
def test_a_deepcopied_model_and_optimizer_step_as_the_original(options):
    model, opt, batches = _pair(options)
    twin = copy.deepcopy({"model": model, "opt": opt})
    _same_future(model, opt, twin["model"], twin["opt"], batches)


@pytest.mark.parametrize("options", OPTIONS, ids=["paper", "momentum-warmstart-subset"])
def test_a_saved_and_loaded_optimizer_steps_as_the_original(options, tmp_path):
    import pickle

    def copied(model, opt):  # the optimizer alone: it carries a copy of its model
        twin = copy.deepcopy(opt)
        return twin._fmodel.model, twin

    def pickled(model, opt):
        twin = pickle.loads(pickle.dumps(opt))
        return twin._fmodel.model, twin

    def saved(model, opt):
        torch.save({"model": model, "opt": opt}, tmp_path / "both.pt")
        both = torch.load(tmp_path / "both.pt", weights_only=False)
        assert both["opt"]._fmodel.model is both["model"]
        return both["model"], both["opt"]

    for twin in (copied, pickled, saved):
        model, opt, batches = _pair(options)
        _same_future(model, opt, *twin(model, opt), batches)


def test_a_data_parallel_optimizer_refuses_to_be_copied(monkeypatch):
    from torch_sgn import optimizer

    model, _, _ = make_batch(MODELS[0], LOSSES[0])
    # a communicator over several processes (not SingleProcess), as SGN gets in such a group
    monkeypatch.setattr(optimizer, "communicator", lambda fmodel, loss, group: object())
    opt = SGN(model, "mse")
    with pytest.raises(TypeError, match="data-parallel group.*cannot be copied or pickled.*"
                       "state_dict"):  # fmt: skip
        copy.deepcopy(opt)


def test_schedulers_that_cycle_momentum_leave_the_gradient_averaging_alone():
    """SGN's beta is not a "momentum" key: OneCycleLR and CyclicLR refuse cycle_momentum=True
    with their own error, and without it schedule the step size alone."""
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse", line_search=False, trust_region=False, reject_uphill=False)
    with pytest.raises(ValueError, match="cycle_momentum"):
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=5)
    with pytest.raises(ValueError, match="cycle_momentum"):
        torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.1, max_lr=1.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1.0, total_steps=5, cycle_momentum=False
    )
    sizes, expected = [], []
    for _ in range(4):
        expected.append(opt.param_groups[0]["lr"])
        sizes.append(opt.step(x, y).step_size)
        sched.step()
    assert sizes == expected and len(set(sizes)) == 4
    assert opt.param_groups[0]["gradient_averaging"] == 0.0
    assert "momentum" not in opt.param_groups[0]


def test_a_parameter_frozen_after_construction_keeps_its_value_and_the_rest_step_exactly():
    """The step is the damped Gauss-Newton step of the trainable block alone:
    -(G_tt + rho I)^-1 g_t, from the dense reference."""
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    damping = 1e-2
    opt = SGN(model, "mse", damping=damping, cg_iters=100, **EXACT, solver="cg")
    model[0].weight.requires_grad_(False)
    G, g, theta = dense_ggn(model, "mse", x, y)  # over the parameters still trainable
    model[0].weight.requires_grad_(True)
    _, _, everything = dense_ggn(model, "mse", x, y)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt.step(x, y)
    assert torch.equal(model[0].weight, frozen)
    expected = theta - torch.linalg.solve(G + damping * torch.eye(len(g), dtype=G.dtype), g)
    trainable = [p for p in model.parameters() if p.requires_grad]
    torch.testing.assert_close(
        nn.utils.parameters_to_vector(trainable), expected, rtol=1e-8, atol=1e-10
    )
    assert not torch.equal(theta, expected) and len(everything) > len(theta)


def test_a_parameter_frozen_mid_run_stays_put_with_averaging_and_warm_start():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse", momentum=0.9, warm_start=1.0, cg_iters=3, solver="cg")
    opt.step(x, y)
    opt.step(x * 0.5, y)  # the averaged gradient and the last direction are non-zero
    model[2].bias.requires_grad_(False)
    frozen = model[2].bias.detach().clone()
    others = flat_parameters(model)
    opt.step(x, y)
    assert torch.equal(model[2].bias, frozen) and not torch.equal(flat_parameters(model), others)
    model[2].bias.requires_grad_(True)  # unfrozen: it trains again
    opt.step(x, y)
    assert not torch.equal(model[2].bias, frozen)


def test_a_parameter_made_trainable_after_construction_warns_once_and_keeps_its_value():
    model, x, y = make_batch(MODELS[0], LOSSES[0])
    model[0].weight.requires_grad_(False)  # frozen when SGN is built: not in its vector
    opt = SGN(model, "mse")
    model[0].weight.requires_grad_(True)
    before = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"0\.weight became trainable after SGN was built"):
        opt.step(x, y)
    assert torch.equal(model[0].weight, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        opt.step(x, y)


def test_each_engine_builds_this_modules_optimizers_with_that_engine(each_engine):
    """The fixture that runs these tests once per engine reaches the SGN this module names."""
    import inspect

    import torch_sgn

    model, x, y = make_batch(MODELS[0], LOSSES[0])
    opt = SGN(model, "mse")
    assert type(opt) is not torch_sgn.SGN and isinstance(opt, torch_sgn.SGN)
    assert type(opt).__name__ == f"SGN_{each_engine}"
    assert inspect.signature(SGN).parameters["engine"].default == each_engine
    opt.step(x, y)
