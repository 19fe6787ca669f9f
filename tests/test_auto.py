"""solver="auto": the paper's CG steps until exact steps prove better (torch_sgn.route_plan)."""

import copy
import logging
from dataclasses import fields, replace

import pytest
import torch
from torch import nn

from cases import flat_parameters, sgn_options
from torch_sgn import SGN, route_plan
from torch_sgn.solve import core
from torch_sgn.solve.state import AutoState

#: The stored keys of solver='auto''s part of the state.
AUTO_KEYS = {f.name for f in fields(AutoState)}


def _linear(seed=0, batches=16):
    """A linear least-squares fit in mini-batches: the exact step solves it, one CG iteration
    does not."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 1).double()
    w = torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64)
    data = []
    for _ in range(batches):
        x = torch.randn(32, 4, dtype=torch.float64)
        data.append((x, x @ w + 0.01 * torch.randn(32, 1, dtype=torch.float64)))
    return model, data


def _regression(seed=0, batches=30):
    """A small tanh network and mini-batches of a smooth target, in float64."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    data = []
    for _ in range(batches):
        x = torch.randn(64, 2, dtype=torch.float64)
        data.append((x, torch.sin(x[:, :1]) * torch.cos(x[:, 1:])))
    return model, data


def test_exact_wins_needs_the_margin_and_stalled_needs_two_full_windows():
    assert route_plan.exact_wins(0.98, 1.0) and not route_plan.exact_wins(0.995, 1.0)
    assert route_plan.exact_wins(-1.02, -1.0) and not route_plan.exact_wins(-1.005, -1.0)
    w = route_plan.CG_STALL.window
    falling = [0.5**k for k in range(2 * w)]
    flat = [1.0] * (2 * w)
    assert not route_plan.CG_STALL.stalled(falling) and route_plan.CG_STALL.stalled(flat)
    assert not route_plan.CG_STALL.stalled(flat[1:])  # one window not full yet
    slow = [1.0] * w + [1.0 - 0.5 * route_plan.CG_STALL.share] * w  # falls by half the share
    assert route_plan.CG_STALL.stalled(slow)


def test_auto_steps_by_cg_until_the_probe_wins_then_exactly(caplog):
    # cg_iters=1 makes CG's step poor: the first probe's exact step wins on the next batch, and
    # that step already runs exact.
    model, data = _linear()
    opt = SGN(model, "mse", cg_iters=1)
    with caplog.at_level(logging.INFO, logger="torch_sgn"):
        solvers = [opt.step(x, y).solver for x, y in data[:4]]
    assert solvers == ["cg", "direct", "direct", "direct"]
    assert "step 1: solver='auto' switches to exact steps (probe)" in caplog.text
    state = opt.state[next(model.parameters())]
    assert state["exact"] is True and "candidate" not in state and "next_probe" not in state


def test_the_cg_phase_is_the_cg_solver_step_for_step(monkeypatch):
    # Probes compute and judge, never write: until it switches, auto's steps are
    # solver="cg"'s, bit for bit; probes come every PROBE_EVERY steps.
    monkeypatch.setattr(route_plan, "exact_wins", lambda exact, cg: False)
    probes = []
    original = route_plan.auto_phase

    def plan(state, t, *args):
        phase = original(state, t, *args)
        if phase.probe is not None:
            probes.append(t)
        return phase

    monkeypatch.setattr(route_plan, "auto_phase", plan)
    model, data = _regression(batches=25)
    auto_model, cg = copy.deepcopy(model), copy.deepcopy(model)
    opt_auto, opt_cg = SGN(auto_model, "mse"), SGN(cg, "mse", solver="cg")
    for x, y in data:
        a, c = opt_auto.step(x, y), opt_cg.step(x, y)
        assert a.solver == "cg" and a.loss == c.loss and a.damping == c.damping
        assert torch.equal(flat_parameters(auto_model), flat_parameters(cg))
    every = route_plan.PROBE_EVERY
    assert probes == list(range(0, len(data), every))


def test_a_stall_switches_without_a_probe(monkeypatch):
    # The same noisy batch again and again: CG reaches its minimum, and the loss stops falling.
    # Copies of it, all alive (distinct tensors), so that the run is not taken for a full-batch
    # fit, where solver="auto" takes exact steps at once.
    monkeypatch.setattr(route_plan, "exact_wins", lambda exact, cg: False)
    model, data = _linear()
    opt = SGN(model, "mse")
    x, y = data[0]
    copies = [x.clone() for _ in range(3 * route_plan.CG_STALL.window)]
    solvers = [opt.step(c, y).solver for c in copies]
    first = solvers.index("direct")  # both windows full first, then direct for good
    assert first >= 2 * route_plan.CG_STALL.window and set(solvers[first:]) == {"direct"}


def test_a_full_batch_fit_takes_exact_steps_from_its_second_step(monkeypatch):
    # The first step cannot tell; the second sees the same tensors, unchanged: one batch.
    monkeypatch.setattr(route_plan, "exact_wins", lambda exact, cg: False)
    model, data = _linear()
    opt = SGN(model, "mse")
    x, y = data[0]
    assert [opt.step(x, y).solver for _ in range(3)] == ["cg", "direct", "direct"]
    x.add_(0.0)  # written in place: a new version, so not taken for the same batch
    assert opt.step(x, y).solver == "cg"
    fresh = SGN(copy.deepcopy(model), "mse")
    # a new batch each step, in the memory the last one freed: a stream, not one batch
    assert [fresh.step(x.clone(), y).solver for _ in range(3)] == ["cg", "cg", "cg"]


def test_a_resumed_run_takes_the_same_steps_through_the_switch():
    model, data = _linear()
    whole = copy.deepcopy(model)
    opt = SGN(whole, "mse", cg_iters=2)
    expected = [opt.step(x, y).solver for x, y in data]
    assert expected[0] == "cg" and "direct" in expected  # the run crosses the switch
    first = copy.deepcopy(model)
    opt = SGN(first, "mse", cg_iters=2)
    solvers = [opt.step(x, y).solver for x, y in data[:1]]  # a candidate is pending now
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(first.state_dict())
    assert "candidate" in saved["state"][0]
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(weights)
    opt = SGN(resumed, "mse", cg_iters=2)
    opt.load_state_dict(saved)
    solvers += [opt.step(x, y).solver for x, y in data[1:]]
    assert solvers == expected
    torch.testing.assert_close(flat_parameters(resumed), flat_parameters(whole), rtol=0, atol=0)


@pytest.mark.parametrize("solver", ["auto", "cg", "direct"])
def test_a_loaded_state_is_the_state_saved(solver):
    """Loading adds nothing: a state without solver="auto"'s keys (an explicit solver's) stays
    without them, and ``solver="auto"`` loaded from it starts with its CG steps and a probe."""
    model, data = _regression()
    opt = SGN(model, "mse", solver=solver)
    opt.step(*data[0])
    saved = copy.deepcopy(opt.state_dict())
    assert (solver == "auto") == bool(AUTO_KEYS & set(saved["state"][0]))
    fresh = SGN(copy.deepcopy(model), "mse", solver=solver)
    fresh.load_state_dict(saved)
    loaded = fresh.state_dict()["state"][0]
    assert loaded.keys() == saved["state"][0].keys()
    for key, value in saved["state"][0].items():
        assert torch.equal(torch.as_tensor(loaded[key]), torch.as_tensor(value)), key
    resumed = SGN(copy.deepcopy(model), "mse")
    resumed.load_state_dict(saved)
    assert resumed.step(*data[1]).solver == (
        "cg" if solver != "auto" else opt.step(*data[1]).solver
    )


@pytest.mark.parametrize("solver", ["cg", "direct"])
def test_explicit_solvers_never_switch(solver):
    model, data = _regression()
    opt = SGN(model, "mse", solver=solver, cg_iters=1)
    assert {opt.step(x, y).solver for x, y in data[:12]} == {solver}
    assert not AUTO_KEYS & set(opt.state[next(model.parameters())])


def test_cg_settings_of_a_one_batch_run_whose_forward_differentiates_itself():
    group = sgn_options(
        cg_iters=10, cg_tol=None, cg_rtol=0.0, preconditioner=False, warmup_cg_iters=None,
        warmup_steps=10,
    )  # fmt: skip
    plain32 = core.cg_settings(group, 5, False, torch.float32)
    plain64 = core.cg_settings(group, 5, False, torch.float64)
    assert (plain32.iters, plain32.tol, plain32.rtol, plain32.preconditioner) == (
        10, core.CG_TOL, 0.0, False,
    )  # fmt: skip
    assert plain64.tol == 0.0  # a float64 fit is not cut at a gradient of 1e-6
    nested64 = core.cg_settings(group, 5, True, torch.float64)
    assert nested64.iters == core.ONE_BATCH_CG_ITERS
    assert nested64.rtol == core.ONE_BATCH_CG_RTOL and nested64.preconditioner == "nystrom"
    assert core.cg_settings(group, 5, True, torch.float32).preconditioner is False
    mine = core.cg_settings(
        replace(group, cg_iters=300, cg_rtol=1e-6, preconditioner="diagonal"), 5, True,
        torch.float64,
    )  # fmt: skip
    assert (mine.iters, mine.rtol, mine.preconditioner) == (300, 1e-6, "diagonal")
    assert core.cg_settings(replace(group, cg_tol=1e-3), 5, False, torch.float64).tol == 1e-3


class _AutogradResiduals(nn.Module):
    """u'' + u = 0 residuals on [0, 1], u(0) = 0, u'(0) = 1, u'' by nested autograd."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 12), nn.Tanh(), nn.Linear(12, 1)).double()

    def forward(self, x):
        x = x.requires_grad_(True) if not x.requires_grad else x
        u = self.net(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (ddu,) = torch.autograd.grad(du.sum(), x, create_graph=True)
        return torch.cat([(ddu + u)[1:, 0], u[:1, 0], du[:1, 0] - 1])


def test_a_forward_that_differentiates_itself_gets_cg_solved_further_and_one_notice():
    torch.manual_seed(0)
    model = _AutogradResiduals()
    x = torch.linspace(0, 1, 30, dtype=torch.float64)[:, None]
    zeros = torch.zeros(31, dtype=torch.float64)
    opt = SGN(model, "mse")
    with pytest.warns(UserWarning, match="torch_sgn.pinn") as caught:
        infos = [opt.step(x, zeros) for _ in range(30)]
    assert sum("torch_sgn.pinn" in str(w.message) for w in caught) == 1
    assert infos[0].iterations <= 10  # a first step is not yet known to repeat its batch
    assert max(i.iterations for i in infos[1:]) > 10
    assert all(i.solver == "cg" for i in infos)
    assert infos[-1].loss < 1e-6 * infos[0].loss
    # the paper's CG settings on the same problem: its absolute cg_tol ends CG at 0 iterations
    # once the gradient is small, short of where the default steps go
    torch.manual_seed(0)
    paper = SGN(_AutogradResiduals(), "mse", solver="cg", cg_tol=1e-6)
    last = [paper.step(x, zeros) for _ in range(30)][-1]
    assert last.iterations == 0 and last.loss > 5 * infos[-1].loss
