"""SGN's step in two halves (torch_sgn.stepper): prepare writes nothing, abandon restores the
random state, prepare then finish is SGN.step to the bit."""

from __future__ import annotations

import copy

import torch
from torch import nn

from torch_sgn import SGN


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1)).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 3, generator=g, dtype=torch.float64), torch.randn(
        16, 1, generator=g, dtype=torch.float64
    )


def test_a_prepared_step_abandoned_changes_nothing():
    model = _model()  # (training mode: dropout draws random numbers in every forward pass)
    opt = SGN(model, "mse")
    x, y = _batch()
    opt.step(x, y)
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    rng = torch.get_rng_state()
    stepper = opt._stepper
    prepared = stepper.prepare(opt._options, x, y, opt._global_state())
    assert prepared.grad_norm > 0 and prepared.lin.grad.shape == (sum(p.numel() for p in params),)
    prepared.abandon()
    assert torch.equal(torch.get_rng_state(), rng)
    # the random state is no longer frozen: two passes draw two dropout masks
    flat = opt._fmodel.flat()
    assert not torch.equal(opt._fmodel(flat, x), opt._fmodel(flat, x))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for key, value in state["state"][0].items():
        other = after["state"][0][key]
        assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value


def test_prepare_then_finish_is_one_step_to_the_bit():
    x, y = _batch()
    one, two = _model(), _model()
    opt_one, opt_two = SGN(one, "mse"), SGN(two, "mse")
    torch.manual_seed(5)
    infos = [opt_one.step(x, y) for _ in range(3)]
    torch.manual_seed(5)
    halves = []
    for _ in range(3):
        prepared = opt_two._stepper.prepare(opt_two._options, x, y, opt_two._global_state())
        halves.append(opt_two._stepper.finish(prepared))
    assert [i.loss for i in infos] == [i.loss for i in halves]
    assert all(torch.equal(p, q) for p, q in zip(one.parameters(), two.parameters()))
