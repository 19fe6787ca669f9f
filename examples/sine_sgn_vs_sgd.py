"""SGN against SGD on the paper's sine-wave regression task, on the CPU.

Command: python examples/sine_sgn_vs_sgd.py [--epochs 20]

The 1-20-20-20-1 sigmoid MLP of the paper (weights N(0, 1), biases 0), 10000 points
y = sin(10 x) + N(0, 0.01^2), first 30% test, mini-batches of 1000.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from torch_sgn import SGN


def make_data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(10000, 1, generator=g) * 2 - 1
    y = torch.sin(10 * x) + 0.01 * torch.randn(10000, 1, generator=g)
    return (x[3000:], y[3000:]), (x[:3000], y[:3000])


def make_model(seed: int = 10) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 20, 20, 20, 1]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        lin = nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.normal_(0, 1, generator=g)
            lin.bias.zero_()
        layers += [lin] if i == len(sizes) - 2 else [lin, nn.Sigmoid()]
    return nn.Sequential(*layers)


def train(name: str, epochs: int, make_step) -> None:
    (x, y), (xt, yt) = make_data()
    model = make_model()
    step = make_step(model)
    g = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(len(x), generator=g)
        for i in range(len(x) // 1000):
            idx = perm[i * 1000 : (i + 1) * 1000]
            step(x[idx], y[idx])
        with torch.no_grad():
            test = F.mse_loss(model(xt), yt).item()
        if epoch % max(1, epochs // 5) == 0:
            print(
                f"{name:8s} epoch {epoch:3d}  test mse {test:.5f}  "
                f"{time.perf_counter() - start:6.1f} s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    def sgn(model):
        opt = SGN(model, "mse", cg_iters=10)
        return lambda xb, yb: opt.step(xb, yb)

    def sgd(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(xb, yb):
            opt.zero_grad()
            F.mse_loss(model(xb), yb).backward()
            opt.step()

        return step

    train("SGN(10)", args.epochs, sgn)
    train("SGD(0.1)", args.epochs, sgd)


if __name__ == "__main__":
    main()
