"""The residual problem's protocol: what satisfies it, and what the step reads through it."""

from __future__ import annotations

import torch
from torch import nn

from torch_sgn.pinn import Residual, Residuals
from torch_sgn.residual_problem import JacobianBlock, ResidualProblem, residual_problem
from torch_sgn.route_plan import Capabilities


def _problem() -> Residuals:
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.linspace(0, 1, 6, dtype=torch.float64)[:, None]
    return Residuals(net, {"fit": Residual(lambda u, x: u(x) - x, points=x)})


def test_residuals_is_a_residual_problem_and_a_plain_module_is_not():
    problem = _problem()
    assert isinstance(problem, ResidualProblem)
    assert residual_problem(problem) is problem
    assert residual_problem(problem.network) is None
    assert residual_problem(nn.Linear(2, 1)) is None


def test_a_module_lacking_one_method_is_not_one():
    class Partial(nn.Module):  # count, points, subset, jacobian_blocks, but no factors
        def count(self, inputs):
            return 0

        def points(self, inputs):
            return []

        def subset(self, inputs, index):
            return ()

        def jacobian_blocks(self, fmodel, inputs):
            return []

    assert residual_problem(Partial()) is None


def test_capabilities_read_the_protocol():
    problem = _problem()
    caps = Capabilities.of(problem, object(), single_process=True)
    assert caps.residual_problem and caps.layer_factors
    caps = Capabilities.of(problem.network, object(), single_process=True)
    assert not caps.residual_problem and not caps.layer_factors


def test_jacobian_blocks_are_the_protocols_blocks():
    from torch_sgn.model.flat_model import FunctionalModel

    problem = _problem()
    inputs, _ = problem.batch()
    blocks = problem.jacobian_blocks(FunctionalModel(problem), inputs)
    assert len(blocks) == 1 and isinstance(blocks[0], JacobianBlock)
    assert problem.count(inputs) == 6 and problem.points(inputs) == [6]
