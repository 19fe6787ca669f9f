"""The plan of a step (torch_sgn.route_plan): which rows it uses, how its J is formed, the exact
route it could take and the route it takes, made once per step and consistent with what the
step reports."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from cases import poisson_residuals, sgn_options
from torch_sgn import SGN, route_plan
from torch_sgn.linearization import ENGINE, FACTORS, ROWS, Batch
from torch_sgn.options import Setup
from torch_sgn.route_plan import Capabilities, Plan
from torch_sgn.solve.descents import CG, MATRIX, SAMPLED, SAMPLES
from torch_sgn.solve.state import DampingState, StepState

D = torch.float64


def _plans(caplog, opt: SGN, batch, steps: int = 1):
    """The plans of ``steps`` steps, as each step's :class:`StepInfo` shows it and as the
    ``torch_sgn`` logger's DEBUG record says it, with the :class:`StepInfo`."""
    out = []
    for _ in range(steps):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="torch_sgn"):
            info = opt.step(*batch)
        logged = [r.args[1] for r in caplog.records if r.args and isinstance(r.args[-1], Plan)]
        assert logged == [info.plan]  # one plan per step, the one it reports
        out.append((info.plan, info))
    return out


def _consistent(plan: Plan, info) -> None:
    """What the plan says against what the step reports."""
    assert plan.jacobian in (ENGINE, ROWS, FACTORS)
    assert (info.solver == "cg") == (plan.route in (CG, SAMPLED))
    assert (plan.rows is None) == (info.sample is None)
    assert plan.route in (plan.exact, CG)  # the exact route, or CG beside it


def test_a_residual_problem_within_the_limit_plans_exact_steps_on_its_rows(caplog):
    problem = poisson_residuals(60, 12)  # 72 residuals, 105 parameters
    ((plan, info),) = _plans(caplog, SGN(problem, problem.loss), problem.batch())
    _consistent(plan, info)
    assert plan.rows is None and plan.jacobian == ROWS
    assert plan.exact == plan.route == SAMPLES  # through the 72 outputs, not the 105 x 105 G


def test_too_many_rows_plan_a_sample_then_all_rows_by_the_layers_factors(caplog):
    problem = poisson_residuals(400, 40)  # 440 residuals, 105 parameters, both above 50
    opt = SGN(problem, problem.loss, direct_max_params=50)
    ((plan, info),) = _plans(caplog, opt, problem.batch())
    _consistent(plan, info)
    assert plan.rows == route_plan.SAMPLE and plan.jacobian == ROWS and plan.route == SAMPLES
    opt.state[next(problem.parameters())]["stalls"] = 1  # past the largest sample
    ((plan, info),) = _plans(caplog, opt, problem.batch())
    _consistent(plan, info)
    assert plan.rows == route_plan.ALL and plan.jacobian == FACTORS and plan.route == SAMPLED


def test_solver_cg_plans_cg_on_the_batch(caplog):
    problem = poisson_residuals(400, 40)
    opt = SGN(problem, problem.loss, solver="cg", direct_max_params=50)
    ((plan, info),) = _plans(caplog, opt, problem.batch())
    _consistent(plan, info)
    assert plan == Plan(None, ENGINE, CG, plan.phase) and plan.route == CG


def test_a_mini_batch_stream_plans_cg_with_probes_of_the_exact_route(caplog):
    """A plain model on changing mini-batches: ``solver="auto"`` takes CG and probes the
    exact route (through ``G``, formed by the engine) at its first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(D)
    opt = SGN(model, "mse")
    plans = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(32, 3, generator=g, dtype=D)
        plans += _plans(caplog, opt, (x, x.sum(1, keepdim=True).sin()))
    for plan, info in plans:
        _consistent(plan, info)
        assert plan.rows is None and plan.jacobian == ENGINE and plan.exact in (MATRIX, SAMPLES)
    assert plans[0][0].route == CG and plans[0][0].phase.probe == plans[0][0].exact


@pytest.mark.parametrize(
    "what", ["no layer factors", "solver cg", "momentum", "curvature subset", "two processes"]
)
def test_rows_are_the_batchs_wherever_the_stages_do_not_apply(what):
    problem = poisson_residuals(400, 40)
    batch, state = Batch(*problem.batch()), StepState(step=0, damping=DampingState(1e-4))
    caps = Capabilities.of(problem, object(), single_process=what != "two processes")
    assert caps.residual_problem and caps.layer_factors
    numel = sum(p.numel() for p in problem.parameters())
    setup = Setup.of("auto", False, False, 0.5 if what == "curvature subset" else 1.0, "auto", 50)
    options = sgn_options(gradient_averaging=0.9 if what == "momentum" else 0.0)
    if what == "no layer factors":
        caps = Capabilities(True, False, True, layer_factors=False)
    if what == "solver cg":
        setup = Setup.of("auto", False, False, 1.0, "cg", 50)
    plan = route_plan.start(caps, setup, options, problem, batch, numel, state)
    assert plan == Plan(None)
    allowed = Setup.of("auto", False, False, 1.0, "auto", 50)
    caps_ok = Capabilities.of(problem, object(), single_process=True)
    base = route_plan.start(caps_ok, allowed, sgn_options(), problem, batch, numel, state)
    assert base == Plan(route_plan.SAMPLE)  # (the same problem, where the stages apply)
