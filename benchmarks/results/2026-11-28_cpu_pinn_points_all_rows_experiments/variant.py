"""From ``checkpoint.py``'s state, SECONDS more CPU seconds of a variant of the later stages;
prints one JSON line per step: CPU seconds, step, rel. L2 error, the step's loss after, its
solver, CG iterations, damping.

    R=benchmarks/results/2026-11-28_cpu_pinn_points_all_rows_experiments
    PYTHONPATH=src python $R/variant.py VARIANT 300 ck900.pt

Variants: ``default`` (SGN's defaults go on: the 4,000-point samples), ``all<N>`` (steps on
all rows at once, CG preconditioned by an N-point sample, as the last stage does with 1,024),
``reuse<K>_<N>_<I>`` (the same with the preconditioner kept for K steps and at most I CG
iterations), ``exact<N>`` (``direct_max_params=N``: exact steps through the ``R x R`` Gram
matrix of every row, for ``N`` at least the rows).
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pinns"))
torch.set_num_threads(1)
import pinn as bench  # noqa: E402

from torch_sgn import SGN, many_rows  # noqa: E402
from torch_sgn.engines.jacobian import by_factors  # noqa: E402
from torch_sgn.pinn import Residuals  # noqa: E402

variant, seconds, ck = sys.argv[1], float(sys.argv[2]), torch.load(sys.argv[3], weights_only=False)
problem = bench.poisson2d(0, (10000, 400), True)
net = bench.network("2-64-64-48-48-1", 2, 0)
res = Residuals(net, problem.blocks(net))
# exact<N>: direct_max_params=N, so that the Gram matrix of every row is formed (N >= 10,400)
most = int(variant[5:]) if variant.startswith("exact") else None
opt = SGN(res, res.loss) if most is None else SGN(res, res.loss, direct_max_params=most)
net.load_state_dict(ck["net"])
opt.load_state_dict(ck["opt"])
st = opt.state[next(net.parameters())]
if variant.startswith("all"):
    st["stalls"] = 3  # past the largest sample: steps on all rows
    pts = int(variant[3:])
    many_rows.linearized = lambda fm, loss, flat, batch, most: by_factors(
        fm, loss, flat, batch, pts
    )
if variant.startswith("reuse"):  # reuse{K}_{points}_{iterations}: the preconditioner kept K steps
    from torch_sgn.solve import sampled

    every, pts, iters = (int(x) for x in variant[5:].split("_"))
    st["stalls"] = 3
    sampled.ITERATIONS = iters
    many_rows.linearized = lambda fm, loss, flat, batch, most: by_factors(
        fm, loss, flat, batch, pts
    )
    made = sampled.SampledPreconditioner
    cache = {}

    def kept(sample):
        k = opt.state[next(net.parameters())]["step"] // every
        if k not in cache:
            cache.clear()
            cache[k] = made(sample)
        return cache[k]

    sampled.SampledPreconditioner = kept
g = torch.Generator().manual_seed(10_000)
x_eval = torch.rand(10_000, 2, generator=g, dtype=torch.float64)
u_eval = problem.exact(x_eval)


def error():
    with torch.no_grad():
        return float((net(x_eval) - u_eval).norm() / u_eval.norm())


clock, t = 0.0, ck["steps"]
print(json.dumps([0.0, t, error(), None, None, None]), flush=True)
while clock < seconds:
    inputs, targets = res.batch(t)
    t0 = time.process_time()
    info = opt.step(inputs, targets)
    clock += time.process_time() - t0
    t += 1
    print(
        json.dumps(
            [clock, t, error(), info.loss_after, info.solver, info.iterations, info.damping]
        ),
        flush=True,
    )
