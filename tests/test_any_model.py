"""Models beyond Sequential chains: operators without a forward-mode rule (fused attention,
the transformer fast path, oneDNN's LSTM, losses' backward kernels) and modules reachable by
several names. Products are checked against a dense ``J^T H J`` built by reverse mode alone
through the model's own parameters (``cases.dense_ggn``), in float64."""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from cases import (
    LENGTH,
    WIDTH,
    ZOO,
    CausalEncoder,
    Recurrent,
    SineWithoutJvp,
    dense_ggn,
    make_model,
)
from torch_sgn import GGN, SGN
from torch_sgn.engines.functional import FunctionalEngine
from torch_sgn.engines.selection import select_engine
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.model.forward_mode import kernels, missing_rule, switch_for

L, D = LENGTH, WIDTH  # sequence length and width of the zoo's sequence models

# the families of the zoo (cases.ZOO) this file runs, each with the loss "mse"
SHARED = ["shared-module", "twice-in-sequential", "tied-weight"]
FAMILIES = ["encoder", "sdpa", "lstm", "gru", "bilstm", *SHARED]


def _probes(n, dtype=torch.float64, k=3):
    """A few random directions: a dense G would take one product per parameter."""
    return torch.randn(n, k, generator=torch.Generator().manual_seed(7), dtype=dtype)


SEQUENCE = ["encoder", "sdpa", "lstm", "gru"]  # dropout-free, but eval mode takes fast paths
# (family, engine, mode): every engine path that applies; "auto" hands a model that is not a
# Sequential chain to the functional engine, "layerwise" takes the chain with a repeated layer.
PRODUCT_CASES = (
    [(n, "functional", mode) for n in SEQUENCE for mode in ("train", "eval")]
    + [(n, "functional", "train") for n in SHARED]
    + [(n, "auto", "train") for n in FAMILIES]
    + [("twice-in-sequential", "layerwise", "train"), ("encoder", "auto", "eval")]
)


@pytest.mark.parametrize("name,engine,mode", PRODUCT_CASES)
def test_products_match_the_dense_reference(name, engine, mode):
    model, x, y, _ = make_model(name, mode=mode)
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = GGN(model, "mse", x, y, engine=engine)
        V = _probes(G.shape[0])
        GV = G @ V
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "name,mode", [(n, "train") for n in FAMILIES] + [("encoder", "eval"), ("lstm", "eval")]
)
def test_double_backward_route_matches_the_dense_reference(name, mode):
    """``J v = d/du [(J^T u) . v]`` on every family, forced from the start."""
    model, x, y, _ = make_model(name, mode=mode)
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    engine = FunctionalEngine(FunctionalModel(model), resolve_loss("mse"))
    engine.double_backward = True
    lin = engine(FunctionalModel(model).flat(), Batch(x, y))
    V = _probes(len(g_ref))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fused attention's backward: math kernel
        GV = torch.stack([lin.ggn_vp(v) for v in V.T], 1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "name,op",
    [
        ("encoder", "_scaled_dot_product_flash_attention_for_cpu"),
        ("sdpa", "_scaled_dot_product_flash_attention_for_cpu"),
    ],
)
def test_a_missing_rule_is_reported_once_and_products_stay_exact(name, op):
    model, x, y, _ = make_model(name)
    G_ref, _, _ = dense_ggn(model, "mse", x, y)
    with pytest.warns(UserWarning, match=f"no rule for {op}") as record:
        G = GGN(model, "mse", x, y, engine="functional")
        V = _probes(G.shape[0])
        first = G @ V[:, 0]
    assert sum("no rule" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second notice
        rest = G @ V
    torch.testing.assert_close(first, G_ref @ V[:, 0], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(rest, G_ref @ V, rtol=1e-9, atol=1e-11)


def test_encoder_fast_path_in_eval_mode_is_switched_off_and_restored():
    model, x, y, _ = make_model("encoder", mode="eval")
    with pytest.warns(UserWarning, match="no rule for _transformer_encoder_layer_fwd"):
        G_ref, _, _ = dense_ggn(model, "mse", x, y)
        G = GGN(model, "mse", x, y, engine="functional")
        V = _probes(G.shape[0])
        GV = G @ V
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)
    assert torch.backends.mha.get_fastpath_enabled()  # the global setting is back


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("engine", ["auto", "functional", "double_backward"])
def test_float32_rnn_on_the_cpu(cell, engine):
    """float32 on the CPU takes oneDNN's LSTM kernel, which has no forward-mode rule."""
    torch.manual_seed(0)
    model = Recurrent(cell)
    x, y = torch.randn(4, L, D), torch.randn(4, 3)
    reference = Recurrent(cell).double()
    reference.load_state_dict(model.state_dict())
    G_ref, g_ref, _ = dense_ggn(reference, "mse", x.double(), y.double())
    V = _probes(len(g_ref))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if engine == "double_backward":
            fmodel = FunctionalModel(model)
            linearize = FunctionalEngine(fmodel, resolve_loss("mse"))
            linearize.double_backward = True
            lin = linearize(fmodel.flat(), Batch(x, y))
            grad = lin.grad
            GV = torch.stack([lin.ggn_vp(v) for v in V.float().T], 1)
        else:
            G = GGN(model, "mse", x, y, engine=engine)
            grad, GV = G.gradient, G @ V.float()
    assert torch.backends.mkldnn.enabled  # switched off for the curvature passes only
    torch.testing.assert_close(grad.double(), g_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(GV.double(), G_ref @ V, rtol=1e-4, atol=1e-6)


LOSS_CALLABLES = {
    "HuberLoss": (lambda: nn.HuberLoss(delta=0.5), "real"),
    "SmoothL1Loss": (lambda: nn.SmoothL1Loss(beta=0.5), "real"),
    "SoftMarginLoss": (nn.SoftMarginLoss, "sign"),
}


def _loss_batch(kind, dtype=torch.float64):
    torch.manual_seed(0)
    model = ZOO["mlp"].build().to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=dtype)
    y = torch.randn(8, 3, generator=g, dtype=dtype)
    return model, x, (y.sign() if kind == "sign" else y)


@pytest.mark.parametrize("engine", ["layerwise", "functional"])
@pytest.mark.parametrize("name", list(LOSS_CALLABLES))
def test_loss_callables_without_forward_rules(name, engine):
    make, kind = LOSS_CALLABLES[name]
    model, x, y = _loss_batch(kind)
    G_ref, g_ref, _ = dense_ggn(model, make(), x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = GGN(model, make(), x, y, engine=engine)
        dense = G.to_dense()
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)
    assert G_ref.abs().max() > 0  # some samples inside the quadratic zone


def test_huber_needs_no_forward_mode_rule_and_no_warning():
    # huber_loss_backward has no forward-mode rule: a callable's Hessian never needs one
    model, x, y = _loss_batch("real")
    G_ref, _, _ = dense_ggn(model, nn.HuberLoss(), x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = GGN(model, nn.HuberLoss(), x, y, engine="layerwise").to_dense()
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)


class _Focal(nn.Module):
    """A focal loss whose weights a flag puts under ``torch.no_grad``."""

    def __init__(self):
        super().__init__()
        self.stop = False

    def forward(self, outputs, targets):
        log_p = F.log_softmax(outputs, 1)
        with torch.no_grad() if self.stop else contextlib.nullcontext():
            weights = (1 - log_p.exp()) ** 2
        return -(weights * log_p).gather(1, targets[:, None]).mean()


def _focal_batch():
    torch.manual_seed(0)
    model = ZOO["mlp"].build().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,))
    return model, x, y


@pytest.mark.parametrize("engine", ["layerwise", "functional"])
def test_a_loss_that_stops_the_gradient_gets_the_gradients_hessian(engine):
    model, x, y = _focal_batch()
    focal = _Focal()
    focal.stop = True
    G_ref, g_ref, _ = dense_ggn(model, focal, x, y)  # reverse mode alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loss's Hessian is reverse-over-reverse anyway
        G = GGN(model, focal, x, y, engine=engine)
        dense = G.to_dense()
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)


def test_a_loss_without_a_second_derivative_is_refused_clearly():
    # CTC's backward kernel has no derivative: neither route gives its Hessian
    torch.manual_seed(0)
    model = nn.Linear(5, 6)
    x, targets = torch.randn(10, 2, 5), torch.randint(1, 6, (2, 4))

    def ctc(outputs, t):
        lengths = torch.full((2,), 10), torch.full((2,), 4)
        return F.ctc_loss(outputs.log_softmax(-1), t, *lengths)

    before = [p.detach().clone() for p in model.parameters()]
    opt = SGN(model, ctc, cg_iters=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="'ctc' has no second derivative.*_ctc_loss_backward"):
            opt.step(x, targets)
    assert not any("double backward" in str(w.message) for w in record)  # no route to announce
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_data_parallel_wrapper_is_refused_with_what_to_do():
    model = nn.DataParallel(nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"nn.DataParallel.*model.module.*process_group"):
        SGN(model, "mse")
    with pytest.raises(ValueError, match="nn.DataParallel"):
        GGN(model, "mse", torch.randn(2, 4), torch.randn(2, 3))


def test_targets_of_the_wrong_shape_raise_without_a_trace_warning():
    # per-position logits (N, L, C) with targets (N, L): the trace fails on the targets; the
    # error to read is the loss's, not a warning that the model cannot be traced
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    x, y = torch.randint(0, 10, (4, 6)), torch.randint(0, 10, (4, 6))
    opt = SGN(model, "cross_entropy", cg_iters=2)  # engine "auto": the traced engine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="movedim"):
            opt.step(x, y)


@pytest.mark.parametrize("engine", ["auto", "functional", "layerwise"])
@pytest.mark.parametrize("name", SHARED)
def test_sgn_keeps_shared_parameters_in_the_model(name, engine):
    if engine == "layerwise" and name != "twice-in-sequential":
        pytest.skip("the layer-wise engine takes Sequential chains")
    model, x, y, _ = make_model(name, dtype=torch.float32)
    before = list(model.parameters())
    named = dict(model.named_parameters(remove_duplicate=False))
    values = [p.detach().clone() for p in before]
    opt = SGN(model, "mse", engine=engine, cg_iters=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = [opt.step(x, y).loss for _ in range(3)]
    after = list(model.parameters())
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before))
    assert all(type(p) is nn.Parameter for p in after)
    assert all(named[n] is p for n, p in model.named_parameters(remove_duplicate=False))
    assert all(not torch.equal(v, p) for v, p in zip(values, after))  # every one trained
    assert F.mse_loss(model(x), y) < losses[0]


SGN_FAMILIES = ["encoder", "sdpa", "lstm", "bilstm", "gru", "shared-module", "tied-weight"]


@pytest.mark.parametrize("name", SGN_FAMILIES)
def test_sgn_steps_decrease_the_loss_in_float32(name):
    model, x, y, _ = make_model(name, dtype=torch.float32)
    start = F.mse_loss(model(x), y).item()
    opt = SGN(model, "mse", cg_iters=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            opt.step(x, y)
    assert F.mse_loss(model(x), y).item() < 0.9 * start


def test_sgn_with_huber_decreases_the_loss_in_float32():
    model, x, y = _loss_batch("real", torch.float32)
    loss = nn.HuberLoss(delta=0.5)
    start = loss(model(x), y).item()
    for solver in ("cg", "direct"):  # the Huber loss's Hessian on either route
        opt = SGN(model, loss, cg_iters=5, solver=solver)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                opt.step(x, y)
        assert loss(model(x), y).item() < 0.9 * start
        start = loss(model(x), y).item()


@pytest.mark.parametrize("engine", ["auto", "traced", "functional"])
@pytest.mark.parametrize("name", ["parametrized", "checkpointed", "mobile-block"])
def test_parametrized_and_checkpointed_models_match_the_dense_reference(name, engine):
    model, x, y, _ = make_model(name)
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        G = GGN(model, "mse", x, y, engine=engine)
        GV = G @ _probes(G.shape[0])
    assert not [w for w in record if "cannot trace" in str(w.message)]  # no hand-over
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ _probes(G.shape[0]), rtol=1e-9, atol=1e-11)


def _exact_then_trains(model, x, y, engine, notice):
    """The products against the dense reference in float64, with the one-time ``notice``
    (a regular expression) among the warnings; then three SGN steps in float32 that reduce
    the loss."""
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        G = GGN(model, "mse", x, y, engine=engine)
        V = _probes(G.shape[0])
        GV = G @ V
    assert any(re.search(notice, str(w.message)) for w in record)
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)
    model.float()
    x, y = x.float(), y.float()
    start = F.mse_loss(model(x), y).item()
    opt = SGN(model, "mse", engine=engine, cg_iters=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            opt.step(x, y)
    assert F.mse_loss(model(x), y).item() < 0.9 * start


class NoGradGate(nn.Module):
    """A gate computed from the parameters under ``torch.no_grad``: the gradient takes it as a
    constant, forward mode (which ignores the grad mode) would not. The input's mask, also
    under ``no_grad``, depends on no parameter."""

    def __init__(self, gate=True):
        super().__init__()
        self.gated = gate
        self.a, self.g, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        with torch.no_grad():
            mask = (x > -1.0).to(x.dtype)
        h = torch.tanh(self.a(x * mask))
        if not self.gated:
            return self.head(h * torch.sigmoid(self.g(h)))
        with torch.no_grad():
            gate = torch.sigmoid(self.g(h))
        return self.head(h * gate)


@pytest.mark.parametrize("engine", ["auto", "traced", "functional"])
def test_values_computed_under_no_grad_are_constants_of_the_products_too(engine):
    torch.manual_seed(0)
    model = NoGradGate().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    _exact_then_trains(model, x, y, engine, "computes linear .* under torch.no_grad")


class Hooked(nn.Module):
    """A gradient hook that halves what flows back: on an intermediate tensor
    (``register_hook`` in ``forward``), as a module's full backward hook or as its backward
    pre-hook. The gradient runs it, forward mode would not."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        if kind == "module":
            self.b.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] / 2,))
        elif kind == "pre":
            self.b.register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] / 2,))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.kind == "tensor" and h.requires_grad:
            h.register_hook(lambda grad: grad / 2)
        return self.b(h)


@pytest.mark.parametrize("engine", ["auto", "traced", "functional"])
@pytest.mark.parametrize("kind", ["tensor", "module", "pre"])
def test_backward_hooks_are_in_the_products_too(kind, engine):
    torch.manual_seed(0)
    model = Hooked(kind).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    _exact_then_trains(model, x, y, engine, "hook.*double backward")


@pytest.mark.parametrize("engine", ["traced", "functional"])
def test_a_backward_hook_registered_between_steps_is_in_the_next_products(engine):
    torch.manual_seed(0)
    model = Hooked("none").double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    fmodel = FunctionalModel(model)
    linearize = select_engine(fmodel, resolve_loss("mse"), engine)
    V = _probes(fmodel.numel)
    linearize(fmodel.flat(), Batch(x, y)).ggn_vp(V[:, 0])  # traced, stops checked: none
    model.b.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] / 2,))
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    with pytest.warns(UserWarning, match="backward hooks"):
        lin = linearize(fmodel.flat(), Batch(x, y))
        GV = torch.stack([lin.ggn_vp(v) for v in V.T], 1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("engine", ["traced", "functional"])
def test_a_flag_that_switches_a_gradient_stop_on_is_checked_again(engine):
    torch.manual_seed(0)
    model = NoGradGate(gate=False).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    fmodel = FunctionalModel(model)
    linearize = select_engine(fmodel, resolve_loss("mse"), engine)
    linearize(fmodel.flat(), Batch(x, y))  # traced in forward mode: no stop
    model.gated = True  # the gate now under torch.no_grad: a new trace, checked again
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    V = _probes(fmodel.numel)
    with pytest.warns(UserWarning, match="under torch.no_grad"):
        lin = linearize(fmodel.flat(), Batch(x, y))
        GV = torch.stack([lin.ggn_vp(v) for v in V.T], 1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)


def test_a_second_backward_hook_registered_between_steps_is_in_the_next_products():
    torch.manual_seed(0)
    model = Hooked("module").double()  # one hook on b
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    fmodel = FunctionalModel(model)
    linearize = select_engine(fmodel, resolve_loss("mse"), "traced")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notice of double backward
        linearize(fmodel.flat(), Batch(x, y))
        model.b.register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 3,))
        lin = linearize(fmodel.flat(), Batch(x, y))
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    V = _probes(fmodel.numel)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.stack([lin.ggn_vp(v) for v in V.T], 1), G_ref @ V)


def test_a_stop_switched_on_after_the_hand_over_to_the_functional_engine_is_found():
    torch.manual_seed(0)
    model = NoGradGate(gate=False).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    fmodel = FunctionalModel(model)
    linearize = select_engine(fmodel, resolve_loss("mse"), "traced")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(5):  # a counter the model holds: the functional engine after three
            model.seen = step
            linearize(fmodel.flat(), Batch(x, y))
        model.gated = True
        lin = linearize(fmodel.flat(), Batch(x, y))
    G_ref, _, _ = dense_ggn(model, "mse", x, y)
    V = _probes(fmodel.numel)
    torch.testing.assert_close(torch.stack([lin.ggn_vp(v) for v in V.T], 1), G_ref @ V)


@pytest.mark.parametrize("engine", ["traced", "functional"])
def test_a_loss_flag_that_switches_a_stop_on_is_followed(engine):
    model, x, y = _focal_batch()
    loss = _Focal()
    linearize = select_engine(FunctionalModel(model), resolve_loss(loss), engine)
    linearize(FunctionalModel(model).flat(), Batch(x, y))
    loss.stop = True
    lin = linearize(FunctionalModel(model).flat(), Batch(x, y))
    V = _probes(len(lin.grad))
    GV = torch.stack([lin.ggn_vp(v) for v in V.T], 1)
    G_ref, _, _ = dense_ggn(model, loss, x, y)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("engine", ["auto", "functional"])
def test_no_grad_on_the_inputs_alone_keeps_forward_mode(engine):
    torch.manual_seed(0)
    model = NoGradGate(gate=False).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    G_ref, _, _ = dense_ggn(model, "mse", x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no notice: J v stays in forward mode
        G = GGN(model, "mse", x, y, engine=engine)
        GV = G @ _probes(G.shape[0])
    torch.testing.assert_close(GV, G_ref @ _probes(G.shape[0]), rtol=1e-9, atol=1e-11)


STOP = (
    "computes linear from the parameters under torch.no_grad: the gradient takes it as a "
    "constant, forward-mode AD would differentiate through it"
)


def test_the_gradient_stop_is_found_once_per_setting_and_leaves_the_random_state(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(NoGradGate(), nn.Dropout(0.5))
    fmodel, x = FunctionalModel(model), torch.randn(5, 4)
    passes = []
    forward = NoGradGate.forward
    monkeypatch.setattr(NoGradGate, "forward", lambda *a: passes.append(1) or forward(*a))
    state = torch.get_rng_state()
    assert fmodel.gradient_stop(fmodel.flat(), x) == STOP
    assert fmodel.gradient_stop(fmodel.flat(), x) == STOP  # remembered: no second pass
    assert len(passes) == 1
    assert torch.equal(torch.get_rng_state(), state)
    model[0].gated = False  # a setting changed: looked for again
    assert fmodel.gradient_stop(fmodel.flat(), x) is None
    assert len(passes) == 2


class PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` with a key padding mask: in eval mode without autograd (as in
    forward mode) its fast path packs the batch into a nested tensor."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[0, -2:] = True
        return self.head(self.encoder(x, src_key_padding_mask=padding)).mean(1)


@pytest.mark.parametrize("engine", ["auto", "functional"])
def test_encoder_with_padding_in_eval_mode_matches_the_dense_reference(engine):
    torch.manual_seed(0)
    model = PaddedEncoder().double().eval()
    x, y = torch.randn(4, L, D, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the functional engine reports the nested tensor
        G = GGN(model, "mse", x, y, engine=engine)
        V = _probes(G.shape[0])
        GV = G @ V
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)


class PackedRecurrent(nn.Module):
    """An RNN on a packed batch of sequences of different lengths: its kernel reads the
    tensors' memory, which ``torch.func``'s tensors do not have."""

    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(D, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        lengths = torch.tensor([L, 3, 2, 4])
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, h = self.rnn(packed)
        return self.head((h[0] if isinstance(h, tuple) else h)[-1])


@pytest.mark.parametrize("engine", ["auto", "functional"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_rnn_on_packed_sequences_goes_by_double_backward(cell, engine):
    torch.manual_seed(0)
    model = PackedRecurrent(cell).double()
    x, y = torch.randn(4, L, D, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    _exact_then_trains(model, x, y, engine, "reads its tensors' memory")


def test_missing_rules_are_read_from_torch_errors():
    assert missing_rule(RuntimeError("something else")) is None
    assert missing_rule(ValueError("forward AD with x")) is None
    e = NotImplementedError("Trying to use forward AD with aten::_transformer_encoder_layer_fwd")
    assert missing_rule(e) == "_transformer_encoder_layer_fwd"
    e = RuntimeError("Cannot access data pointer of Tensor that doesn't have storage")
    assert "packed sequence" in missing_rule(e)
    e = RuntimeError("Internal error: NestedTensorImpl doesn't support strides.")
    assert switch_for(missing_rule(e)) == "no_mha_fast_path"
    assert switch_for("_scaled_dot_product_efficient_attention") == "math_attention"
    assert switch_for("mkldnn_rnn_layer") == "no_onednn"
    assert switch_for("huber_loss_backward") is None


def test_kernel_switches_restore_the_global_settings():
    with kernels(frozenset({"no_onednn", "no_mha_fast_path", "math_attention"})):
        assert not torch.backends.mkldnn.enabled
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mkldnn.enabled and torch.backends.mha.get_fastpath_enabled()


class _Detached(SineWithoutJvp):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (g * x.cos()).detach()


class _CustomFunctionModel(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fn.apply(self.b(torch.tanh(self.a(x))))


def test_custom_function_without_jvp_goes_by_double_backward():
    torch.manual_seed(0)
    model = _CustomFunctionModel(SineWithoutJvp).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    G_ref, _, _ = dense_ggn(model, "mse", x, y)
    with pytest.warns(UserWarning, match="custom autograd.Function.*double backward"):
        dense = GGN(model, "mse", x, y, engine="functional").to_dense()
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)


def test_custom_function_with_a_detached_backward_is_refused():
    torch.manual_seed(0)
    model = _CustomFunctionModel(_Detached).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    G = GGN(model, "mse", x, y, engine="functional")
    with pytest.raises(RuntimeError, match="differentiable backward"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            G @ torch.ones(G.shape[0], dtype=torch.float64)


class DropoutEncoder(CausalEncoder):
    """The encoder layer with dropout (attention and residual branches), as torch builds it."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.3, batch_first=True)


@pytest.mark.parametrize("engine", ["functional", "double_backward"])
def test_encoder_with_dropout_in_training_mode(engine):
    """Forward mode does not replay this layer's dropout masks (its outputs differ from the
    recorded pass's); products must still be those of the recorded pass, which the reference
    replays from the same random state on the math attention kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = DropoutEncoder().double().train()
    x, y = torch.randn(4, L, D, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    fmodel = FunctionalModel(model)
    linearize = FunctionalEngine(fmodel, resolve_loss("mse"))
    linearize.double_backward = engine == "double_backward"
    torch.manual_seed(5)
    fmodel.freeze_rng()  # as SGN and GGN do: every pass of the step replays one random state
    lin = linearize(fmodel.flat(), Batch(x, y))
    V = _probes(fmodel.numel)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        GV = torch.stack([lin.ggn_vp(v) for v in V.T], 1)
    with sdpa_kernel(SDPBackend.MATH):
        G_ref, _, _ = dense_ggn(model, "mse", x, y, seed=5)
    torch.testing.assert_close(V.T @ GV, GV.T @ V, rtol=1e-9, atol=1e-11)  # symmetric
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN's LSTM)")
@pytest.mark.parametrize("engine", ["functional", "traced"])
def test_lstm_steps_on_cuda_with_cudnn_enabled(engine):
    # cuDNN's LSTM reads its weights' data pointers, which torch.func's and the tracer's
    # tensors lack: the curvature passes run it without cuDNN, products against a CPU float64
    # reference.
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 5, batch_first=True)
            self.head = nn.Linear(5, 2)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    model = Net().double()
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    G, _, _ = dense_ggn(model, "mse", x, y)
    v = torch.randn(G.shape[0], dtype=torch.float64)
    assert torch.backends.cudnn.enabled
    cuda = model.cuda()
    fm = FunctionalModel(cuda)
    lin = select_engine(fm, resolve_loss("mse"), engine)(fm.flat(), Batch(x.cuda(), y.cuda()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the double-backward route's one-time notice
        torch.testing.assert_close(lin.ggn_vp(v.cuda()).cpu(), G @ v, rtol=1e-8, atol=1e-10)
    info = SGN(cuda, "mse", engine=engine, solver="cg").step(x.cuda(), y.cuda())
    assert info.loss_after <= info.loss
