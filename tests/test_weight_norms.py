"""Weight normalization (``torch.nn.utils.parametrizations.weight_norm`` and the older
``torch.nn.utils.weight_norm``), whose fused kernel has no forward-mode rule: SGN's passes run it
as a composite (``torch_sgn.model.weight_norms``). Its values against PyTorch's kernel, and the
products against a dense ``J^T H J`` built by reverse mode alone through the model's own
parameters and forward pass (``cases.dense_ggn``), in float64, on every engine."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import _WeightNorm, weight_norm

from cases import dense_ggn
from torch_sgn import GGN, SGN
from torch_sgn.model.composites import Composites

D = torch.float64


def _old_weight_norm(module, **kwargs):
    with warnings.catch_warnings():  # deprecated in favour of the parametrization
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(module, **kwargs)


class _OwnNorm(_WeightNorm):
    """A weight-norm subclass with a forward of its own."""

    def forward(self, weight_g, weight_v):
        return super().forward(weight_g, weight_v) * 2.0


def _own_weight_norm(module, **kwargs):
    module = weight_norm(module, **kwargs)
    module.parametrizations.weight[0].__class__ = _OwnNorm
    return module


class Net(nn.Module):
    """A weight-normalized convolution (norm over all dimensions but the first, or ``dim``) and
    linear layer (its norm over the second dimension: the last, also fused)."""

    def __init__(self, norm=weight_norm, conv_dim=0):
        super().__init__()
        self.conv = norm(nn.Conv1d(2, 3, 3, padding=1), dim=conv_dim)
        self.hidden = norm(nn.Linear(12, 4), dim=1)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.conv(x)).flatten(1))))


FORMS = {
    "parametrization": {},
    "parametrization-whole-tensor": {"conv_dim": None},  # one norm of the whole weight
    "parametrization-middle-dim": {"conv_dim": 1},  # PyTorch's unfused kernel
    "hook": {"norm": _old_weight_norm},
    "subclass": {"norm": _own_weight_norm},
}


def _case(form, seed=0):
    torch.manual_seed(seed)
    model = Net(**FORMS[form]).to(D)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 2, 4, generator=g, dtype=D), torch.randn(5, 2, generator=g, dtype=D)
    return model, x, y


@pytest.mark.parametrize("dim", [0, 1, 2, 3, None])
def test_composite_matches_pytorchs_kernel(dim):
    torch.manual_seed(1)
    module = weight_norm(nn.Conv2d(3, 4, (2, 5)), dim=dim).to(D)
    x = torch.randn(2, 3, 4, 6, dtype=D)
    expected = module(x)
    with Composites():
        torch.testing.assert_close(module(x), expected, rtol=1e-14, atol=1e-14)
        weight = module.weight
    assert weight.grad_fn.name() == "MulBackward0"  # v * (g / norm), where 0 and 3 are fused


#: (form, train): no form's products depend on the mode (none has dropout or statistics), so
#: evaluation mode runs with the slow tests for every form but the first
FORM_MODES = [
    pytest.param(
        form,
        train,
        id=f"{form}-{'train' if train else 'eval'}",
        marks=pytest.mark.slow if not train and form != "parametrization" else (),
    )
    for form in FORMS
    for train in (True, False)
]


@pytest.mark.parametrize("engine", ["auto", "traced", "functional"])
@pytest.mark.parametrize("form, train", FORM_MODES)
def test_products_match_the_dense_reference_without_double_backward(form, train, engine):
    model, x, y = _case(form)
    model.train(train)
    G_ref, g_ref, _ = dense_ggn(model, "mse", x, y)  # (the hook's model cannot be copied)
    with warnings.catch_warnings():  # no fallback: neither double backward nor another engine
        warnings.simplefilter("error")
        G = GGN(model, "mse", x, y, engine=engine)
        dense = G.to_dense()
    torch.testing.assert_close(G.gradient, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense, G_ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("engine", ["auto", "functional"])
@pytest.mark.parametrize("form", ["parametrization", "hook"])
def test_sgn_steps_train_the_direction_and_the_norm(form, engine):
    model, x, y = _case(form)
    model.float()
    x, y = x.float(), y.float()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = SGN(model, "mse", engine=engine, cg_iters=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one trace, no hand-over (the hook writes weight)
        infos = [opt.step(x, y) for _ in range(4)]
    assert infos[-1].loss_after < infos[0].loss
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # g and v both move
    model(x)  # the model's own forward pass takes PyTorch's fused kernel again
    assert "WeightNorm" in model.hidden.weight.grad_fn.name()


@pytest.mark.slow  # a subprocess of its own
def test_warnings_as_errors_do_not_turn_pytorchs_own_warnings_into_a_fallback():
    """PyTorch loads its forward-mode decompositions at the first forward-mode pass, and that
    module warns (DeprecationWarning) about its own use of ``torch.jit.script``. In a process
    where warnings are errors, SGN loads them first, quietly: the traced engine still traces.
    A fresh interpreter, since this process has loaded them already."""
    script = (
        "import torch, torch_sgn\n"
        "from torch import nn\n"
        "model = nn.GRU(3, 4, batch_first=True)\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.rnn = model\n"
        "    def forward(self, x):\n"
        "        return self.rnn(x)[0]\n"
        "x, y = torch.randn(2, 5, 3), torch.randn(2, 5, 4)\n"
        "G = torch_sgn.GGN(M(), 'mse', x, y, engine='traced')\n"
        "print(float((G @ torch.ones(G.shape[0])).norm()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) > 0
