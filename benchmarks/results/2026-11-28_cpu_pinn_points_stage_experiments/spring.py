"""Prototype: SPRING-style steps (Goldshlager, Abrahamsen, Lin 2024) on the sampled rows of the
10,400-point Poisson problem, from a checkpoint of SGN's sampled stage. Not library code."""
import json, math, sys, time
sys.path.insert(0, "/work/main/benchmarks")
import torch
import pinn
from torch_sgn import SGN
from torch_sgn.batch import Batch
from torch_sgn.engines.jacobian import by_factors
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.solve.sampled import draw

torch.set_num_threads(1)
mode, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
ckpt_steps = int(cfg.get("ckpt", 500))
problem = pinn.poisson2d(0, points=(10000, 400))
net = pinn.network("2-64-64-48-48-1", 2, 0)
res = pinn.Residuals(net, problem.blocks(net))
inputs, targets = res.batch()
g = torch.Generator().manual_seed(10_000)
x_eval = torch.rand(10_000, 2, generator=g, dtype=torch.float64)
u_eval = problem.exact(x_eval)
def error():
    with torch.no_grad():
        return float((net(x_eval) - u_eval).norm() / u_eval.norm())
path = f"/tmp/exp/ckpt_{ckpt_steps}.pt"
try:
    saved = torch.load(path)
    net.load_state_dict(saved["net"])
    print("checkpoint", saved["error"], saved["cpu"], flush=True)
except FileNotFoundError:
    opt = SGN(res, res.loss)
    t0 = time.process_time()
    for k in range(ckpt_steps):
        opt.step(inputs, targets)
    saved = {"net": net.state_dict(), "error": error(), "cpu": time.process_time() - t0,
             "opt": opt.state_dict()}
    torch.save(saved, path)
    print("made checkpoint", saved["error"], saved["cpu"], flush=True)
curve = [(0.0, 0, error())]
clock, k = 0.0, 0
if mode == "sgn":  # the defaults go on (their state restored)
    opt = SGN(res, res.loss)
    opt.load_state_dict(saved["opt"])
    step = lambda k: opt.step(inputs, targets).loss_after
else:
    fm = FunctionalModel(res)
    loss = SGN(res, res.loss)._loss
    mu, lam_rel, points, eta = cfg.get("mu", 0.9), cfg.get("lam", 1e-6), cfg.get("points", 1024), cfg.get("eta", 1.0)
    phi = None
    batch = Batch(inputs, targets)
    counts = res.points(inputs)
    def step(k):
        global phi
        flat = fm.flat()
        seed = 10**6 + k
        index = draw(counts, points, seed, flat.device)
        sub = res.subset(inputs, index)
        sb = Batch(sub, targets.new_zeros(res.count(sub)))
        lin = by_factors(fm, loss, flat, sb, 10**9)
        sample = lin.rows(0)
        r_s = lin.outputs.reshape(-1).to(torch.float64)
        K = sample.kernel
        lam = lam_rel * float(K.diagonal().mean())
        e = -r_s
        if phi is not None:
            e = e - mu * sample.jvp(phi)
        z = torch.linalg.solve(K + lam * torch.eye(K.shape[0], dtype=K.dtype), e)
        new = sample.vjp(z).to(flat.dtype)
        phi = new if phi is None else mu * phi + new
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat + eta * phi, [p for p in res.parameters() if p.requires_grad])
        return float(lin.loss)
next_eval = 1.0
while clock < seconds:
    t0 = time.process_time()
    l = step(k)
    clock += time.process_time() - t0
    k += 1
    if clock >= next_eval or clock >= seconds:
        curve.append((clock, k, error(), l))
        next_eval = clock * 1.25
        print(f"{clock:7.1f} s step {k:5d} error {curve[-1][2]:.2e} loss {l:.3e}", flush=True)
json.dump({"mode": mode, "cfg": cfg, "checkpoint": {"error": saved["error"], "cpu": saved["cpu"]}, "curve": curve}, open(out, "w"))
