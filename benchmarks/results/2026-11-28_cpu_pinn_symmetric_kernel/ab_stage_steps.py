"""Per-step CPU time of SGN's default steps on the 2-D Poisson problem with 10,000 + 400 points
(2-64-64-48-48-1, seed 0, float64, one thread) at each sampled stage: the 1,024-point sample
(``stalls`` 0), the 2,048-point sample (1), the 4,000-point sample (2). One process per
version and round; the runner alternates the versions (``ab_stage_steps.sh``).

    PYTHONPATH=<src> python ab_stage_steps.py BENCHMARKS_DIR LABEL STEPS
prints one JSON line: {"label", "stage": [median step seconds of STEPS steps], ...}
"""

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, sys.argv[1])  # the folder holding pinn.py (benchmarks/pinns)
torch.set_num_threads(1)
import pinn as bench  # noqa: E402

from torch_sgn import SGN  # noqa: E402
from torch_sgn.pinn import Residuals  # noqa: E402

label, steps = sys.argv[2], int(sys.argv[3])
out = {"label": label}
for stalls in (0, 1, 2):
    problem = bench.poisson2d(0, (10000, 400), True)
    net = bench.network("2-64-64-48-48-1", 2, 0)
    residuals = Residuals(net, problem.blocks(net))
    opt = SGN(residuals, residuals.loss)
    inputs, targets = residuals.batch(0)
    opt.step(inputs, targets)
    opt.state[next(net.parameters())]["stalls"] = stalls
    opt.step(inputs, targets)  # warm
    times = []
    for _ in range(steps):
        t = time.process_time()
        opt.step(inputs, targets)
        times.append(time.process_time() - t)
    out[str(stalls)] = statistics.median(times)
print(json.dumps(out), flush=True)
