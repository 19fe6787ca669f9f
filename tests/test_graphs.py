"""CUDA graphs for the layer-wise engine (``SGN(cuda_graphs=True)``).

On the CPU an eager stand-in replaces the capture: a "replay" calls the captured function
again, over the same static buffers. That checks everything but the capture itself (the batch,
parameters and vectors copied in, the outputs copied out, one set of graphs per batch shape,
targets checked before a replay, the cases where graphs do not apply). The CUDA test at the
end checks real capture against eager steps.
"""

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_sgn import SGN
from torch_sgn.engines import cuda_graphs as graphs
from torch_sgn.experiments.models import PRESETS


def _batches(name, sizes, device="cpu", seed=0):
    p = PRESETS[name]
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        x = torch.randn((n, *p.input_shape), generator=g)
        if p.loss == "mse":
            y = torch.randn((n, 1), generator=g)
        else:
            y = torch.randint(0, 10, (n,), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def _run(model, loss, batches, **options):
    opt = SGN(model, loss, cg_iters=3, **options, solver="cg")
    return [opt.step(x, y) for x, y in batches], opt


@pytest.mark.parametrize(
    "name",
    # CIFAR-10's network takes several seconds (fashion_mnist's covers the same layers)
    ["boston", "sine", "mnist", "fashion_mnist", pytest.param("cifar10", marks=pytest.mark.slow)],
)
def test_replayed_steps_equal_eager_steps(name, cpu_graph_captures):
    p = PRESETS[name]
    batches = _batches(name, [6, 6, 4, 6, 4])  # two shapes: full batches and a last one
    eager_model, graph_model = p.build(), p.build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # graphs apply to every paper network
        graph_infos, _ = _run(graph_model, p.loss, batches, cuda_graphs=True)
    eager_infos, _ = _run(eager_model, p.loss, batches)
    assert cpu_graph_captures == [3, 3]  # set-up, product, trial loss; once per batch shape
    assert graph_infos == eager_infos
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)


def test_bad_targets_on_a_captured_shape_raise_and_change_nothing(cpu_graph_captures):
    model = PRESETS["mnist"].build()
    (x, y), (x2, y2) = _batches("mnist", [5, 5])
    opt = SGN(model, "cross_entropy", cuda_graphs=True, solver="cg")
    opt.step(x, y)
    before = [t.clone() for t in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    y2[0] = 10  # the model has 10 outputs
    with pytest.raises(ValueError, match="out of range"):
        opt.step(x2, y2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state_dict()["state"] == state["state"]
    y2[0] = 3
    opt.step(x2, y2)
    assert len(cpu_graph_captures) == 1


def _dropout_mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 1))


@pytest.mark.parametrize(
    "build,loss,why",
    [
        (lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), "mse", "CUDA"),
        (_dropout_mlp, "mse", "training-mode dropout"),
        (
            lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
            lambda out, y: (out - y).pow(4).mean(),
            "closed-form Hessian",
        ),
        (
            lambda: nn.Sequential(
                nn.Unflatten(1, (1, 4)),
                nn.Conv1d(1, 2, 2),
                nn.AvgPool1d(3),
                nn.Flatten(),
                nn.Linear(2, 1),
            ),  # fmt: skip
            "mse",
            "not evaluated by hand",
        ),
    ],
    ids=["cpu", "dropout", "callable-loss", "avg-pool"],
)
def test_where_graphs_do_not_apply_steps_run_eagerly_after_one_warning(build, loss, why, request):
    if why != "CUDA":
        request.getfixturevalue("cpu_graph_captures")
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(3)]
    torch.manual_seed(2)
    opt = SGN(model, loss, cg_iters=3, cuda_graphs=True, solver="cg")
    with pytest.warns(UserWarning, match=f"cuda_graphs=True does not apply.*{why}"):
        opt.step(*batches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        for x, y in batches[1:]:
            opt.step(x, y)
    torch.manual_seed(2)
    _run(reference, loss, batches)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_switching_dropout_to_training_mode_leaves_the_graphs(cpu_graph_captures):
    model = _dropout_mlp().eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)
    opt = SGN(model, "mse", cuda_graphs=True, solver="cg")
    opt.step(x, y)
    assert cpu_graph_captures == [3]
    model.train()
    with pytest.warns(UserWarning, match="training-mode dropout"):
        opt.step(x, y)
    assert cpu_graph_captures == [3]
    model.eval()
    opt.step(x, y)  # eval mode again: the captured graphs serve it
    assert cpu_graph_captures == [3]


def test_cuda_graphs_need_the_fast_or_the_traced_engine():
    with pytest.raises(ValueError, match="cuda_graphs"):
        SGN(PRESETS["boston"].build(), "mse", engine="functional", cuda_graphs=True, solver="cg")
    SGN(PRESETS["boston"].build(), "mse", engine="traced", cuda_graphs=True, solver="cg")


def test_ignored_targets_that_move_between_steps_of_one_shape(cpu_graph_captures):
    # The mask and count of ignored samples are computed on the device in the captured set-up:
    # a replay with another pattern must use it.
    p = PRESETS["mnist"]
    batches = _batches("mnist", [6, 6, 6])
    for i, (_, y) in enumerate(batches):
        y[i] = -100
        y[(i + 2) % 6] = -100
    graph_model, eager_model = p.build(), p.build()
    graph_infos, _ = _run(graph_model, "cross_entropy", batches, cuda_graphs=True)
    eager_infos, _ = _run(eager_model, "cross_entropy", batches)
    assert cpu_graph_captures == [3] and graph_infos == eager_infos


@pytest.fixture
def failing_captures(monkeypatch):
    """Makes every capture on the CPU fail as an operation that cannot be captured does;
    returns the list of tries."""
    calls = []

    def failing(fns, device):
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setitem(graphs.CAPTURE, "cpu", failing)
    return calls


def test_a_failed_capture_warns_once_and_steps_run_eagerly(failing_captures):
    calls = failing_captures
    p = PRESETS["boston"]
    batches = _batches("boston", [5, 5, 3])
    graph_model, eager_model = p.build(), p.build()
    with pytest.warns(UserWarning, match="capturing the step as CUDA graphs failed"):
        graph_infos, _ = _run(graph_model, "mse", batches, cuda_graphs=True)
    eager_infos, _ = _run(eager_model, "mse", batches)
    assert calls == [1]  # not tried again, not even for the new shape
    assert graph_infos == eager_infos


def test_too_many_shapes_warn_once_and_still_step_right(cpu_graph_captures):
    p = PRESETS["boston"]
    batches = _batches("boston", [2, 3, 4, 5, 6, 2, 3])
    graph_model, eager_model = p.build(), p.build()
    with pytest.warns(UserWarning, match="more than 4 batch shapes") as record:
        graph_infos, _ = _run(graph_model, "mse", batches, cuda_graphs=True)
    eager_infos, _ = _run(eager_model, "mse", batches)
    assert len([w for w in record if "batch shapes" in str(w.message)]) == 1
    assert len(cpu_graph_captures) == 7  # shapes 2 and 3 were evicted and captured again
    assert graph_infos == eager_infos


def test_changed_loss_or_layer_settings_are_captured_again(cpu_graph_captures):
    from torch_sgn.losses import resolve_loss

    loss = resolve_loss("mse")
    model = nn.Sequential(nn.Linear(4, 6), nn.LeakyReLU(0.1), nn.Linear(6, 1))
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)
    opt, ref = SGN(model, loss, cuda_graphs=True, solver="cg"), SGN(reference, "mse", solver="cg")
    opt.step(x, y), ref.step(x, y)
    loss.reduction = "sum"
    model[1].negative_slope = reference[1].negative_slope = 0.3
    ref._loss.reduction = "sum"
    assert opt.step(x, y) == ref.step(x, y)
    assert cpu_graph_captures == [3, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["boston", "sine", "mnist", "fashion_mnist", "cifar10"])
def test_captured_cuda_steps_match_eager_cuda_steps(name):
    # float64: no TF32 convolutions, so captured and eager steps differ only by the order of
    # sums inside the library kernels they pick.
    p = PRESETS[name]
    kw = dict(device="cuda", dtype=torch.float64)
    batches = [(x.to(**kw), y.to(**kw) if y.is_floating_point() else y.cuda()) for x, y in
               _batches(name, [64, 64, 40, 64, 40, 64])]  # fmt: skip
    eager_model, graph_model = p.build().to(**kw), p.build().to(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph_infos, opt = _run(graph_model, p.loss, batches, cuda_graphs=True)
    eager_infos, _ = _run(eager_model, p.loss, batches)
    assert len(opt._engine.engines[0]._graphs._by_key) == 2  # the layer-wise engine's
    for a, b in zip(graph_infos, eager_infos):
        assert a.iterations == b.iterations
        assert a.loss == pytest.approx(b.loss, rel=1e-10)
        assert a.loss_after == pytest.approx(b.loss_after, rel=1e-10)
        assert a.damping == b.damping
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_cuda_steps_with_ignored_targets_subsets_and_frozen_layers():
    kw = dict(device="cuda", dtype=torch.float64)
    p = PRESETS["fashion_mnist"]
    batches = []
    for i, (x, y) in enumerate(_batches("fashion_mnist", [32, 32, 32, 20])):
        y[i::7] = -100  # a pattern that moves from step to step
        batches.append((x.to(**kw), y.cuda()))
    eager_model, graph_model = p.build().to(**kw), p.build().to(**kw)
    for m in (eager_model, graph_model):
        m[0].weight.requires_grad_(False)  # a frozen first convolution
    options = dict(curvature_fraction=0.5)
    graph_infos, _ = _run(graph_model, p.loss, batches, cuda_graphs=True, **options)
    eager_infos, _ = _run(eager_model, p.loss, batches, **options)
    for a, b in zip(graph_infos, eager_infos):
        assert a.iterations == b.iterations
        assert a.loss_after == pytest.approx(b.loss_after, rel=1e-10)
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# --- the traced engine's graphs ------------------------------------------------------------------
def _any_model(name):
    """``(model, inputs, classes)``: a small model of a family the traced engine takes (a
    ResNet with batch norm, a causal transformer, an LSTM model), ``inputs(n, generator)``
    drawing a batch of its inputs, and its number of classes."""
    from torch_sgn.experiments.models import CausalTransformer, LSTMModel, ResNetBN

    torch.manual_seed(0)
    if name == "resnet_bn":
        images = lambda n, g: torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)  # noqa: E731
        return ResNetBN(width=4, stages=2), images, 10
    if name == "transformer":
        model = CausalTransformer(vocab=7, width=8, layers=1, heads=2, length=5)
    else:
        model = LSTMModel(vocab=7, width=6)
    return model, lambda n, g: torch.randint(0, 7, (n, 5), generator=g), 7


def _any_batches(name, sizes, seed=1):
    _, inputs, classes = _any_model(name)
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        x = inputs(n, g)
        shape = (n,) if name == "resnet_bn" else (n, 5)
        out.append((x, torch.randint(0, classes, shape, generator=g)))
    return out


#: (engine, model): the default run keeps one model per engine, the LSTM's integer inputs and
#: the ResNet's batch-norm statistics read in evaluation mode (a training-mode pass writing
#: them: test_traced_graphs_keep_the_buffers_a_training_mode_pass_updates; attention with
#: graphs: test_traced_graphs_draw_dropouts_masks_as_eager_steps_do); the rest, a few seconds
#: each, run with the slow tests
FAST_REPLAYS = {("traced", "lstm"), ("auto", "resnet_bn_eval")}
TRACED_REPLAYS = [
    pytest.param(engine, name, marks=() if (engine, name) in FAST_REPLAYS else pytest.mark.slow)
    for engine in ["traced", "auto"]
    for name in ["resnet_bn", "resnet_bn_eval", "transformer", "lstm"]
]


@pytest.mark.parametrize("engine, name", TRACED_REPLAYS)
def test_traced_replayed_steps_equal_eager_steps(name, engine, cpu_graph_captures):
    eval_mode = name.endswith("_eval")  # (in training mode its batch norm writes buffers)
    name = name.removesuffix("_eval")
    batches = _any_batches(name, [6, 6, 4, 6, 4])  # two shapes
    graph_model, eager_model = _any_model(name)[0].double(), _any_model(name)[0].double()
    graph_model.train(not eval_mode)
    eager_model.train(not eval_mode)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graph_infos, _ = _run(graph_model, "cross_entropy", batches, cuda_graphs=True,
                              engine=engine)  # fmt: skip
    assert [str(w.message) for w in record if "cuda_graphs" in str(w.message)
            or "CUDA graphs" in str(w.message) or "engine" in str(w.message)] == []  # fmt: skip
    eager_infos, _ = _run(eager_model, "cross_entropy", batches, engine=engine)
    assert cpu_graph_captures == [3, 3]  # set-up, product, trial loss; once per batch shape
    # The same operations on the same numbers; equal to the last bit with two threads, to
    # rounding with one (the static copies' memory alignment can change a kernel's rounding).
    for a, b in zip(graph_infos, eager_infos):
        a, b = dataclasses.asdict(a), dataclasses.asdict(b)
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-15), key
            else:
                assert a[key] == b[key], key
    for a, b in zip(graph_model.state_dict().values(), eager_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)  # parameters and statistics


class _Counted(nn.Module):
    """A linear layer that counts its calls in a buffer, in place, in either mode."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls.add_(1)
        return self.linear(x)


class _BatchStatistics(nn.BatchNorm1d):
    """Batch normalization that normalizes by the batch's statistics (and updates the running
    ones) in evaluation mode too."""

    def forward(self, x):
        return nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps
        )


def test_traced_graphs_keep_the_buffers_a_training_mode_pass_updates(cpu_graph_captures):
    # batch norm's running statistics (written by native_batch_norm, whose schema does not say
    # so) and a counter written by add_, updated once per step as in eager steps
    def build():
        torch.manual_seed(0)
        return nn.Sequential(_Counted(), nn.BatchNorm1d(3), nn.Tanh(), nn.Linear(3, 2))

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
               for n in (6, 6, 4, 6)]  # fmt: skip
    graph_model, eager_model = build().double(), build().double()
    graph_infos, _ = _run(graph_model, "cross_entropy", [(x.double(), y) for x, y in batches],
                          cuda_graphs=True, engine="traced")  # fmt: skip
    eager_infos, _ = _run(eager_model, "cross_entropy", [(x.double(), y) for x, y in batches],
                          engine="traced")  # fmt: skip
    assert cpu_graph_captures == [3, 3]
    assert graph_infos == eager_infos
    for a, b in zip(graph_model.state_dict().values(), eager_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert graph_model[0].calls == graph_model[1].num_batches_tracked == len(batches)
    assert not torch.equal(graph_model[1].running_mean, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("layer, width", [(_Counted, 3), (lambda: _BatchStatistics(4), 4)])
def test_traced_graphs_do_not_apply_where_an_evaluation_mode_pass_writes_buffers(
    layer, width, cpu_graph_captures
):
    # eager passes write into the model's own buffers then (set-up and trial points alike)
    def build():
        torch.manual_seed(0)
        return nn.Sequential(layer(), nn.Tanh(), nn.Linear(width, 1)).eval()

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)) for _ in range(3)]
    graph_model, eager_model = build(), build()
    with pytest.warns(UserWarning, match="cuda_graphs=True does not apply.*in evaluation mode"):
        graph_infos, _ = _run(graph_model, "mse", batches, cuda_graphs=True, engine="traced")
    eager_infos, _ = _run(eager_model, "mse", batches, engine="traced")
    assert cpu_graph_captures == [] and graph_infos == eager_infos
    for a, b in zip(graph_model.state_dict().values(), eager_model.state_dict().values()):
        assert torch.equal(a, b)


class _Encoder(nn.Module):
    """A transformer encoder layer with dropout (in its attention too) and a read-out."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.layer(x)).sum(1)


class _Transposed(nn.Module):
    """Batch norm over a transposed sequence, then dropout: the real kernel returns another
    layout than the trace's fake tensor (a contiguous one), and a view of it must reshape."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.out = nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(18, 1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):  # (n, 3, 8)
        h = self.norm(self.lin(x).transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(self.drop(h)).flatten(1))


@pytest.mark.parametrize(
    "name", ["mlp", pytest.param("encoder", marks=pytest.mark.slow), "transposed"]
)
def test_traced_graphs_draw_dropouts_masks_as_eager_steps_do(name, cpu_graph_captures):
    # the masks are drawn eagerly before each set-up, from the step's random state, and the
    # set-up and trial-point graphs read them: the same steps, and the same random state after
    def build():
        torch.manual_seed(0)
        if name == "mlp":
            return nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 1))
        return _Encoder() if name == "encoder" else _Transposed()

    g = torch.Generator().manual_seed(1)
    shape = (4,) if name == "mlp" else (3, 8)
    batches = [(torch.randn(n, *shape, generator=g), torch.randn(n, 1, generator=g))
               for n in (6, 6, 4, 6)]  # fmt: skip
    model, reference = build().double(), build().double()
    batches = [(x.double(), y.double()) for x, y in batches]
    torch.manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # graphs apply: no warning
        infos, _ = _run(model, "mse", batches, cuda_graphs=True, engine="traced")
    state = torch.get_rng_state()
    torch.manual_seed(2)
    expected, _ = _run(reference, "mse", batches, engine="traced")
    assert cpu_graph_captures == [3, 3]
    assert torch.equal(state, torch.get_rng_state())
    for a, b in zip(infos, expected):
        a, b = dataclasses.asdict(a), dataclasses.asdict(b)
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-15), key
            else:
                assert a[key] == b[key], key
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_traced_graphs_do_not_apply_to_dropout_kept_on_in_evaluation_mode(cpu_graph_captures):
    # eager steps freeze no random state in evaluation mode: each pass draws new masks
    class AlwaysDropped(nn.Sequential):
        def forward(self, x):
            return self[1](F.dropout(torch.tanh(self[0](x)), 0.3, training=True))

    torch.manual_seed(0)
    model = AlwaysDropped(nn.Linear(4, 6), nn.Linear(6, 1)).eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(2)]
    with pytest.warns(UserWarning, match="cuda_graphs=True does not apply.*evaluation mode"):
        _run(model, "mse", batches, cuda_graphs=True, engine="traced")
    assert cpu_graph_captures == []


def test_draws_that_are_not_dropouts_stay_in_the_graph_and_are_refused():
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_sgn.engines.traced.replay import draws_as_inputs
    from torch_sgn.engines.traced.trace import Untraceable

    x = torch.randn(4, 3)
    evaluation = make_fx(lambda t: torch.ops.aten.native_dropout(t, 0.3, False)[0] * 2)(x)
    rewritten, draws = draws_as_inputs(evaluation)  # no draw: nothing taken out
    assert draws == [] and torch.equal(rewritten(x), evaluation(x))
    # one that does not draw beside one that does: one layout, the real one, for the latter
    from torch_sgn.engines.traced.replay import drawn_layouts
    from torch_sgn.model.flat_model import FunctionalModel

    def both(t):
        kept = torch.ops.aten.native_dropout(t, 0.3, False)[0]
        return torch.ops.aten.native_dropout(kept.t(), 0.3, True)[0]

    graph = make_fx(both)(x)
    layouts = drawn_layouts(graph, [x], FunctionalModel(nn.Linear(1, 1)))
    assert layouts == [((3, 4), (1, 3))]
    assert [d.stride for d in draws_as_inputs(graph, layouts)[1]] == [(1, 3)]
    refused = [
        lambda t: t.clone().bernoulli_(0.5) * t,  # a sample into a tensor with values
        lambda t: torch.randn_like(t) + t,  # another random operator
    ]
    for f in refused:
        with pytest.raises(Untraceable, match="stays in the graph"):
            draws_as_inputs(make_fx(f)(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mlp", "encoder"])
def test_captured_cuda_dropout_steps_match_eager_cuda_steps(name):
    # CUDA's dropout records native_dropout, whose masks are drawn before each replay
    def build():
        torch.manual_seed(0)
        if name == "mlp":
            model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.3), nn.Tanh(), nn.Linear(6, 1))
        else:
            model = _Encoder()
        return model.to(device="cuda", dtype=torch.float64)

    g = torch.Generator().manual_seed(1)
    shape = (4,) if name == "mlp" else (3, 8)
    kw = dict(device="cuda", dtype=torch.float64)
    batches = [(torch.randn(n, *shape, generator=g), torch.randn(n, 1, generator=g))
               for n in (16, 16, 8, 16, 8, 16)]  # fmt: skip
    batches = [(x.to(**kw), y.to(**kw)) for x, y in batches]
    model, reference = build(), build()
    torch.manual_seed(2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        infos, opt = _run(model, "mse", batches, cuda_graphs=True, engine="traced")
    assert [str(w.message) for w in record if "cuda_graphs" in str(w.message)
            or "CUDA graphs" in str(w.message)] == []  # fmt: skip
    state = torch.cuda.get_rng_state()
    torch.manual_seed(2)
    expected, _ = _run(reference, "mse", batches, engine="traced")
    assert torch.equal(state, torch.cuda.get_rng_state())
    traced = opt._engine.engines[0]
    assert len(traced._replays) == 2
    for a, b in zip(infos, expected):
        assert a.iterations == b.iterations
        assert a.loss == pytest.approx(b.loss, rel=1e-10)
        assert a.loss_after == pytest.approx(b.loss_after, rel=1e-10)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_traced_graphs_draw_from_the_random_state_the_step_replays(cpu_graph_captures):
    from torch_sgn.engines.selection import select_engine
    from torch_sgn.linearization import Batch
    from torch_sgn.losses import resolve_loss
    from torch_sgn.model.flat_model import FunctionalModel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 1))
    g = torch.Generator().manual_seed(1)
    batch = Batch(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=g)
    results = []
    for graphs_on in (True, False):
        fmodel = FunctionalModel(model)
        engine = select_engine(fmodel, resolve_loss("mse"), "traced", cuda_graphs=graphs_on)
        torch.manual_seed(5)
        fmodel.freeze_rng()
        torch.rand(100)  # drawn after the state was frozen: the step's passes replay it
        lin = engine(fmodel.flat(), batch)
        results.append((lin.loss, lin.ggn_vp(v)))
    assert cpu_graph_captures == [3]
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=0)


def test_traced_replays_are_kept_per_trace_and_dropped_with_it(cpu_graph_captures, monkeypatch):
    """The traced engine keeps one set of captured graphs per cached trace (a batch shape),
    replays it for that shape, and frees it when the trace leaves its cache."""
    from torch_sgn.engines.selection import select_engine
    from torch_sgn.engines.traced import engine as traced_engine
    from torch_sgn.linearization import Batch
    from torch_sgn.losses import resolve_loss
    from torch_sgn.model.flat_model import FunctionalModel

    monkeypatch.setattr(traced_engine, "CACHE_SIZE", 1)
    torch.manual_seed(0)
    fmodel = FunctionalModel(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)))
    engine = select_engine(fmodel, resolve_loss("mse"), "traced", cuda_graphs=True)
    engine = getattr(engine, "engines", [engine])[0]
    for rows in (8, 8):
        engine(fmodel.flat(), Batch(torch.randn(rows, 4), torch.randn(rows, 1)))
    assert cpu_graph_captures == [3] and len(engine._replays) == 1  # captured once, replayed
    engine(fmodel.flat(), Batch(torch.randn(5, 4), torch.randn(5, 1)))  # evicts the first
    assert cpu_graph_captures == [3, 3]
    assert list(engine._replays) == list(engine._cache.values())


def test_traced_graphs_do_not_apply_to_other_random_draws(cpu_graph_captures):
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x):
            return self.linear(x + 0.1 * torch.randn_like(x))

    torch.manual_seed(0)
    model, reference = Noisy(), Noisy()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(3)]
    torch.manual_seed(2)
    with pytest.warns(UserWarning, match="cuda_graphs=True does not apply.*randn_like"):
        _run(model, "mse", batches, cuda_graphs=True, engine="traced")
    torch.manual_seed(2)
    _run(reference, "mse", batches, engine="traced")
    assert cpu_graph_captures == []
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["native_dropout", "bernoulli_"])
def test_draws_taken_out_of_a_graph_are_those_it_would_draw(op):
    # CUDA's dropout records native_dropout, the CPU's bernoulli_ into a new tensor
    from torch.fx.experimental.proxy_tensor import make_fx

    from torch_sgn.engines.traced.replay import draws_as_inputs

    def f(x):
        y = torch.tanh(x)
        if op == "native_dropout":
            out, mask = torch.ops.aten.native_dropout(y, 0.3, True)
            return out * 2, mask
        keep = torch.empty_like(y).bernoulli_(0.7)
        return y * keep / 0.7, keep

    x = torch.randn(5, 7, dtype=torch.float64)
    graph = make_fx(f)(x)
    rewritten, draws = draws_as_inputs(graph)
    assert len(draws) == 1 and draws[0].shape == (5, 7) and draws[0].op == op
    drawing = (torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli_.float)
    assert not any(n.target in drawing for n in rewritten.graph.nodes)
    torch.manual_seed(3)
    expected = f(x)
    torch.manual_seed(3)
    drawn = draws[0](x.device)
    got = rewritten(x, drawn)
    assert torch.equal(got[1].bool(), expected[1].bool())
    torch.testing.assert_close(got[0], expected[0], rtol=1e-15, atol=0)


def test_traced_products_of_a_replaced_point_raise(cpu_graph_captures):
    from torch_sgn.engines.selection import select_engine
    from torch_sgn.linearization import Batch
    from torch_sgn.losses import resolve_loss
    from torch_sgn.model.flat_model import FunctionalModel

    model = _any_model("lstm")[0]
    (x, y), (x2, y2) = _any_batches("lstm", [4, 4])
    fmodel = FunctionalModel(model)
    engine = select_engine(fmodel, resolve_loss("cross_entropy"), "traced", cuda_graphs=True)
    flat = fmodel.flat()
    v = torch.randn(flat.shape, generator=torch.Generator().manual_seed(3))
    first = engine(flat, Batch(x, y))
    expected = first.ggn_vp(v)
    eager = select_engine(fmodel, resolve_loss("cross_entropy"), "traced")(flat, Batch(x, y))
    torch.testing.assert_close(expected, eager.ggn_vp(v), rtol=0, atol=0)
    away = flat + 0.1 * v
    eager_value = resolve_loss("cross_entropy").value(fmodel(away, x), y)
    torch.testing.assert_close(first.value_at(away), eager_value, rtol=1e-6, atol=0)
    second = engine(flat, Batch(x2, y2))  # same shape: the captured graphs move on
    with pytest.raises(RuntimeError, match="later step on the same batch shape"):
        first.ggn_vp(v)
    with pytest.raises(RuntimeError, match="later step on the same batch shape"):
        first.value_at(flat)
    eager = select_engine(fmodel, resolve_loss("cross_entropy"), "traced")(flat, Batch(x2, y2))
    torch.testing.assert_close(second.ggn_vp(v), eager.ggn_vp(v), rtol=0, atol=0)
    assert cpu_graph_captures == [3]


def test_a_failed_traced_capture_warns_once_and_steps_run_eagerly(failing_captures):
    calls = failing_captures

    def build():  # the traced engine's graphs apply to any model it traces: a small one
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
               for n in (5, 5, 3)]  # fmt: skip
    graph_model, eager_model = build(), build()
    with pytest.warns(UserWarning, match="capturing the traced engine's work .* failed") as record:
        graph_infos, _ = _run(graph_model, "cross_entropy", batches, cuda_graphs=True,
                              engine="traced")  # fmt: skip
    eager_infos, _ = _run(eager_model, "cross_entropy", batches, engine="traced")
    assert len([w for w in record if "CUDA graphs" in str(w.message)]) == 1
    assert calls == [1]  # not tried again, not even for the new shape
    assert graph_infos == eager_infos


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["resnet_bn", "resnet_bn_eval", "transformer", "lstm"])
def test_captured_traced_cuda_steps_match_eager_cuda_steps(name):
    kw = dict(device="cuda", dtype=torch.float64)
    eval_mode = name.endswith("_eval")
    name = name.removesuffix("_eval")
    batches = [(x.to(**kw) if x.is_floating_point() else x.cuda(), y.cuda())
               for x, y in _any_batches(name, [16, 16, 8, 16, 8, 16])]  # fmt: skip
    graph_model, eager_model = _any_model(name)[0].to(**kw), _any_model(name)[0].to(**kw)
    graph_model.train(not eval_mode)
    eager_model.train(not eval_mode)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graph_infos, opt = _run(graph_model, "cross_entropy", batches, cuda_graphs=True,
                                engine="traced")  # fmt: skip
    assert [str(w.message) for w in record if "CUDA graphs" in str(w.message)
            or "cuda_graphs" in str(w.message)] == []  # fmt: skip
    eager_infos, _ = _run(eager_model, "cross_entropy", batches, engine="traced")
    assert len(opt._engine.engines[0]._replays) == 2  # one per batch shape
    for a, b in zip(graph_infos, eager_infos):
        assert a.iterations == b.iterations
        assert a.loss == pytest.approx(b.loss, rel=1e-10)
        assert a.loss_after == pytest.approx(b.loss_after, rel=1e-10)
        assert a.damping == b.damping
    for a, b in zip(graph_model.state_dict().values(), eager_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
