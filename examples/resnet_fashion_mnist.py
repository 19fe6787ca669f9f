"""SGN next to Adam on a small ResNet with batch norm, on Fashion-MNIST, on the CPU.

Command: python examples/resnet_fashion_mnist.py [--quick] [--epochs 3] [--train-size 4000]
[--threads 1]

The model is not an ``nn.Sequential`` chain (residual connections, batch norm in training
mode), so ``SGN``'s default ``engine="auto"`` takes the traced engine: the Gauss-Newton
product is traced once per batch shape and each CG iteration runs only the part of it that
depends on the vector (see ``torch_sgn.engines.traced.engine``). Batch norm's running statistics
are updated
once per step, by the forward pass that gives the gradient.

Fashion-MNIST is read where ``torch_sgn.experiments.data`` finds it (Debian's
``dataset-fashion-mnist`` package, a data directory, or a download).

Output of ``python examples/resnet_fashion_mnist.py --threads 1 --epochs 2`` (2-core x86 CPU
shared with other jobs, so the seconds are loose; torch 2.13, Python 3.11). Batch norm's
statistics are recomputed before each evaluation (see ``recalibrate``). Per epoch SGN(10) is
well ahead of Adam (lr 1e-3); each of its steps costs some 10-12 Adam steps here, so per
second Adam is ahead in the first epochs::

    SGN  epoch 1  train loss 1.3469  test loss 0.9236  accuracy 0.654    26.1 s
    SGN  epoch 2  train loss 0.8289  test loss 0.9802  accuracy 0.616    52.5 s
    Adam epoch 1  train loss 2.1460  test loss 1.9646  accuracy 0.387     2.2 s
    Adam epoch 2  train loss 1.8148  test loss 1.6891  accuracy 0.492     4.9 s
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from torch_sgn import SGN
from torch_sgn.experiments import data
from torch_sgn.experiments.models import ResNetBN


@torch.no_grad()
def recalibrate(model: nn.Module, x) -> None:
    """Batch norm's running statistics recomputed at the current weights, over ``x``.

    The running averages (momentum 0.1) mix statistics of the last ten or so steps; SGN's
    steps move the weights far enough that those are stale, so before an evaluation both
    optimizers' models get statistics of the weights they have.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches below
    for xb in x.split(256):
        model(xb)
    for m in norms:
        m.momentum = 0.1


@torch.no_grad()
def evaluate(model: nn.Module, x, y) -> tuple[float, float]:
    model.eval()
    out = torch.cat([model(xb) for xb in x.split(500)])
    model.train()
    return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


def train(name, make_optimizer, ds, epochs: int, batch_size: int) -> None:
    torch.manual_seed(0)
    model = ResNetBN(channels=1, width=8, stages=2)
    optimizer = make_optimizer(model)
    g = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        losses = []
        for x, y in data.batches(ds[0], ds[1], batch_size, g):
            if isinstance(optimizer, SGN):
                losses.append(optimizer.step(x, y).loss)
            else:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        recalibrate(model, ds[0][:1024])
        test_loss, acc = evaluate(model, ds[2], ds[3])
        print(
            f"{name:4s} epoch {epoch}  train loss {sum(losses) / len(losses):.4f}  "
            f"test loss {test_loss:.4f}  accuracy {acc:.3f}  {time.perf_counter() - start:6.1f} s"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps on a small subset")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--test-size", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.epochs, args.train_size, args.test_size, args.batch_size = 2, 128, 128, 64
    full = data.fashion_mnist()
    n, m = args.train_size, args.test_size
    ds = (full.x_train[:n], full.y_train[:n], full.x_test[:m], full.y_test[:m])
    optimizers = {
        "SGN": lambda m: SGN(m, "cross_entropy", cg_iters=3 if args.quick else 10),
        "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    }
    for name, make in optimizers.items():
        train(name, make, ds, args.epochs, args.batch_size)


if __name__ == "__main__":
    main()
