"""One SGN run of benchmarks/pinn.py's problem with extra SGN options (an experiment)."""
import json, sys, os, time, math
sys.path.insert(0, "/work/main/benchmarks")
import torch
import pinn
from torch_sgn import SGN
from torch_sgn.pinn import Residuals

options = json.loads(sys.argv[1]); seconds = float(sys.argv[2]); out = sys.argv[3]
points = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (10000, 400)
torch.set_num_threads(1)
problem = pinn.poisson2d(0, points=points)
orig = pinn._method
def method(name, residuals, net):
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
r = pinn.run(problem, "2-64-64-48-48-1", "sgn", seconds, 0, lambda p: json.dump(p, open(out + ".partial", "w")))
r["options"] = options
json.dump(r, open(out, "w"))
print("final", r["final_error"], r["steps"])
