"""Embedding lookups whose own kernels break a Gauss-Newton product (``padding_idx``,
``max_norm``, ``sparse``, ``scale_grad_by_freq``, ``nn.EmbeddingBag``): their composites
against the modules themselves, and the products against a dense ``J^T H J`` built by reverse
mode alone through the model's own parameters and forward pass (``cases.dense_ggn``), in
float64; lookups outside ``nn.Embedding``'s own forward (a subclass, ``F.embedding`` in
``forward``)."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cases import dense_ggn
from torch_sgn import GGN, SGN
from torch_sgn.engines.functional import FunctionalEngine
from torch_sgn.engines.selection import select_engine
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.composites import Composites
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.model.forward_mode import missing_rule

D = torch.float64
TOKENS = torch.tensor([0, 2, 5, 1, 1, 3, 2, 2, 4, 0, 1])
OFFSETS = torch.tensor([0, 3, 3, 6, 8])  # bag 1 is empty


CASES = [
    "padding", "max-norm", "bags", "sparse", "subclass", "in-forward", "bags-in-forward",
    "operator",
]  # fmt: skip


def _bag_input(layout):
    if layout == "2d":  # a bag per row
        return TOKENS[:9].view(3, 3), None
    if layout == "1d":
        return TOKENS, OFFSETS
    return TOKENS, torch.cat([OFFSETS, torch.tensor([len(TOKENS)])])  # include_last_offset


BAG_CASES = [
    (mode, padding, max_norm, layout, weighted, freq)
    for mode, padding, max_norm, layout, weighted, freq in itertools.product(
        ["sum", "mean", "max"],
        [None, 2],
        [None, 1.0],
        ["2d", "1d", "1d-last"],
        [False, True],
        [False, True],
    )
    # weights with sums alone; frequencies not with maxima (PyTorch refuses both)
    if (mode == "sum" or not weighted)
    and (layout == "1d" or not freq)
    and (mode, freq) != ("max", True)
]


@pytest.mark.parametrize("mode,padding,max_norm,layout,weighted,freq", BAG_CASES)
def test_bag_composite_matches_the_module(mode, padding, max_norm, layout, weighted, freq):
    torch.manual_seed(0)
    options = dict(mode=mode, padding_idx=padding, max_norm=max_norm, scale_grad_by_freq=freq)
    options["include_last_offset"] = layout == "1d-last"
    own = nn.EmbeddingBag(6, 3, **options).to(D)
    with torch.no_grad():
        own.weight.normal_().mul_(2.0)  # rows beyond max_norm; the padding row not zero
    composite = copy.deepcopy(own)
    x, offsets = _bag_input(layout)
    w = torch.rand(x.shape, dtype=D) if weighted else None
    with Composites():
        out = composite(x, offsets, w)
    expected = own(x, offsets, w)  # renormalises own's rows in place
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-14)
    u = torch.randn(out.shape, dtype=D)
    (grad,) = torch.autograd.grad(out, composite.weight, u)
    # PyTorch's CPU kernel divides some rows by another row's count (pytorch/pytorch#190063):
    # with scale_grad_by_freq, the documented gradient is the plain one over each row's count
    own.scale_grad_by_freq = False
    (grad_own,) = torch.autograd.grad(own(x, offsets, w), own.weight, u)
    if freq:
        grad_own = grad_own / torch.bincount(x.reshape(-1), minlength=6).clamp(min=1)[:, None]
    torch.testing.assert_close(grad, grad_own, rtol=0, atol=1e-14)
    if max_norm is not None:  # the composite renormalised out of place
        assert composite.weight.norm(dim=1).max() > 2 * own.weight.norm(dim=1).max()


@pytest.mark.parametrize("rows", [5, 9], ids=["table-smaller", "table-larger"])
@pytest.mark.parametrize("options", [
    dict(padding_idx=0), dict(max_norm=1.0), dict(sparse=True), dict(scale_grad_by_freq=True),
    dict(padding_idx=0, max_norm=1.0, scale_grad_by_freq=True),
])  # fmt: skip
def test_embedding_composite_matches_the_module(options, rows):
    """The values and the gradient (reverse mode) of the module's own kernels (8 tokens)."""
    torch.manual_seed(0)
    own = nn.Embedding(rows, 3, **options).to(D)
    with torch.no_grad():
        own.weight.normal_().mul_(2.0)
    composite = copy.deepcopy(own)
    x = torch.tensor([[0, 1, 2, 1], [0, 0, 4, 1]])
    with Composites():
        out = composite(x)
    torch.testing.assert_close(out, own(x), rtol=0, atol=1e-14)
    u = torch.randn(out.shape, dtype=D)
    (grad,) = torch.autograd.grad(out, composite.weight, u)
    (grad_own,) = torch.autograd.grad(own(x), own.weight, u)
    grad_own = grad_own.to_dense() if grad_own.is_sparse else grad_own
    torch.testing.assert_close(grad, grad_own, rtol=0, atol=1e-14)


@pytest.mark.parametrize("options", [
    dict(padding_idx=-1), dict(max_norm=1.0, norm_type=1.0), dict(scale_grad_by_freq=True),
    dict(sparse=True), dict(padding_idx=2, max_norm=1.5, scale_grad_by_freq=True),
])  # fmt: skip
def test_embedding_called_in_forward_matches_pytorchs(options):
    """``F.embedding`` called directly: the composite's values and gradient are PyTorch's
    (whose ``max_norm`` renormalises the table in place, the composite's out of place)."""
    torch.manual_seed(0)
    table = (2.0 * torch.randn(5, 3, dtype=D)).requires_grad_(True)
    own = table.detach().clone().requires_grad_(True)
    x = torch.tensor([[0, 4, 2, 4], [2, 2, 1, 3]])
    with Composites():
        out = F.embedding(x, table, **options)
    torch.testing.assert_close(out, F.embedding(x, own, **options), rtol=0, atol=1e-14)
    u = torch.randn(out.shape, dtype=D)
    (grad,) = torch.autograd.grad(out, table, u)
    (grad_own,) = torch.autograd.grad(F.embedding(x, own, **options), own, u)
    grad_own = grad_own.to_dense() if grad_own.is_sparse else grad_own
    torch.testing.assert_close(grad, grad_own, rtol=0, atol=1e-14)
    if "max_norm" in options:
        assert table.norm(dim=1).max() > 2.0 * own.norm(dim=1).max()  # not written
    # forward mode: one J in both modes (no tangent where the gradient has no derivative)
    weight, v = table.detach(), torch.randn(5, 3, dtype=D)
    with Composites():
        _, jv = torch.func.jvp(lambda w: F.embedding(x, w, **options), (weight,), (v,))
    torch.testing.assert_close((jv * u).sum(), (v * grad).sum(), rtol=1e-13, atol=0)


def test_bag_calls_match_pytorchs_at_the_edges():
    """``F.embedding_bag`` called directly: padding counted from the end, the deprecated
    argument order; a padding row outside the table is refused as PyTorch refuses it."""
    torch.manual_seed(0)
    table = torch.randn(6, 3, dtype=D, requires_grad=True)
    offsets = torch.tensor([0, 3, 3, 6, 11])
    calls = [
        dict(offsets=offsets, include_last_offset=True, mode="sum"),
        dict(offsets=offsets, include_last_offset=True, mode="max", padding_idx=-1),
        dict(offsets=offsets[:-1], mode="mean", padding_idx=2),
        # a last offset short of the input's length: PyTorch's kernels do not read it, and the
        # last bag runs to the end
        dict(offsets=torch.tensor([0, 3, 3, 6, 8]), include_last_offset=True, mode="mean"),
        dict(offsets=torch.tensor([0, 3, 3, 6, 8]), include_last_offset=True, mode="max"),
    ]
    for options in calls:
        with Composites() as mode:
            out = F.embedding_bag(TOKENS, table, **options)
        assert mode.routed
        expected = F.embedding_bag(TOKENS, table, **options)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-14)
        u = torch.randn(out.shape, dtype=D)
        grads = [torch.autograd.grad(o, table, u)[0] for o in (out, expected)]
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-14)
    with warnings.catch_warnings(), Composites():
        warnings.simplefilter("ignore")  # PyTorch's own deprecation warning, where it runs
        swapped = F.embedding_bag(table, TOKENS, OFFSETS)  # the deprecated order
    torch.testing.assert_close(swapped, F.embedding_bag(TOKENS, table, OFFSETS))
    for padding in (6, -7):
        with pytest.raises(ValueError, match="outside the table's 6 rows"), Composites():
            F.embedding_bag(TOKENS, table, OFFSETS, padding_idx=padding)
        with pytest.raises(ValueError, match="outside the table's 6 rows"), Composites():
            F.embedding(TOKENS, table, padding_idx=padding)


def test_models_without_lookups_or_weight_norms_run_without_the_function_mode():
    """The function mode costs every operator a Python call and keeps attention modules off
    their fast paths: only models that need it run within it."""
    plain = FunctionalModel(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    model = LookupInForward()  # no embedding module: found by the checked pass
    found = FunctionalModel(model)
    for fmodel, x in ((plain, torch.randn(5, 3)), (found, torch.randint(0, 5, (6, 3)))):
        assert not fmodel.gradient_stop(fmodel.flat(), (x,))
    assert not plain._composites and found._composites
    modes = torch.overrides._get_current_function_mode_stack
    with plain.composites():
        assert not any(isinstance(m, Composites) for m in modes())
    with found.composites():
        assert any(isinstance(m, Composites) for m in modes())
    assert FunctionalModel(PaddedTokens())._composites  # by its modules, before any pass
    lookup = FunctionalModel(nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(9, 2)))
    assert not lookup._composites  # a plain lookup: nothing to route
    assert not lookup.gradient_stop(lookup.flat(), (torch.randint(0, 5, (4, 3)),))
    assert not lookup._composites


@pytest.mark.parametrize("rows", [5, 9], ids=["table-smaller", "table-larger"])
@pytest.mark.parametrize("max_norm,freq", [(None, False), (1.0, False), (None, True)])
def test_padding_entries_have_no_derivative_in_either_mode(max_norm, freq, rows):
    """Forward mode of a plain lookup would give the padding row a tangent that reverse mode
    (the gradient) does not, and not divide a row's tangent by its count as the gradient does
    with ``scale_grad_by_freq``: ``<J v, u> = <v, J^T u>`` must hold with one ``J``. The
    padding is cut at the table's row or at the looked-up rows, whichever are fewer than the
    6 tokens."""
    torch.manual_seed(0)
    module = nn.Embedding(rows, 3, padding_idx=0, max_norm=max_norm, scale_grad_by_freq=freq)
    module = module.to(D)
    x = torch.tensor([[0, 1, 2], [0, 0, 4]])
    weight = module.weight.detach()
    v, u = torch.randn_like(weight), torch.randn(2, 3, 3, dtype=D)

    def f(w):
        return torch.func.functional_call(module, {"weight": w}, (x,))

    with Composites():
        _, jv = torch.func.jvp(f, (weight,), (v,))
        _, vjp = torch.func.vjp(f, weight)
        (jtu,) = vjp(u)
    assert torch.equal(jtu[0], torch.zeros(3, dtype=D))  # the padding row: no gradient
    assert torch.equal(jv[x == 0], torch.zeros(3, 3, dtype=D))  # and no tangent
    torch.testing.assert_close((jv * u).sum(), (v * jtu).sum(), rtol=1e-13, atol=0)


class PaddedTokens(nn.Module):
    """Token sequences with padding (index 0), a residual branch."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4, padding_idx=0)
        self.hidden = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.out(h + torch.tanh(self.hidden(h))).mean(1)


class RenormedEmbedding(PaddedTokens):
    """``nn.Embedding(max_norm=1)``: its forward pass rescales the rows it looks up, in place.
    Rows 1-4 start above the bound, row 0 below it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4, max_norm=1.0)
        with torch.no_grad():
            self.embed.weight.mul_(3.0)[0].mul_(0.02)


class Sparse(PaddedTokens):
    """An embedding with sparse gradients."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4, sparse=True)


class ScaledEmbedding(nn.Embedding):
    """An embedding subclass with a forward of its own, as sequence-to-sequence models scale
    their word embeddings."""

    def forward(self, tokens):
        return super().forward(tokens) * 2.0


class ScaledPadding(PaddedTokens):
    """A subclass's lookup with padding and its gradient scaled by frequency."""

    def __init__(self):
        super().__init__()
        self.embed = ScaledEmbedding(5, 4, padding_idx=0, scale_grad_by_freq=True)


class LookupInForward(PaddedTokens):
    """``F.embedding`` called in ``forward`` on a parameter: padding counted from the end
    (row 0) and rows renormalised to ``max_norm`` (in place, by PyTorch's own kernel)."""

    def __init__(self):
        super().__init__()
        del self.embed
        self.table = nn.Parameter(3.0 * torch.randn(5, 4))

    def forward(self, tokens):
        h = F.embedding(tokens, self.table, padding_idx=-5, max_norm=1.0)
        return self.out(h + torch.tanh(self.hidden(h))).mean(1)


class OperatorLookup(PaddedTokens):
    """The operator ``torch.embedding`` called in ``forward`` with a padding row and frequency
    scaling (the arguments in its own order: weight first)."""

    def forward(self, tokens):
        h = torch.embedding(self.embed.weight, tokens, 0, True)
        return self.out(h + torch.tanh(self.hidden(h))).mean(1)


class Bags(nn.Module):
    """Bags of tokens with offsets (an empty bag among them), by maximum and by weighted sum
    with renormalised rows."""

    def __init__(self):
        super().__init__()
        self.most = nn.EmbeddingBag(6, 4, mode="max", padding_idx=2)
        self.sum = nn.EmbeddingBag(6, 4, mode="sum", max_norm=1.0)
        self.out = nn.Linear(4, 3)
        with torch.no_grad():
            self.sum.weight.mul_(3.0)

    def forward(self, tokens, offsets, weights):
        h = self.most(tokens, offsets) + self.sum(tokens, offsets, per_sample_weights=weights)
        return self.out(torch.tanh(h))


class OwnBag(nn.EmbeddingBag):
    """An embedding-bag subclass with a forward of its own."""

    def forward(self, tokens, offsets, weights):
        return super().forward(tokens, offsets, per_sample_weights=weights) * 0.5


class BagsInForward(nn.Module):
    """``F.embedding_bag`` called in ``forward`` (means, padding counted from the end), beside
    a bag subclass (weighted sums)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 4))
        self.sum = OwnBag(6, 4, mode="sum")
        self.out = nn.Linear(4, 3)

    def forward(self, tokens, offsets, weights):
        means = F.embedding_bag(tokens, self.table, offsets, mode="mean", padding_idx=-4)
        return self.out(torch.tanh(means + self.sum(tokens, offsets, weights)))


def _case(name, dtype=D):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name in ("bags", "bags-in-forward"):
        x = (TOKENS, OFFSETS, torch.rand(len(TOKENS), generator=g, dtype=dtype))
        model, n = (Bags() if name == "bags" else BagsInForward()), len(OFFSETS)
    else:
        x = torch.randint(0, 5, (6, 3), generator=g)
        x[:, -1] = 0  # padding (or, with max_norm, the row below the bound) in every sequence
        build = {
            "padding": PaddedTokens,
            "max-norm": RenormedEmbedding,
            "sparse": Sparse,
            "subclass": ScaledPadding,
            "in-forward": LookupInForward,
            "operator": OperatorLookup,
        }
        model, n = build[name](), 6
    return model.to(dtype), x, torch.randn(n, 3, generator=g, dtype=dtype)


@pytest.mark.parametrize("engine", ["auto", "traced", "functional", "double-backward"])
@pytest.mark.parametrize("name", CASES)
def test_products_match_the_dense_reference(name, engine):
    model, x, y = _case(name)
    reference = copy.deepcopy(model)
    # the model's own forward passes (renormalising the reference's rows, as in training)
    G_ref, g_ref, _ = dense_ggn(reference, "mse", x, y)
    weights = [p.detach().clone() for p in model.parameters()]
    V = torch.randn(len(g_ref), 3, generator=torch.Generator().manual_seed(7), dtype=D)
    if engine == "double-backward":
        fmodel = FunctionalModel(model)
        functional = FunctionalEngine(fmodel, resolve_loss("mse"))
        functional.double_backward = True
        lin = functional(fmodel.flat(), Batch(x, y))
        grad, GV = lin.grad, torch.stack([lin.ggn_vp(v) for v in V.T], 1)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the composites need no notice
            G = GGN(model, "mse", x, y, engine=engine)
            grad, GV = G.gradient, G @ V
    torch.testing.assert_close(grad, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(GV, G_ref @ V, rtol=1e-9, atol=1e-11)
    # SGN's passes renormalise out of place: the model's weights are not written
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    if name in ("max-norm", "in-forward"):
        table = "table" if name == "in-forward" else "embed.weight"
        assert weights[0].norm(dim=1).max() > 2.0  # the case renormalises...
        assert reference.get_parameter(table).norm(dim=1).max() <= 1.0  # ...as the reference did


def _on(device, tree):
    if isinstance(tree, tuple):
        return tuple(_on(device, t) for t in tree)
    return tree.to(device)


def _products_on(device, name, engine, cuda_graphs=False):
    """``G V`` of a case on ``device`` (float64) beside the same on the CPU."""
    model, x, y = _case(name)
    V = torch.randn(sum(p.numel() for p in model.parameters()), 3, dtype=D)
    expected = GGN(copy.deepcopy(model), "mse", x, y, engine=engine) @ V
    model = copy.deepcopy(model).to(device)
    if not cuda_graphs:
        G = GGN(model, "mse", _on(device, x), y.to(device), engine=engine)
        return (G @ V.to(device)).cpu(), expected
    fmodel = FunctionalModel(model)  # (GGN captures no graphs: the engine SGN steps with)
    linearize = select_engine(fmodel, resolve_loss("mse"), engine, cuda_graphs=True)
    lin = linearize(fmodel.flat(), Batch(_on(device, x), y.to(device)))
    return torch.stack([lin.ggn_vp(v) for v in V.to(device).T], dim=1).cpu(), expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "engine,graphs", [("traced", False), ("traced", True), ("functional", False)]
)
@pytest.mark.parametrize("name", CASES)
def test_products_on_cuda_match_the_cpus(name, engine, graphs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. graphs that do not apply, with the reason
        got, expected = _products_on("cuda", name, engine, graphs)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("engine", ["auto", "functional"])
@pytest.mark.parametrize("name", CASES)
def test_sgn_steps_decrease_the_loss_in_float32(name, engine):
    model, x, y = _case(name, torch.float32)
    args = x if isinstance(x, tuple) else (x,)
    start = F.mse_loss(copy.deepcopy(model)(*args), y).item()
    tables = {"in-forward": "table"}
    tables.update((n, "embed.weight") for n in ("padding", "subclass", "operator"))
    table = model.get_parameter(tables[name]) if name in tables else None
    padding = None if table is None else table[0].detach().clone()  # row 0 pads in each
    opt = SGN(model, "mse", engine=engine, cg_iters=5)
    infos = [opt.step(x, y) for _ in range(3)]
    assert infos[0].loss == pytest.approx(start, rel=1e-6)  # the loss of the renormalised rows
    if table is not None:
        assert torch.equal(table[0], padding)  # as a gradient method keeps it
    assert F.mse_loss(model(*args), y).item() < 0.9 * start
    if name == "max-norm":
        assert model.embed.weight.norm(dim=1).max() <= 1.0  # the model's own forward did
    if name == "in-forward":
        assert table.norm(dim=1).max() <= 1.0  # the model's own forward (F.embedding) did


def test_the_bag_operator_itself_is_refused_clearly_and_loses_nothing():
    """``torch.embedding_bag``, the operator under ``F.embedding_bag``: its kernel has no
    forward-mode rule and its backward no derivative."""

    class Operator(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(7, 4))
            self.out = nn.Linear(4, 3)

        def forward(self, tokens):
            offsets = torch.arange(0, tokens.numel(), tokens.shape[1])
            bags = torch.embedding_bag(self.table, tokens.reshape(-1), offsets, False, 1)[0]
            return self.out(bags)

    model = Operator()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randint(0, 7, (4, 3)), torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="call F.embedding_bag or nn.EmbeddingBag"):
        SGN(model, "mse", engine="functional").step(x, y)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


class _ClampsItsWeight(nn.Module):
    """A forward pass that writes into its parameter (``clamp_``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.clamp_(-0.3, 0.3)
        return self.a(x)


@pytest.mark.parametrize("engine", ["auto", "functional"])
def test_a_forward_that_writes_a_parameter_is_refused_clearly_and_loses_nothing(engine):
    torch.manual_seed(0)
    model = _ClampsItsWeight()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the traced engine's hand-over to the functional one
        with pytest.raises(RuntimeError, match="writes into a parameter in place"):
            SGN(model, "mse", engine=engine).step(x, y)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


class _StopsItsScale(nn.Module):
    """Scales its output by its weight's mean taken under ``torch.no_grad`` (a gradient stop),
    to be scripted."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = self.lin.weight.mean()
        return self.lin(x) * scale


class ScriptedParts(nn.Module):
    """A TorchScript embedding (with a padding row or without) and, optionally, a scripted
    module with a gradient stop: code that SGN's function modes do not see."""

    def __init__(self, padding_idx, stop):
        super().__init__()
        self.embed = torch.jit.script(nn.Embedding(5, 4, padding_idx=padding_idx))
        self.mid = torch.jit.script(_StopsItsScale()) if stop else nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.out(torch.tanh(self.mid(self.embed(tokens).mean(1))))


SCRIPTED = {"padding": (0, False), "no-grad": (None, True), "plain": (None, False)}


@pytest.mark.parametrize("engine", ["auto", "traced", "functional"])
@pytest.mark.parametrize("name", list(SCRIPTED))
def test_scripted_submodules_give_exact_products(name, engine):
    torch.manual_seed(0)
    model = ScriptedParts(*SCRIPTED[name]).to(D)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (6, 3), generator=g)
    x[:, -1] = 0  # the padding row in every sequence
    y = torch.randn(6, 3, generator=g, dtype=D)
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        G = GGN(model, "mse", x, y, engine=engine)
        dense = G.to_dense()
    notices = [str(w.message) for w in record if "TorchScript" in str(w.message)]
    # forward mode would take the padding row's tangent, or differentiate the stopped scale
    assert len(notices) == (0 if name == "plain" else 1)
    assert all("double backward" in n for n in notices)
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)


class Embedding(nn.Module):
    """A user's own class named ``Embedding`` (tokens and positions), to be scripted."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(5, 4, padding_idx=0), nn.Embedding(3, 4)

    def forward(self, x):
        return self.tokens(x) + self.positions(torch.arange(x.shape[1]))


@pytest.mark.parametrize("how", ["scripted-own-class", "traced-module"])
def test_scripted_modules_named_embedding_without_its_options_are_read_as_code(how):
    torch.manual_seed(0)
    x = torch.randint(0, 5, (6, 3), generator=torch.Generator().manual_seed(0))
    x[:, -1] = 0
    if how == "scripted-own-class":
        embed = torch.jit.script(Embedding().to(D))
    else:
        embed = torch.jit.trace(nn.Embedding(5, 4, padding_idx=0).to(D), (x,))
    model = nn.Sequential(embed, nn.Flatten(), nn.Linear(12, 3)).to(D)
    y = torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    G_ref, _, _ = dense_ggn(model, "mse", x, y)
    with pytest.warns(UserWarning, match="TorchScript module '0'.*double backward"):
        dense = GGN(model, "mse", x, y).to_dense()
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)


def test_a_scripted_model_is_refused_with_what_to_do():
    model = torch.jit.script(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="TorchScript module as the model.*before torch.jit"):
        SGN(model, "mse")


def test_missing_derivatives_are_read_from_either_error_type():
    quoted = NotImplementedError("the derivative for '_embedding_bag_backward' is not implemented.")
    assert missing_rule(quoted) == "_embedding_bag_backward"
    plain = RuntimeError("the derivative for aten::foo_backward is not implemented")
    assert missing_rule(plain) == "foo_backward"
