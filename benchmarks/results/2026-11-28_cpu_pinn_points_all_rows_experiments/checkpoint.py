"""SGN's defaults on the 2-D Poisson problem with 10,000 + 400 points (seed 0, 2-64-64-48-48-1,
one thread) for STEPS steps; saves the net's and the optimizer's state to OUT.

    R=benchmarks/results/2026-11-28_cpu_pinn_points_all_rows_experiments
    PYTHONPATH=src python $R/checkpoint.py 900 ck900.pt
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pinns"))
torch.set_num_threads(1)
import pinn as bench  # noqa: E402

from torch_sgn import SGN  # noqa: E402
from torch_sgn.pinn import Residuals  # noqa: E402

steps = int(sys.argv[1])
problem = bench.poisson2d(0, (10000, 400), True)
net = bench.network("2-64-64-48-48-1", 2, 0)
res = Residuals(net, problem.blocks(net))
opt = SGN(res, res.loss)
t0 = time.process_time()
for t in range(steps):
    inputs, targets = res.batch(t)
    info = opt.step(inputs, targets)
    if t % 100 == 0:
        print(t, time.process_time() - t0, info.sample, flush=True)
state = {"net": net.state_dict(), "opt": opt.state_dict(), "steps": steps}
torch.save(state, sys.argv[2])
print("saved", time.process_time() - t0, opt.state_dict()["state"][0].get("stalls"), flush=True)
