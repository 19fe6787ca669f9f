"""From the all-rows experiments' checkpoint (``checkpoint.py`` there: SGN's defaults after
STEPS steps on the 2-D Poisson problem, 10,000 + 400 points, seed 0), SECONDS more CPU seconds
of the defaults, with the whole problem's loss read after every step; prints one JSON line per
step: CPU seconds of the steps, step, rel. L2 error, the whole loss, the errors of two
exponential averages of the iterates (weights 0.9 and 0.98), whether the step was kept.

    R=benchmarks/results/2026-11-28_cpu_pinn_points_full_loss_experiments
    PYTHONPATH=src python $R/settle.py VARIANT 300 ck900.pt

Variants: ``default`` (every step kept), ``accept`` (a step that raises the whole loss is
undone: the parameters go back; the optimizer's state goes on, so the next step draws a new
sample). The whole loss and the averages are not counted in the CPU seconds.
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pinns"))
torch.set_num_threads(1)
import pinn as bench  # noqa: E402

from torch_sgn import SGN  # noqa: E402
from torch_sgn.pinn import Residuals  # noqa: E402

variant, seconds, ck = sys.argv[1], float(sys.argv[2]), torch.load(sys.argv[3], weights_only=False)
problem = bench.poisson2d(0, (10000, 400), True)
net = bench.network("2-64-64-48-48-1", 2, 0)
res = Residuals(net, problem.blocks(net))
opt = SGN(res, res.loss)
net.load_state_dict(ck["net"])
opt.load_state_dict(ck["opt"])
params = list(net.parameters())
g = torch.Generator().manual_seed(10_000)
x_eval = torch.rand(10_000, 2, generator=g, dtype=torch.float64)
u_eval = problem.exact(x_eval)
inputs, _ = res.batch(0)


def error(values=None):
    with torch.no_grad():
        if values is not None:
            kept = [p.clone() for p in params]
            for p, v in zip(params, values):
                p.copy_(v)
        e = float((net(x_eval) - u_eval).norm() / u_eval.norm())
        if values is not None:
            for p, v in zip(params, kept):
                p.copy_(v)
        return e


def whole_loss():
    with torch.no_grad():
        return float(res(*inputs).square().sum())


averages = {0.9: [p.detach().clone() for p in params], 0.98: [p.detach().clone() for p in params]}
clock, t, last = 0.0, ck["steps"], whole_loss()
print(json.dumps([0.0, t, error(), last, error(), error(), True]), flush=True)
while clock < seconds:
    batch = res.batch(t)
    before = [p.detach().clone() for p in params]
    t0 = time.process_time()
    opt.step(*batch)
    clock += time.process_time() - t0
    t += 1
    loss = whole_loss()
    kept = variant == "default" or loss <= last
    if kept:
        last = loss
    else:
        with torch.no_grad():
            for p, v in zip(params, before):
                p.copy_(v)
    with torch.no_grad():
        for beta, avg in averages.items():
            for a, p in zip(avg, params):
                a.mul_(beta).add_(p, alpha=1 - beta)
    row = [clock, t, error(), loss, error(averages[0.9]), error(averages[0.98]), kept]
    print(json.dumps(row), flush=True)
