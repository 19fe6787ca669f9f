"""How SGN.step is called: the batch positionally or by keyword, a closure only beside it."""

import copy
import functools

import pytest
import torch
from torch import nn

from torch_sgn import SGN


def _problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, generator=g, dtype=torch.float64)
    y = torch.randn(32, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    return model, x, y


def _steps(call, n=3):
    """The losses and final parameters of ``n`` steps, each taken by ``call(opt, x, y)``."""
    model, x, y = _problem()
    opt = SGN(model, "mse")
    infos = [call(opt, x, y) for _ in range(n)]
    return [(i.loss, i.loss_after, i.damping) for i in infos], list(model.parameters())


def test_the_keyword_form_and_a_closure_beside_the_batch_take_the_positional_steps():
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        return torch.tensor(123.0)  # not used by the step

    reference = _steps(lambda opt, x, y: opt.step(x, y))
    keyword = _steps(lambda opt, x, y: opt.step(inputs=x, targets=y))
    closed = _steps(lambda opt, x, y: opt.step(inputs=x, targets=y, closure=closure))
    for other in (keyword, closed):
        assert other[0] == reference[0]
        for p, q in zip(other[1], reference[1]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert calls == [True, True, True]  # once per step, with gradients enabled (as torch.optim)


def _closure_of(model, x, y):
    return lambda: nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize(
    "call",
    [
        lambda opt, c: opt.step(c),  # torch's form
        lambda opt, c: opt.step(closure=c),  # torch's form by keyword
    ],
)
def test_a_closure_alone_is_refused_with_the_reason_and_nothing_changes(call):
    model, x, y = _problem()
    opt = SGN(model, "mse")
    opt.step(x, y)
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    with pytest.raises(TypeError, match=r"not a closure.*Gauss-Newton matrix") as raised:
        call(opt, _closure_of(model, x, y))
    assert "Lightning" not in str(raised.value)  # the hint is for Lightning's closures only
    assert str(model.state_dict()) == str(before[0])
    assert str(opt.state_dict()) == str(before[1])


def test_a_closure_beside_a_batch_without_targets_is_not_called():
    model, x, _ = _problem()
    opt = SGN(model, "mse")
    called = []
    with pytest.raises(TypeError, match="needs the targets"):
        opt.step(x, closure=lambda: called.append(1))
    assert called == []
    with pytest.raises(TypeError, match="closure must be callable"):
        opt.step(x, x, closure=1.0)


def test_a_closure_from_lightning_gets_the_manual_optimization_hint(monkeypatch):
    # Lightning passes functools.partial(<its precision plugin's _wrap_closure>, ...); a
    # stand-in function from a module named like Lightning's, so no Lightning is needed.
    def _wrap_closure(model, optimizer, closure):
        return closure()

    monkeypatch.setattr(_wrap_closure, "__module__", "lightning.pytorch.plugins.precision")
    model, x, y = _problem()
    opt = SGN(model, "mse")
    with pytest.raises(TypeError, match=r"automatic_optimization = False.*step\(inputs=x"):
        opt.step(closure=functools.partial(_wrap_closure, model, opt, _closure_of(model, x, y)))
