"""Data-parallel SGN: the paper's Boston housing network, each mini-batch sharded over the ranks.

Commands (from the repository root, with torch_sgn importable, e.g. PYTHONPATH=src):

    python -m torch.distributed.run --nproc-per-node 2 examples/distributed_train.py
    python examples/distributed_train.py            # one process: the same numbers

The 13-100-100-1 sigmoid MLP (N(0, 1) weights, seed 10), batches of 101 out of 404 training
rows (4 steps an epoch; 2 ranks get 51 and 50 rows), SGN with the paper's settings and 10 CG
iterations. Every rank draws the same batch order and keeps its shard; SGN weights the shards
by size, so the run follows one process on the full batches up to rounding. Only rank 0 prints.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from torch_sgn import SGN
from torch_sgn.distributed import init_from_env, is_main_process, shard, world_size
from torch_sgn.experiments.data import boston
from torch_sgn.experiments.models import PRESETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = parser.parse_args()

    init_from_env(timeout=120)  # a no-op without torchrun
    preset = PRESETS["boston"]
    dtype = getattr(torch, args.dtype)
    data = boston(dtype=dtype)
    model = preset.build().to(dtype)
    opt = SGN(model, preset.loss, cg_iters=10)  # broadcasts rank 0's parameters
    order = torch.Generator().manual_seed(args.seed)  # the same batch order on every rank
    if is_main_process():
        print(f"{world_size()} process(es), {sum(p.numel() for p in model.parameters())} params")
    for epoch in range(1, args.epochs + 1):
        for x, y in data.batches(preset.batch_size, order):
            info = opt.step(*shard(x, y))  # info.loss is the full batch's loss
        if is_main_process() and (epoch % 5 == 0 or epoch == 1):
            with torch.no_grad():
                test = F.mse_loss(model(data.x_test), data.y_test).item()
            print(
                f"epoch {epoch:3d}  batch loss {info.loss:.5f}  test mse {test:.5f}  "
                f"damping {info.damping:.2e}"
            )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank tears the group down while another still runs
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
