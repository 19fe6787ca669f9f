"""The 1,020-point PINN record's SGN runs, step by step, for a comparison to the bit.

    PYTHONPATH=<checkout>/src python pinn_steps_bits.py <checkout> OUT.pt

Builds the problems of ``benchmarks/pinns/pinn.py`` as that checkout writes them (2-D Poisson
on 900 + 120 points with the 2-64-1 and 2-64-64-48-48-1 nets, (1+1)-D heat with 2-64-1; seed
0; SGN's defaults, as its ``sgn`` method) and saves the parameters and the loss after every
step. ``compare`` prints, per run, whether the two files agree to the bit and the first step
where they do not::

    python pinn_steps_bits.py compare BEFORE.pt AFTER.pt
"""

from __future__ import annotations

import importlib.util
import sys

import torch

RUNS = (
    ("poisson2d", "2-64-1", 100),
    ("poisson2d", "2-64-64-48-48-1", 30),
    ("heat1d", "2-64-1", 60),
)


def record(checkout: str, out: str) -> None:
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("pinn", f"{checkout}/benchmarks/pinns/pinn.py")
    pinn = importlib.util.module_from_spec(spec)
    sys.modules["pinn"] = pinn  # (its dataclasses look their module up)
    spec.loader.exec_module(pinn)
    from torch_sgn import SGN
    from torch_sgn.pinn import Residuals

    saved = {}
    for name, net_spec, steps in RUNS:
        problem = getattr(pinn, name)(0)
        net = pinn.network(net_spec, problem.dim, 0)
        residuals = Residuals(net, problem.blocks(net))
        opt = SGN(residuals, residuals.loss)
        params, losses = [], []
        for _ in range(steps):
            losses.append(opt.step(*residuals.batch()).loss_after)
            params.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        saved[f"{name} {net_spec}"] = dict(params=torch.stack(params), losses=losses)
        print(name, net_spec, "loss after", steps, "steps:", losses[-1])
    torch.save(saved, out)


def compare(before: str, after: str) -> None:
    a, b = torch.load(before), torch.load(after)
    for key in a:
        x, y = a[key], b[key]
        same = [torch.equal(p, q) and s == t for p, q, s, t in
                zip(x["params"], y["params"], x["losses"], y["losses"])]  # fmt: skip
        first = same.index(False) if False in same else None
        verdict = "identical" if first is None else f"differs from step {first}"
        print(f"{key}: {len(same)} steps, {verdict}")


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        record(sys.argv[1], sys.argv[2])
