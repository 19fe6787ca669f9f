"""One SGN run of ``benchmarks/pinn.py``'s 2-D Poisson problem (seed 0, the 2-64-64-48-48-1
net, 10,000 + 400 fixed points) with extra SGN options, an experiment. From the repository
root::

    PYTHONPATH=src python <this folder>/run_variant.py '{"direct_max_params": 2048}' 1000 out.json
"""

import json
import os
import sys

import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, BENCHMARKS)
import pinn  # noqa: E402

from torch_sgn import SGN  # noqa: E402


def main() -> None:
    options, seconds, out = json.loads(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    problem = pinn.poisson2d(0, points=(10000, 400))

    def method(name, residuals, net):  # SGN with the options, its steps' routes printed
        opt = SGN(residuals, residuals.loss, **options)
        infos = []

        def step(inputs, targets):
            info = opt.step(inputs, targets)
            infos.append((info.solver, info.sample, info.taken))
            if len(infos) % 50 == 0:
                print(len(infos), infos[-1], flush=True)
            return info.loss_after

        return step

    pinn._method = method

    def progress(partial: dict) -> None:
        with open(out + ".partial", "w") as f:
            json.dump(partial, f)

    result = pinn.run(problem, "2-64-64-48-48-1", "sgn", seconds, 0, progress)
    result["options"] = options
    with open(out, "w") as f:
        json.dump(result, f)
    print("final", result["final_error"], result["steps"])


if __name__ == "__main__":
    main()
