"""A prototype, not library code: SPRING-style steps (Goldshlager, Abrahamsen, Lin 2024) on
samples of the rows of ``benchmarks/pinn.py``'s 2-D Poisson problem (seed 0, the
2-64-64-48-48-1 net, 10,000 + 400 fixed points), from a checkpoint of SGN's defaults. From the
repository root::

    PYTHONPATH=src python <this folder>/spring.py spring 300 out.json '{"mu": 0.99, "eta": 0.1}'
    PYTHONPATH=src python <this folder>/spring.py sgn 300 out.json    # the defaults go on

The checkpoint (``{"ckpt": 500}`` steps of the defaults, by default) is made on the first run
and kept beside the output (``ckpt_<steps>.pt``). Each SPRING step draws ``points`` points
(seeded by the step), and with the sample's weighted residuals ``r_S``, rows ``J_S`` and Gram
matrix ``K = J_S J_S^T`` solves ``(K + lam I) z = -r_S - mu J_S phi`` (``lam`` the option
``lam`` times the mean of ``K``'s diagonal), then ``phi = mu phi + J_S^T z`` and the
parameters move by ``eta phi``.
"""

import json
import os
import sys
import time

import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, BENCHMARKS)
import pinn  # noqa: E402

from torch_sgn import SGN  # noqa: E402
from torch_sgn.batch import Batch  # noqa: E402
from torch_sgn.engines.jacobian import by_factors  # noqa: E402
from torch_sgn.model.flat_model import FunctionalModel  # noqa: E402
from torch_sgn.solve.sampled import draw  # noqa: E402


def main() -> None:
    mode, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    cfg = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    torch.set_num_threads(1)
    problem = pinn.poisson2d(0, points=(10000, 400))
    net = pinn.network("2-64-64-48-48-1", 2, 0)
    res = pinn.Residuals(net, problem.blocks(net))
    inputs, targets = res.batch()
    g = torch.Generator().manual_seed(10_000)
    x_eval = torch.rand(10_000, 2, generator=g, dtype=torch.float64)
    u_eval = problem.exact(x_eval)

    def error() -> float:
        with torch.no_grad():
            return float((net(x_eval) - u_eval).norm() / u_eval.norm())

    ckpt_steps = int(cfg.get("ckpt", 500))
    path = os.path.join(os.path.dirname(os.path.abspath(out)), f"ckpt_{ckpt_steps}.pt")
    if os.path.exists(path):
        saved = torch.load(path)
        net.load_state_dict(saved["net"])
    else:
        opt = SGN(res, res.loss)
        t0 = time.process_time()
        for _ in range(ckpt_steps):
            opt.step(inputs, targets)
        saved = {
            "net": net.state_dict(), "error": error(), "cpu": time.process_time() - t0,
            "opt": opt.state_dict(),
        }  # fmt: skip
        torch.save(saved, path)
    print("checkpoint", saved["error"], saved["cpu"], flush=True)

    if mode == "sgn":  # the defaults go on, their state restored
        opt = SGN(res, res.loss)
        opt.load_state_dict(saved["opt"])

        def step(k: int) -> float:
            return opt.step(inputs, targets).loss_after

    else:
        fm = FunctionalModel(res)
        loss = SGN(res, res.loss)._loss
        mu, lam_rel = cfg.get("mu", 0.9), cfg.get("lam", 1e-6)
        points, eta = cfg.get("points", 1024), cfg.get("eta", 1.0)
        counts = res.points(inputs)
        trainable = [p for p in res.parameters() if p.requires_grad]
        phi = None

        def step(k: int) -> float:
            nonlocal phi
            flat = fm.flat()
            index = draw(counts, points, 10**6 + k, flat.device)
            sub = res.subset(inputs, index)  # its rows weighted by sqrt(N_b / n_b)
            lin = by_factors(fm, loss, flat, Batch(sub, targets.new_zeros(res.count(sub))), 10**9)
            sample = lin.rows(0)  # all of the sub-batch's points: J_S itself
            kernel = sample.kernel
            lam = lam_rel * float(kernel.diagonal().mean())
            e = -lin.outputs.reshape(-1).to(torch.float64)
            if phi is not None:
                e = e - mu * sample.jvp(phi)
            eye = torch.eye(kernel.shape[0], dtype=kernel.dtype)
            z = torch.linalg.solve(kernel + lam * eye, e)
            new = sample.vjp(z).to(flat.dtype)
            phi = new if phi is None else mu * phi + new
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(flat + eta * phi, trainable)
            return float(lin.loss)

    curve = [(0.0, 0, error())]
    clock, k, next_eval = 0.0, 0, 1.0
    while clock < seconds:
        t0 = time.process_time()
        value = step(k)
        clock += time.process_time() - t0
        k += 1
        if clock >= next_eval or clock >= seconds:
            curve.append((clock, k, error(), value))
            next_eval = clock * 1.25
            line = f"{clock:7.1f} s step {k:5d} error {curve[-1][2]:.2e} loss {value:.3e}"
            print(line, flush=True)
    checkpoint = {"error": saved["error"], "cpu": saved["cpu"]}
    with open(out, "w") as f:
        json.dump({"mode": mode, "cfg": cfg, "checkpoint": checkpoint, "curve": curve}, f)


if __name__ == "__main__":
    main()
