"""SGN in a PyTorch Lightning training loop (manual optimization), on a small regression.

Command: python examples/lightning_sgn.py [--epochs 5] [--max-steps 40]

A 1-20-20-1 tanh MLP fits y = sin(3 x) + N(0, 0.05^2) on 2000 points in mini-batches of 200.
SGN needs the batch, not a loss closure, so the LightningModule sets
``automatic_optimization = False`` and calls ``self.optimizers().step(inputs=x, targets=y)``
in ``training_step``: the trainer then counts the steps (``global_step``, ``max_steps``) and
saves and restores SGN's state in its checkpoints. Needs ``pip install lightning``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torch_sgn import SGN, StepInfo


@dataclass
class Config:
    points: int = 2000
    batch_size: int = 200
    epochs: int = 5
    max_steps: int = 40  # -1: no limit but the epochs
    hidden: int = 20
    seed: int = 0
    float64: bool = False


def make_loader(config: Config) -> DataLoader:
    g = torch.Generator().manual_seed(config.seed)
    dtype = torch.float64 if config.float64 else torch.float32
    x = torch.rand(config.points, 1, generator=g, dtype=dtype) * 2 - 1
    y = torch.sin(3 * x) + 0.05 * torch.randn(config.points, 1, generator=g, dtype=dtype)
    # A fixed order, so that a run resumed from a checkpoint sees the batches it would have.
    return DataLoader(TensorDataset(x, y), batch_size=config.batch_size, shuffle=False)


class Regression(L.LightningModule):
    """An MLP trained by SGN through Lightning's manual optimization."""

    def __init__(self, hidden: int = 20, seed: int = 0, float64: bool = False, **sgn_options):
        super().__init__()
        self.automatic_optimization = False  # SGN.step needs the batch, not a closure
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        if float64:
            self.net.double()
        self.sgn_options = sgn_options
        self.steps: list[StepInfo] = []  # this run's steps, for the example's printout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> SGN:
        return SGN(self.net, loss="mse", **self.sgn_options)

    def training_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        # Keywords: LightningOptimizer.step(closure=None, **kwargs) takes no positional batch.
        # It returns SGN's StepInfo and advances trainer.global_step.
        info = self.optimizers().step(inputs=x, targets=y)
        self.steps.append(info)
        self.log("loss", info.loss, prog_bar=True)
        self.log("damping", info.damping)


def train(
    config: Config, trainer_options: Optional[dict] = None, ckpt_path: Optional[str] = None
) -> tuple[L.Trainer, Regression]:
    model = Regression(config.hidden, config.seed, config.float64)
    options = dict(max_epochs=config.epochs, max_steps=config.max_steps, accelerator="cpu")
    trainer = L.Trainer(**{**options, **(trainer_options or {})})
    trainer.fit(model, make_loader(config), ckpt_path=ckpt_path)
    return trainer, model


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=int, default=f.default)
    config = Config(**vars(parser.parse_args(argv)))
    trainer, model = train(config, dict(logger=False, enable_checkpointing=False))
    first, last = model.steps[0], model.steps[-1]
    print(
        f"global_step {trainer.global_step}  batch loss {first.loss:.4g} -> {last.loss_after:.4g}"
        f"  damping {last.next_damping:.3g}"
    )


if __name__ == "__main__":
    main()
