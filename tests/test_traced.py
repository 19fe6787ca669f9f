"""The traced engine: exact products for models that are not chains of known layers."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cases import (
    ZOO,
    BranchesOnValues,
    Recurrent,
    SineWithoutJvp,
    dense_ggn,
    loss_fn,
    make_model,
)
from torch_sgn import GGN, SGN
from torch_sgn.engines.layerwise.engine import LayerwiseEngine
from torch_sgn.engines.selection import select_engine
from torch_sgn.engines.traced.engine import TracedEngine
from torch_sgn.engines.traced.jvp_rules import BatchNorm, LayerNorm, LSTMLayer, Softmax
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel

D = torch.float64


# the families of the zoo (cases.ZOO) this file runs: small enough for a dense G, one product
# per parameter
FAMILIES = [
    "resnet-bn",
    "attention",
    "mha-mask",
    "lstm-small",
    "gru-small",
    "two-inputs",
    "encoder-layer",
]


def _count_jvp_calls(monkeypatch, rule) -> list:
    """Patches ``rule.jvp`` to record each call; the list it appends to."""
    calls = []
    jvp = rule.jvp
    monkeypatch.setattr(rule, "jvp", staticmethod(lambda *a: calls.append(1) or jvp(*a)))
    return calls


def _traced(model, loss):
    return TracedEngine(FunctionalModel(model), resolve_loss(loss), strict=True)


def _matches_dense_reference(model, inputs, targets, loss="mse"):
    """The traced engine's gradient and ``G`` (every product with a unit vector) against
    :func:`cases.dense_ggn`, in float64; the engine, for further checks."""
    G_ref, g_ref, _ = dense_ggn(model, loss, inputs, targets)
    engine = _traced(model, loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a route's report; tested where it matters
        lin = engine(engine.fmodel.flat(), Batch(inputs, targets))
    G = torch.stack([lin.ggn_vp(e) for e in torch.eye(engine.fmodel.numel, dtype=D)], 1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)
    return engine


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", FAMILIES)
def test_traced_products_match_the_dense_reference(name, train):
    model, x, y, loss = make_model(name)
    model.train(train)
    if train and name == "mha-mask":
        model.eval()  # dropout: a random function; its train mode is tested below
    G_ref, g_ref, _ = dense_ggn(model, loss, x, y)
    engine = _traced(model, loss)
    fmodel = engine.fmodel
    lin = engine(fmodel.flat(), Batch(x, y))
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    eye = torch.eye(fmodel.numel, dtype=D)
    G = torch.stack([lin.ggn_vp(e) for e in eye], dim=1)
    torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(G, G.T, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lin.loss, loss_fn(loss)(lin.outputs, y))
    if not train:
        with torch.no_grad():
            z = model(*(x if isinstance(x, tuple) else (x,)))
        torch.testing.assert_close(lin.outputs, z)


def test_batch_norm_running_statistics_are_updated_once_per_step():
    model, x, y, loss = make_model("resnet-bn")
    twin = copy.deepcopy(model)
    before = {n: b.clone() for n, b in model.named_buffers()}
    engine = _traced(model, loss)
    out: dict = {}
    lin = engine(engine.fmodel.flat(), Batch(x, y), out)
    for _ in range(3):
        lin.ggn_vp(torch.ones(engine.fmodel.numel, dtype=D))
    for n, b in model.named_buffers():  # the model's own buffers are untouched
        assert torch.equal(b, before[n])
    twin(x)  # one eager training-mode forward pass
    expected = dict(twin.named_buffers())
    assert set(out) == set(expected)
    for n, b in out.items():
        torch.testing.assert_close(b, expected[n], rtol=1e-13, atol=0)
    assert int(out["bn.num_batches_tracked"]) == 1


@pytest.mark.parametrize("fraction", [1.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_training_mode_dropout_is_consistent_and_matches_the_functional_engine(fraction):
    # With a curvature subset the engine runs twice per step: both replay the step's numbers.
    model, x, y, loss = make_model("mha-mask")
    twin = copy.deepcopy(model)
    states, infos = [], {}
    for m, engine in ((model, "traced"), (twin, "functional")):
        torch.manual_seed(3)
        opt = SGN(m, loss, engine=engine, cg_iters=4, curvature_fraction=fraction)
        infos[engine] = [opt.step(x, y) for _ in range(3)]
        states.append(torch.get_rng_state())
    torch.testing.assert_close(dict(model.named_parameters()), dict(twin.named_parameters()))
    assert torch.equal(states[0], states[1])  # one forward pass's random numbers per step
    for a, b in zip(infos["traced"], infos["functional"]):
        assert a.loss == pytest.approx(b.loss, rel=1e-12)
        assert a.loss_after == pytest.approx(b.loss_after, rel=1e-12)


def test_one_trace_per_shape_and_mode():
    model, x, y, loss = make_model("resnet-bn")
    engine = _traced(model, loss)
    flat = engine.fmodel.flat()
    for _ in range(2):
        engine(flat, Batch(x, y))
    assert len(engine._cache) == 1
    engine(flat, Batch(x[:4], y[:4]))
    model.eval()
    lin = engine(flat, Batch(x, y))
    assert len(engine._cache) == 3
    G_ref, _, _ = dense_ggn(model, F.cross_entropy, x, y)
    v = torch.randn(engine.fmodel.numel, dtype=D)
    torch.testing.assert_close(lin.ggn_vp(v), G_ref @ v, rtol=1e-9, atol=1e-11)


class _Annealed(nn.Module):
    """Reads plain Python attributes in ``forward``: a temperature, a flag, a tensor."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.temperature, self.skip = 1.0, False
        self.shift = torch.zeros(3, dtype=D)

    def forward(self, x):
        out = self.b(torch.tanh(self.a(x) / self.temperature)) + self.shift
        return out + x[:, :3] if self.skip else out


def test_a_changed_model_attribute_is_traced_again():
    torch.manual_seed(0)
    model = _Annealed().to(D)
    x, y = torch.randn(6, 4, dtype=D), torch.randn(6, 3, dtype=D)
    engine = _traced(model, "mse")
    flat = engine.fmodel.flat()
    changes = [
        lambda: setattr(model, "temperature", 3.0),
        lambda: setattr(model, "skip", True),
        lambda: setattr(model, "shift", torch.ones(3, dtype=D)),  # another tensor
        lambda: model.shift.fill_(2.0),  # the same tensor, changed in place: no new trace
    ]
    for change in [lambda: None] + changes:
        change()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # each attribute changed once: no hand-over
            lin = engine(flat, Batch(x, y))
        assert torch.equal(lin.loss, F.mse_loss(model(x), y))
        G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, x, y)
        v = torch.randn(engine.fmodel.numel, dtype=D)
        torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lin.ggn_vp(v), G_ref @ v, rtol=1e-9, atol=1e-11)
    assert len(engine._cache) == 4


def _lenient(build):
    """A model of ``build``, a batch, the traced engine that hands over to the functional
    engine (engine="traced") and that traced engine."""
    torch.manual_seed(0)
    model = build().to(D)
    x, y = torch.randn(6, 4, dtype=D), torch.randn(6, 3, dtype=D)
    fmodel = FunctionalModel(model)
    engine = select_engine(fmodel, resolve_loss("mse"), "traced")
    return model, x, y, engine, engine.engines[0], fmodel.flat()


def test_an_attribute_that_keeps_changing_hands_the_model_to_the_functional_engine():
    model, x, y, engine, traced, flat = _lenient(_Annealed)
    engine(flat, Batch(x, y))
    with pytest.warns(UserWarning, match="attribute temperature changed at 3 steps.*buffer"):
        for step in range(1, 5):
            model.temperature = 1.0 + step
            lin = engine(flat, Batch(x, y))
            assert torch.equal(lin.loss, F.mse_loss(model(x), y))
    assert len(traced._cache) == 3  # the fourth change ran on the functional engine
    G_ref, _, _ = dense_ggn(model, F.mse_loss, x, y)
    v = torch.randn(traced.fmodel.numel, dtype=D)
    torch.testing.assert_close(lin.ggn_vp(v), G_ref @ v, rtol=1e-9, atol=1e-11)


class _WritesItsAttributes(nn.Module):
    """Writes attributes in ``forward`` (a count, the last hidden state), as the older
    ``weight_norm`` hook writes ``weight``: state of the pass, not a setting."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.calls, self.last = 0, None

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.a(x))
        self.last = h.detach()
        return self.b(h)


def test_attributes_the_forward_pass_writes_do_not_call_for_new_traces():
    model, x, y, engine, traced, flat = _lenient(_WritesItsAttributes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no hand-over to the functional engine
        engine(flat, Batch(x, y))
        assert model.calls == 0 and model.last is None  # the trace's writes (fakes) undone
        for _ in range(5):
            model(x)  # the user's own passes write them
            lin = engine(flat, Batch(x, y))
    assert len(traced._cache) == 1
    assert type(model.last) is torch.Tensor and model.calls == 5
    G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, x, y)
    v = torch.randn(traced.fmodel.numel, dtype=D)
    torch.testing.assert_close(lin.ggn_vp(v), G_ref @ v, rtol=1e-9, atol=1e-11)


def test_a_changed_attribute_of_a_loss_module_is_traced_again():
    torch.manual_seed(0)
    model = ZOO["mlp"].build().to(D)
    x, y = torch.randn(6, 4, dtype=D), torch.randn(6, 3, dtype=D)
    huber = nn.HuberLoss(delta=0.1)
    engine = TracedEngine(FunctionalModel(model), resolve_loss(huber))
    flat = engine.fmodel.flat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Huber loss's double backward
        for delta in (0.1, 2.0):
            huber.delta = delta
            lin = engine(flat, Batch(x, y))
            assert torch.equal(lin.loss, huber(model(x), y))
            G_ref, _, _ = dense_ggn(model, huber, x, y)
            v = torch.randn(engine.fmodel.numel, dtype=D)
            torch.testing.assert_close(lin.ggn_vp(v), G_ref @ v, rtol=1e-9, atol=1e-11)


def test_untraceable_model_falls_back_to_functional_with_the_reason_once():
    torch.manual_seed(0)
    model = BranchesOnValues().to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    with pytest.raises(ValueError, match="cannot trace"):
        GGN(model, "mse", x, y, engine="traced")
    with pytest.warns(UserWarning, match="cannot trace.*functional engine") as record:
        opt = SGN(copy.deepcopy(model), "mse", engine="auto", cg_iters=3)
        for _ in range(3):
            opt.step(x, y)
    assert len([r for r in record if "cannot trace" in str(r.message)]) == 1
    ref = SGN(model, "mse", engine="functional", cg_iters=3)
    for _ in range(3):
        ref.step(x, y)
    trained, reference = opt._fmodel.model.named_parameters(), model.named_parameters()
    torch.testing.assert_close(dict(trained), dict(reference))
    for flip in (1.0, -1.0):  # both branches, as the model takes them
        xs = flip * x
        G_ref, _, _ = dense_ggn(model, F.mse_loss, xs, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            G = GGN(model, "mse", xs, y, engine="auto").to_dense()
        torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)


@pytest.mark.slow  # a ResNet block against the dense reference, behind torch.compile's wrapper
def test_a_model_compiled_by_torch_compile_is_traced_as_the_module_it_wraps():
    model, x, y, loss = make_model("resnet-bn")
    compiled = torch.compile(model)  # compiled at its first call, which never comes here
    engine = _matches_dense_reference(compiled, x, y, loss)  # strict: no fallback
    assert engine.fmodel.model is model
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "cannot trace" fallback
        opt = SGN(compiled, loss, cg_iters=3)
        opt.step(x, y)
    assert opt._fmodel.model is model
    assert all(a is b for a, b in zip(compiled.parameters(), model.parameters()))


class _CompiledBlock(nn.Module):
    """A block compiled by ``torch.compile`` inside a module that is not."""

    def __init__(self):
        super().__init__()
        self.block = torch.compile(nn.Sequential(nn.Linear(4, 5), nn.Tanh()))
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.block(x))


def test_compiled_submodules_are_traced_as_the_modules_they_wrap():
    torch.manual_seed(0)
    model = _CompiledBlock().to(D)
    x, y = torch.randn(6, 4, dtype=D), torch.randn(6, 3, dtype=D)
    _matches_dense_reference(model, x, y)  # strict: a failed trace would raise
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "cannot trace" hand-over
        SGN(model, "mse", cg_iters=3).step(x, y)
    assert torch.equal(model(x), model.head(model.block._orig_mod(x)))  # the user's own call


def test_a_submodule_compiled_in_place_is_traced_as_it_is():
    torch.manual_seed(0)
    model = ZOO["mlp"].build().to(D)
    model[0].compile()  # nn.Module.compile: the module itself, its calls compiled
    x, y = torch.randn(6, 4, dtype=D), torch.randn(6, 3, dtype=D)
    _matches_dense_reference(model, x, y)  # strict: a failed trace would raise


def test_auto_takes_the_layerwise_engine_for_chains_and_the_traced_engine_else():
    chain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    loss = resolve_loss("mse")
    layerwise, traced, _ = select_engine(FunctionalModel(chain), loss, "auto").engines
    assert isinstance(layerwise, LayerwiseEngine) and layerwise._steps is not None
    model, x, y, loss_name = make_model("resnet-bn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the traced engine applies
        auto = select_engine(FunctionalModel(model), resolve_loss(loss_name), "auto")
        lin = auto(FunctionalModel(model).flat(), Batch(x, y))
    layerwise, traced, _ = auto.engines
    assert layerwise._steps is None and isinstance(traced, TracedEngine)
    assert len(traced._cache) == 1  # it traced the model
    G_ref, _, _ = dense_ggn(model, F.cross_entropy, x, y)
    v = torch.randn(G_ref.shape[0], dtype=D)
    torch.testing.assert_close(lin.ggn_vp(v), G_ref @ v, rtol=1e-9, atol=1e-11)


def test_tracing_leaves_the_kernel_settings_as_they_were():
    mkldnn = torch.backends.mkldnn.enabled
    model, x, y, loss = make_model("lstm-small", dtype=torch.float32)
    _traced(model, loss)(FunctionalModel(model).flat(), Batch(x, y))
    assert torch.backends.mkldnn.enabled == mkldnn


@pytest.mark.parametrize("name", FAMILIES)
def test_sgn_steps_in_float32_reduce_the_loss(name):
    model, x, y, loss = make_model(name, dtype=torch.float32)
    model.train(name != "mha-mask")
    opt = SGN(model, loss, engine="traced", cg_iters=5)
    infos = [opt.step(x, y) for _ in range(4)]
    assert all(torch.isfinite(torch.tensor([i.loss, i.loss_after])).all() for i in infos)
    assert infos[-1].loss_after < infos[0].loss


def test_a_loss_linear_in_the_outputs_gives_zero_products():
    # H = 0, so G v does not depend on v: the product graph has no operator on v.
    model, x, labels, _ = make_model("resnet-bn")
    y = F.one_hot(labels, 3).to(D)

    def linear_loss(z, t):
        return (z * t).sum()

    engine = _traced(model, linear_loss)
    lin = engine(engine.fmodel.flat(), Batch(x, y))
    v = torch.randn(engine.fmodel.numel, dtype=D)
    first = lin.ggn_vp(v)
    assert torch.count_nonzero(first) == 0
    first.add_(1.0)  # the next product is a fresh tensor
    assert torch.count_nonzero(lin.ggn_vp(v)) == 0
    _, g_ref, _ = dense_ggn(model, linear_loss, x, y)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)


# --- the tangent rules (torch_sgn.engines.traced.jvp_rules)
# ------------------------------------------------
def _norms(variant):
    """Batch-norm variants the rule must cover: 1-d on (N, C) and (N, C, L), 2-d without the
    affine map, without running statistics, another momentum."""
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    if variant == "1d-flat":
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
        x = torch.randn(7, 3, generator=g)
    elif variant == "1d-seq":
        model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.BatchNorm1d(3, momentum=0.3), nn.Flatten())
        model.append(nn.Linear(9, 2))
        x = torch.randn(5, 2, 4, generator=g)
    elif variant == "2d-no-affine":
        model = nn.Sequential(nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3, affine=False), nn.ReLU())
        model.extend([nn.Flatten(), nn.Linear(12, 2)])
        x = torch.randn(4, 2, 3, 3, generator=g)
    elif variant == "2d-no-running":
        model = nn.Sequential(nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3, track_running_stats=False))
        model.extend([nn.Sigmoid(), nn.Flatten(), nn.Linear(12, 2)])
        x = torch.randn(4, 2, 3, 3, generator=g)
    else:
        raise KeyError(variant)
    with torch.no_grad():  # running statistics other than the initial ones
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
    return model.to(D), x.to(D), torch.randn(x.shape[0], 2, generator=g).to(D)


NORMS = ["1d-flat", "1d-seq", "2d-no-affine", "2d-no-running"]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", NORMS)
def test_batch_norm_rule_matches_the_dense_reference(variant, train, monkeypatch):
    model, x, y = _norms(variant)
    model.train(train)
    G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, x, y)
    twin = copy.deepcopy(model)
    calls = _count_jvp_calls(monkeypatch, BatchNorm)
    engine = _traced(model, "mse")
    out: dict = {}
    lin = engine(engine.fmodel.flat(), Batch(x, y), out)
    assert calls  # the products were recorded with the rule
    eye = torch.eye(engine.fmodel.numel, dtype=D)
    G = torch.stack([lin.ggn_vp(e) for e in eye], dim=1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)
    twin(x)  # the running statistics as one eager forward pass leaves them
    for name, b in twin.named_buffers():
        torch.testing.assert_close(out.get(name, b), b, rtol=1e-13, atol=0)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_rule_gives_the_products_of_pytorchs_own_rule(train, monkeypatch):
    import torch_sgn.engines.traced.trace as traced

    model, x, y, loss = make_model("resnet-bn")
    model.train(train)
    v = torch.randn(FunctionalModel(model).numel, dtype=D)
    products = []
    for rules in (True, False):
        monkeypatch.setattr(traced, "TANGENT_RULES", rules)
        engine = _traced(model, loss)
        products.append(engine(engine.fmodel.flat(), Batch(x, y)).ggn_vp(v))
    torch.testing.assert_close(products[0], products[1], rtol=1e-12, atol=1e-14)


def test_graph_passes_fuse_matrix_products_and_merge_repeats():
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_sgn.engines.traced.passes import eliminate_common_subexpressions, fuse_matmul_adds

    def f(a, b, c, d):
        s = torch.tanh(a) + torch.tanh(a)  # the same operation twice
        return s, c + a @ b, torch.bmm(d, d) + d, (a @ b).double() + 1  # last: no fusion

    args = (torch.randn(3, 4), torch.randn(4, 3), torch.randn(3), torch.randn(2, 3, 3))
    gm = make_fx(f)(*args)
    expected = f(*args)
    fuse_matmul_adds(gm.graph)
    eliminate_common_subexpressions(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    aten = torch.ops.aten
    assert targets.count(aten.tanh.default) == 1
    assert targets.count(aten.addmm.default) == 1 and targets.count(aten.baddbmm.default) == 1
    assert targets.count(aten.mm.default) == 1  # the one whose sum changes dtype stays
    for got, want in zip(gm(*args), expected):
        torch.testing.assert_close(got, want)

    def g(a):  # an in-place write: equal-looking nodes may differ, nothing is merged
        x, y = a.clone(), a.clone()
        x.add_(1)
        return x + y

    gm = make_fx(g)(args[0])
    before = len(gm.graph.nodes)
    eliminate_common_subexpressions(gm.graph)
    assert len(gm.graph.nodes) == before

    def h(a, b, c):  # a factor written after the product: the product stays where it is
        t = a @ b
        a.mul_(2.0)
        return c + t

    gm = make_fx(h)(*[t.clone() for t in args[:3]])
    fuse_matmul_adds(gm.graph)
    gm.recompile()
    assert aten.addmm.default not in [n.target for n in gm.graph.nodes]
    torch.testing.assert_close(
        gm(*[t.clone() for t in args[:3]]), h(*[t.clone() for t in args[:3]])
    )


class _Activations(nn.Module):
    """The activations whose derivatives the engine takes once per step as factors."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = F.gelu(self.a(x)) + F.gelu(self.a(x), approximate="tanh") + F.silu(self.a(x))
        h = self.b(F.elu(h, alpha=0.7) + F.softplus(h, beta=2.0) + F.mish(h))
        return self.head(F.gelu(h) * h)  # the same activation twice, one input used twice


@pytest.mark.parametrize("hoist", [True, False], ids=["hoisted", "as-traced"])
def test_activation_derivatives_taken_once_per_step_match_the_dense_reference(hoist, monkeypatch):
    import torch_sgn.engines.traced.passes as traced

    monkeypatch.setattr(traced, "HOIST_DERIVATIVES", hoist)
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(4)
    model = _Activations().to(D)
    x, y = torch.randn(6, 3, generator=g).to(D), torch.randn(6, 2, generator=g).to(D)
    engine = _matches_dense_reference(model, x, y)
    (trace,) = engine._cache.values()
    in_product = [n.target for n in trace.product.graph.nodes if n.target in traced.DERIVATIVES]
    in_setup = [n.target for n in trace.setup.graph.nodes if n.target in traced.DERIVATIVES]
    if hoist:  # one factor per activation and input, in the set-up; none in a product
        assert not in_product
        assert sorted(map(str, in_setup)) == sorted(
            map(str, [traced.DERIVATIVES[i] for i in (0, 0, 1, 3, 4, 2, 0)])
        )
    else:  # evaluated in every product: in the reverse pass, and (but SiLU's and Mish's
        # forward-mode rules) in the tangent
        assert len(in_product) == 12 and set(in_product) == set(traced.DERIVATIVES)


def test_matrix_products_accumulate_in_place_into_temporaries_only():
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_sgn.engines.traced.passes import accumulate_in_place

    def f(a, b, c, bias):
        t = a @ b  # a temporary read once: the sum accumulates into it
        u = a @ b.T  # read twice: copied first
        s = torch.addmm(torch.addmm(bias, a, b), c, b)  # broadcast bias, then a temporary
        return torch.addmm(t, c, b), torch.addmm(u, c, b.T) + u, torch.addmm(c, a, b), s

    def g(a, b, c):  # an in-place write into an input, as traced: its result is c
        return torch.addmm(c.add_(0.0), a, b)

    args = (torch.randn(3, 3), torch.randn(3, 3), torch.randn(3, 3), torch.randn(3))
    gm = make_fx(f)(*args)
    expected = f(*args)
    accumulate_in_place(gm.graph)
    gm.recompile()
    aten = torch.ops.aten
    targets = [n.target for n in gm.graph.nodes]
    # the first sum, the second addmm of s and the addition of u to a sum of its own; not u's
    # addmm (u is read twice), not c (an input), not the bias (broadcast)
    assert targets.count(aten.addmm_.default) == 2
    assert targets.count(aten.addmm.default) == 3
    assert targets.count(aten.add_.Tensor) == 1
    saved = [a.clone() for a in args]
    for got, want in zip(gm(*args), expected):
        torch.testing.assert_close(got, want)
    for a, b in zip(args, saved):  # no input written
        assert torch.equal(a, b)
    gm = make_fx(g)(*args[:3])
    accumulate_in_place(gm.graph)
    gm.recompile()
    assert [n.target for n in gm.graph.nodes].count(aten.addmm.default) == 1
    torch.testing.assert_close(gm(*args[:3]), g(*saved[:3]))
    assert torch.equal(args[2], saved[2])


class _Lookups(nn.Module):
    """Embeddings that feed matrix products: an LSTM (through a transpose and a copy), a linear
    layer through a permute, and a table with more rows than the batch has tokens."""

    def __init__(self, **options):
        super().__init__()
        self.embed, self.embed2 = nn.Embedding(4, 3, **options), nn.Embedding(4, 3, **options)
        self.embed3 = nn.Embedding(40, 3, **options)
        self.rnn = nn.LSTM(3, 3, batch_first=True)
        self.side, self.side3, self.head = nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, idx):
        s = self.side(self.embed2(idx).permute(1, 0, 2)).permute(1, 0, 2)
        return self.head(self.rnn(self.embed(idx))[0]) + s + self.side3(self.embed3(idx))


def _lookups(build=_Lookups, **options):
    """(model, indices, targets) of a :class:`_Lookups` model, 15 tokens per batch."""
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(5)
    model = build(**options).to(D)
    return model, torch.randint(0, 4, (3, 5), generator=g), torch.randn(3, 5, 2, generator=g).to(D)


@pytest.mark.parametrize("reorder", [True, False], ids=["reordered", "as-traced"])
def test_products_of_embedding_rows_match_the_dense_reference(reorder, monkeypatch):
    import torch_sgn.engines.traced.passes as traced

    monkeypatch.setattr(traced, "EMBEDDING_PRODUCTS", reorder)
    engine = _matches_dense_reference(*_lookups())
    aten = torch.ops.aten
    (trace,) = engine._cache.values()
    # the two small tables' products are taken on the tables: in the set-up, each forward
    # pass's and reverse pass's; in a product, the tangent's (both terms of the linear layer's,
    # x dW^T and dx W^T, are lookups) and the reverse pass's. The large table's on the batch.
    expected = (
        {"setup": (2, 2), "product": (3, 2)} if reorder else {"setup": (0, 0), "product": (0, 0)}
    )
    for part in expected:
        nodes = list(getattr(trace, part).graph.nodes)
        lookups = [n for n in nodes if n.target is aten.embedding.default]
        scatters = [n for n in nodes if n.target is aten.embedding_dense_backward.default]
        of_products = [
            n for n in lookups if n.args[0].target in (aten.mm.default, aten.addmm.default)
        ]
        into_products = [n for n in scatters if [u.target for u in n.users] == [aten.mm.default]]
        assert (len(of_products), len(into_products)) == expected[part]
        # biases join the table's product, and the LSTM tangent's other term accumulates into
        # the looked-up rows: the one full-size addition left adds the side layer's two lookups
        adds = [n for n in nodes if n.target in (aten.add.Tensor, aten.add_.Tensor)]
        added = [n for n in adds if any(a in lookups for a in n.args)]
        assert len(added) == (int(part == "product") if reorder else 0)
        large = [n for n in scatters if n.args[2] == 40]
        assert len(large) == 1 and [u.target for u in large[0].users] != [aten.mm.default]


class _LookupsWithoutJvp(_Lookups):
    def forward(self, idx):
        return SineWithoutJvp.apply(super().forward(idx))


def test_products_of_embedding_rows_on_the_double_backward_route():
    engine = _matches_dense_reference(*_lookups(_LookupsWithoutJvp))
    (trace,) = engine._cache.values()
    aten = torch.ops.aten
    lookups = [n for n in trace.product.graph.nodes if n.target is aten.embedding.default]
    assert trace.double_backward
    assert any(n.args[0].target in (aten.mm.default, aten.addmm.default) for n in lookups)


class _WrittenLookups(nn.Module):
    """Looked-up rows written in place after a view of them was taken: the view sees the
    write, so a product of the view is not a product of the table's rows."""

    def __init__(self):
        super().__init__()
        self.embed, self.embed2 = nn.Embedding(4, 3), nn.Embedding(4, 3)
        self.position = nn.Parameter(torch.randn(5, 3))
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, idx):
        x, z = self.embed(idx), self.embed2(idx)
        rows, zt = x.view(-1, 3), z.transpose(0, 1)
        x.mul_(3.0)
        z.add_(self.position)
        return self.a(rows).view(*idx.shape, 2) + self.b(zt).transpose(0, 1)


def test_products_of_embedding_rows_written_in_place_match_the_dense_reference():
    torch.manual_seed(6)
    g = torch.Generator().manual_seed(6)
    model = _WrittenLookups().to(D)
    idx, y = torch.randint(0, 4, (3, 5), generator=g), torch.randn(3, 5, 2, generator=g).to(D)
    _matches_dense_reference(model, idx, y)


class _OwnLookup(nn.Embedding):
    """An embedding with a forward pass of its own."""

    def forward(self, idx):
        return super().forward(idx)


@pytest.mark.parametrize("engine", ["auto", "functional"])
def test_frequency_scaled_embeddings_give_the_symmetric_matrix_of_their_gradient(engine):
    """With ``scale_grad_by_freq`` the gradient is ``D J^T dz`` (``D`` divides each row by its
    count in the batch): the products are those of ``D J^T H J D``, whose reverse-mode rows
    are the dense reference's; the same for a subclass with a forward of its own."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Embedding(4, 3, scale_grad_by_freq=True), nn.Flatten())
    model.append(nn.Linear(15, 2)).to(D)
    idx, y = torch.randint(0, 4, (6, 5)), torch.randn(6, 2, dtype=D)
    G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, idx, y)
    own = _OwnLookup(4, 3, scale_grad_by_freq=True).to(D)
    own.load_state_dict(model[0].state_dict())
    for first in (model[0], own):
        model[0] = first
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            G = GGN(model, "mse", idx, y, engine=engine)
            dense = G.to_dense()
        torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(dense, dense.T, rtol=1e-12, atol=1e-14)


def test_reordered_embedding_products_keep_padding_and_frequency_scaling(monkeypatch):
    import torch_sgn.engines.traced.passes as traced

    lins = []
    for reorder in (True, False):
        monkeypatch.setattr(traced, "EMBEDDING_PRODUCTS", reorder)
        model, idx, y = _lookups(padding_idx=1, scale_grad_by_freq=True)
        engine = _traced(model, "mse")
        lins.append(engine(engine.fmodel.flat(), Batch(idx, y)))
    lin, reference = lins
    for v in torch.randn(3, engine.fmodel.numel, dtype=D):
        torch.testing.assert_close(lin.ggn_vp(v), reference.ggn_vp(v), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lin.grad, reference.grad, rtol=1e-12, atol=1e-14)


class _Propagation(nn.Module):
    """``h + adj @ h``: the reverse pass adds ``adj^T g`` to ``g``, a product that reads the
    temporary it is added to."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, adj):
        h = self.a(x)
        return self.b(h + adj @ h)


def test_a_sum_is_not_accumulated_into_an_operand_of_its_own_product():
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(7)
    model = _Propagation().to(D)
    # 16 rows: matrix-product kernels give wrong results from there on when the output is
    # also a factor
    x, adj = torch.randn(16, 3, generator=g).to(D), torch.rand(16, 16, generator=g).to(D) / 16
    y = torch.randn(16, 2, generator=g).to(D)
    _matches_dense_reference(model, (x, adj), y)


class _Transposed(nn.Module):
    """A linear layer on a transposed input, transposed back: the loss's backward kernel
    returns another memory layout than tracing saw, where a ``view`` of it failed."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x.transpose(0, 1)).transpose(0, 1)


def test_a_real_kernel_with_another_memory_layout_than_traced_is_exact():
    torch.manual_seed(8)
    g = torch.Generator().manual_seed(8)
    model = _Transposed().to(D)
    x, y = torch.randn(3, 5, 3, generator=g).to(D), torch.randn(3, 5, 2, generator=g).to(D)
    _matches_dense_reference(model, x, y)


class _LSTMVariant(nn.Module):
    """nn.LSTM as the rule must take it: layers, directions, biases, batch layout, initial
    states, dropout between layers. Every output is read: the outputs at the last time step
    and all final states, each layer's and direction's by its own weights."""

    def __init__(
        self, layers=1, bias=True, batch_first=True, states=False, dropout=0.0,
        bidirectional=False, hidden=4,
    ):  # fmt: skip
        super().__init__()
        self.rnn = nn.LSTM(
            3, hidden, layers, bias=bias, batch_first=batch_first, dropout=dropout,
            bidirectional=bidirectional,
        )  # fmt: skip
        self.batch_first, self.states = batch_first, states
        directions = 2 if bidirectional else 1
        self.h0 = nn.Parameter(torch.randn(layers * directions, 1, hidden) * 0.5)
        self.head = nn.Linear(hidden * directions, 2)
        self.last = nn.Linear(2 * hidden * layers * directions, 2)  # the final states' read-out

    def forward(self, x):
        if not self.batch_first:
            x = x.transpose(0, 1)
        n = x.shape[0 if self.batch_first else 1]
        if self.states:
            h0 = self.h0.expand(-1, n, -1).contiguous()
            out, (h, c) = self.rnn(x, (h0, torch.tanh(h0)))
        else:
            out, (h, c) = self.rnn(x)
        out = out[:, -1] if self.batch_first else out[-1]
        return self.head(out) + self.last(torch.cat([h, c], 2).transpose(0, 1).flatten(1))


LSTMS = {
    "one-layer": {},
    "two-layers-no-bias": {"layers": 2, "bias": False},
    "time-first-with-states": {"batch_first": False, "states": True},
    "two-layers-dropout": {"layers": 2, "dropout": 0.5},
    "bidirectional-with-states": {"bidirectional": True, "states": True},
    # two units a direction: 292 parameters, a product each (836 with four units)
    "bidirectional-two-layers-dropout": {
        "bidirectional": True,
        "layers": 2,
        "dropout": 0.5,
        "hidden": 2,
    },
    "bidirectional-two-layers-states": {
        "bidirectional": True,
        "layers": 2,
        "states": True,
        "hidden": 2,
    },
}


def _lstm_cases() -> list:
    """(variant, train) for every variant and mode. Training mode changes the rule's work only
    through dropout between layers: without it, every variant's training-mode case (the same
    products as its evaluation mode's) runs with the slow tests, and so do the two-layer
    bidirectional variants but one, the one with dropout in training mode (the others take the
    same rule's paths: two layers in "two-layers-dropout", both directions' initial states in
    "bidirectional-with-states")."""
    slow = {
        ("one-layer", True),
        ("two-layers-no-bias", True),
        ("time-first-with-states", True),
        ("bidirectional-with-states", True),
        ("bidirectional-two-layers-states", True),
        ("bidirectional-two-layers-states", False),
        ("bidirectional-two-layers-dropout", False),
    }
    return [
        pytest.param(
            variant,
            train,
            id=f"{variant}-{'train' if train else 'eval'}",
            marks=pytest.mark.slow if (variant, train) in slow else (),
        )
        for variant in LSTMS
        for train in (True, False)
    ]


@pytest.mark.parametrize("variant, train", _lstm_cases())
def test_lstm_rule_matches_the_dense_reference(variant, train, monkeypatch):
    # In training mode, dropout between layers draws its masks as PyTorch's kernels do: the
    # reference, seeded as the engine's pass is, sees the same masks.
    torch.manual_seed(2)
    model = _LSTMVariant(**LSTMS[variant]).to(D).train(train)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(3, 5, 3, generator=g).to(D), torch.randn(3, 2, generator=g).to(D)
    calls = _count_jvp_calls(monkeypatch, LSTMLayer)
    G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, x, y, seed=11)
    engine = _traced(model, "mse")
    torch.manual_seed(11)
    engine.fmodel.freeze_rng()
    with warnings.catch_warnings():  # the rule applies, and does not fail and fall back
        warnings.filterwarnings("error", message=".*tangent rules")
        lin = engine(engine.fmodel.flat(), Batch(x, y))
    assert calls  # the products were recorded with the rule
    eye = torch.eye(engine.fmodel.numel, dtype=D)
    G = torch.stack([lin.ggn_vp(e) for e in eye], dim=1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)
    if LSTMS[variant].get("dropout") and train:  # the masks matter: another draw differs
        G_other, _, _ = dense_ggn(model, F.mse_loss, x, y, seed=12)
        assert (G_other - G_ref).abs().max() > 1e-3


def test_a_failing_tangent_rule_falls_back_to_pytorchs_rules_with_the_reason(monkeypatch):
    def broken(*args):
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(BatchNorm, "jvp", staticmethod(broken))
    model, x, y, loss = make_model("resnet-bn")
    engine = TracedEngine(FunctionalModel(model), resolve_loss(loss))
    with pytest.warns(UserWarning, match="tangent rules.*no such kernel here"):
        lin = engine(engine.fmodel.flat(), Batch(x, y))
    assert list(engine._cache.values())[0].declined is not None  # traced, without the rule
    G_ref, _, _ = dense_ggn(model, F.cross_entropy, x, y)
    v = torch.randn(engine.fmodel.numel, dtype=D)
    torch.testing.assert_close(lin.ggn_vp(v), G_ref @ v, rtol=1e-9, atol=1e-11)


class _Warp(nn.Module):
    """A spatial transformer: ``grid_sample``, whose kernel has no forward-mode rule."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Linear(16, 6)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        identity = torch.tensor([[1.0, 0, 0], [0, 1, 0]], dtype=x.dtype)
        theta = self.theta(x.flatten(1)).view(-1, 2, 3) * 0.1 + identity
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.head(F.grid_sample(x, grid, align_corners=False).flatten(1))


def _grid_sample_has_a_second_derivative() -> bool:
    """Whether this torch differentiates ``grid_sample``'s backward (torch 2.11 does not: the
    second reverse pass the engine falls back to then fails, and the engine says so)."""
    x = torch.randn(1, 1, 3, 3, dtype=D, requires_grad=True)
    grid = torch.zeros(1, 2, 2, 2, dtype=D, requires_grad=True)
    (gx,) = torch.autograd.grad(F.grid_sample(x, grid, align_corners=False).sum(), x,
                                create_graph=True)  # fmt: skip
    try:
        torch.autograd.grad(gx.sum(), grid)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(
    not _grid_sample_has_a_second_derivative(),
    reason="this torch has no derivative of grid_sample's backward",
)
def test_an_operator_without_a_forward_rule_is_named_once_not_blamed_on_the_rules():
    torch.manual_seed(4)
    model = _Warp().to(D)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(3, 1, 4, 4, generator=g).to(D), torch.randn(3, 2, generator=g).to(D)
    G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, x, y)
    engine = _traced(model, "mse")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lin = engine(engine.fmodel.flat(), Batch(x, y))
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert "no rule for grid_sampler_2d" in messages[0] and "second reverse pass" in messages[0]
    G = torch.stack([lin.ggn_vp(e) for e in torch.eye(engine.fmodel.numel, dtype=D)], 1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "train",
    [pytest.param(True, id="train"), pytest.param(False, id="eval", marks=pytest.mark.slow)],
)  # (the mode changes only the norm layer's statistics, whose rule the other tests check)
def test_rules_with_frozen_parameters_and_projections(train, monkeypatch):
    # Frozen parameters have no tangent and no gradient; an LSTM with projections
    # (proj_size > 0) is declined by the rule and recorded with PyTorch's own rules.
    calls = _count_jvp_calls(monkeypatch, LSTMLayer)
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    norm_model, x, y = _norms("1d-flat")
    norm_model[1].weight.requires_grad_(False)
    norm_model[1].bias.requires_grad_(False)
    lstm = _LSTMVariant(layers=2).to(D)
    lstm.rnn.weight_ih_l0.requires_grad_(False)  # layer 0: W_hh's tangent alone
    lstm.rnn.weight_hh_l1.requires_grad_(False)  # layer 1: W_ih's alone, one bias
    lstm.rnn.bias_hh_l1.requires_grad_(False)
    projected = Recurrent(lambda i, h, **kw: nn.LSTM(i, 5, proj_size=h, **kw), 3, 4, 2).to(D)
    xs = torch.randn(3, 5, 3, generator=g).to(D)
    ys = torch.randn(3, 2, generator=g).to(D)
    for model, inputs, targets, rule in [
        (norm_model, x, y, None),
        (lstm, xs, ys, True),
        (projected, xs, ys, False),
    ]:
        model.train(train)
        calls.clear()
        G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, inputs, targets)
        engine = _traced(model, "mse")
        with warnings.catch_warnings():  # declined cleanly, not failed and fallen back
            warnings.filterwarnings("error", message=".*tangent rules")
            lin = engine(engine.fmodel.flat(), Batch(inputs, targets))
        if rule is not None:
            assert bool(calls) == rule
        G = torch.stack([lin.ggn_vp(e) for e in torch.eye(engine.fmodel.numel, dtype=D)], 1)
        torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)


class _Norms(nn.Module):
    """Layer norms: affine, without the affine map, without a bias, over two dimensions, and
    F.layer_norm with a weight only."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.n1 = nn.LayerNorm(4)
        self.n2 = nn.LayerNorm(4, elementwise_affine=False)
        self.n3 = nn.LayerNorm(4, bias=False)
        self.n4 = nn.LayerNorm((2, 4))
        self.w = nn.Parameter(torch.rand(4) + 0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # x: (N, 2, 3)
        h = torch.tanh(self.n1(self.a(x)))
        h = self.n3(torch.sin(self.n2(h) * 1.5))
        h = self.n4(h * h + h)
        h = F.layer_norm(h, (4,), weight=self.w)
        return self.head(h.sum(1))


def test_layer_norm_rule_matches_the_dense_reference(monkeypatch):
    calls = _count_jvp_calls(monkeypatch, LayerNorm)
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(4)
    model = _Norms().to(D)
    with torch.no_grad():  # affine maps other than the initial ones
        for m in (model.n1, model.n3, model.n4):
            m.weight.uniform_(0.5, 1.5, generator=g)
        for m in (model.n1, model.n4):
            m.bias.uniform_(-0.5, 0.5, generator=g)
    x, y = torch.randn(5, 2, 3, generator=g).to(D), torch.randn(5, 2, generator=g).to(D)
    G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, x, y)
    engine = _traced(model, "mse")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*tangent rules")
        lin = engine(engine.fmodel.flat(), Batch(x, y))
    assert len(calls) == 5  # every layer norm was recorded with the rule
    G = torch.stack([lin.ggn_vp(e) for e in torch.eye(engine.fmodel.numel, dtype=D)], 1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)


class _Attend(nn.Module):
    """scaled_dot_product_attention: causal, or with another scale, or with a mask tensor
    (which the rule declines)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(4, 12)
        self.head = nn.Linear(4, 2)
        # A buffer (a mask drawn in forward with a generator of its own cannot be traced by
        # torch 2.11's make_fx).
        mask = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) > 0.3
        self.register_buffer("mask", mask.fill_diagonal_(True))

    def forward(self, x):  # (N, L, 4), two heads of width 2
        n, length, _ = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, 2, 2).permute(2, 0, 3, 1, 4)
        if self.kind == "causal":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kind == "scale":
            a = F.scaled_dot_product_attention(q, k, v, scale=0.7)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:length, :length])
        return self.head(a.transpose(1, 2).reshape(n, length, 4).mean(1))


@pytest.mark.parametrize("kind", ["causal", "scale", "mask"])
def test_attention_rule_matches_the_dense_reference(kind, monkeypatch):
    calls = _count_jvp_calls(monkeypatch, Softmax)
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(5)
    model = _Attend(kind).to(D)
    x, y = torch.randn(3, 4, 4, generator=g).to(D), torch.randn(3, 2, generator=g).to(D)
    G_ref, g_ref, _ = dense_ggn(model, F.mse_loss, x, y)
    engine = _traced(model, "mse")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*tangent rules")
        lin = engine(engine.fmodel.flat(), Batch(x, y))
    assert bool(calls) == (kind != "mask")  # a mask tensor keeps PyTorch's kernel
    G = torch.stack([lin.ggn_vp(e) for e in torch.eye(engine.fmodel.numel, dtype=D)], 1)
    torch.testing.assert_close(lin.grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, G_ref, rtol=1e-9, atol=1e-11)


# --- compile=True ------------------------------------------------------------------------------
def _steps(model, x, y, loss, n=2, **options):
    opt = SGN(model, loss, cg_iters=3, solver="cg", engine="traced", **options)
    return [opt.step(x, y) for _ in range(n)]


@pytest.mark.slow  # Inductor compiles C++ kernels: 5-10 s per model
@pytest.mark.parametrize("name", ["resnet-bn", "attention", "mha-mask"])
def test_compiled_steps_match_uncompiled_steps(name, monkeypatch):
    # torch.compile on the CPU (a C++ compiler): batch norm's running statistics written in
    # place, attention, dropout (the same masks: drawn by PyTorch's operators in the graph's
    # order); float64, so that the compiled kernels differ only by rounding.
    compile_, given = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda g, **kw: given.append(g) or compile_(g, **kw))
    model, x, y, loss = make_model(name)
    reference = copy.deepcopy(model)
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = _steps(model, x, y, loss, compile=True)
    after_compiled = torch.get_rng_state()
    ours = ("compile=True", "torch.compile failed")
    assert not [w for w in record if str(w.message).startswith(ours)]
    assert len(given) == 2  # the set-up and the product ran compiled
    torch.manual_seed(5)
    eager = _steps(reference, x, y, loss)
    assert torch.equal(torch.get_rng_state(), after_compiled)  # as many random numbers
    for a, b in zip(compiled, eager):
        assert a.iterations == b.iterations
        assert a.loss == pytest.approx(b.loss, rel=1e-9)
        assert a.loss_after == pytest.approx(b.loss_after, rel=1e-9)
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def _fake_compile(monkeypatch, fails: bool) -> list:
    """Replaces ``torch.compile`` with a stand-in that returns the graph itself, or a function
    that raises as a failing compiler does; returns the list of graphs it was given."""
    given = []

    def compile_(graph, **options):
        given.append(graph)
        if not fails:
            return graph

        def broken(*args):
            raise RuntimeError("InductorError: C++ compile error")

        return broken

    monkeypatch.setattr(torch, "compile", compile_)
    return given


def test_a_failed_compile_warns_once_and_steps_run_uncompiled(monkeypatch):
    given = _fake_compile(monkeypatch, fails=True)
    model, x, y, loss = make_model("attention")
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="torch.compile failed .* C\\+\\+ compile error") as rec:
        compiled = _steps(model, x, y, loss, n=3, compile=True)
    assert len([w for w in rec if "torch.compile failed" in str(w.message)]) == 1
    assert len(given) == 2  # the set-up and the product, once
    assert compiled == _steps(reference, x, y, loss, n=3)


def test_compile_draws_random_numbers_with_pytorchs_operators(monkeypatch):
    """Where a graph draws random numbers (the set-up's dropout masks), Inductor is asked to
    draw them with PyTorch's own operators (``fallback_random``), as the eager trial-point
    passes do; other graphs are compiled with the defaults."""
    options = []
    monkeypatch.setattr(torch, "compile", lambda g, **kw: options.append(kw.get("options")) or g)
    dropout = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.2), nn.Tanh(), nn.Linear(5, 2))
    plain = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled, without a notice
        _steps(dropout, x, y, "mse", compile=True)
    assert options == [{"fallback_random": True}, None]  # the set-up draws the masks
    options.clear()
    _steps(plain, x, y, "mse", compile=True)
    assert options == [None, None]


def test_compile_needs_the_traced_engine_and_no_cuda_graphs():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    for options in ({"engine": "functional"}, {"engine": "layerwise"}, {"cuda_graphs": True}):
        with pytest.raises(ValueError, match="invalid compile=True"):
            SGN(model, "mse", compile=True, **options)
    with pytest.warns(UserWarning, match="compile=True applies to the traced engine"):
        SGN(model, "mse", compile=True)  # "auto" on a chain: the layer-wise engine takes it


def test_auto_engine_compiles_a_model_that_is_not_a_chain(monkeypatch):
    given = _fake_compile(monkeypatch, fails=False)
    model, x, y, loss = make_model("attention")
    reference = copy.deepcopy(model)
    opt = SGN(model, loss, cg_iters=3, solver="cg", compile=True)  # engine="auto"
    infos = [opt.step(x, y) for _ in range(2)]
    assert len(given) == 2  # the set-up and the product of the one trace
    assert infos == _steps(reference, x, y, loss)
