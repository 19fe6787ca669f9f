"""The optimizers a run trains with, behind one interface (:data:`OPTIMIZERS`): SGN, and the
SGD and Adam baselines (SGD with the original's learning-rate schedules), all-reducing their
gradients in a distributed run."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import distributed as sgn_dist
from ..losses import OutputLoss, resolve_loss
from ..optimizer import SGN
from .config import RunConfig, SGDOptions

__all__ = ["OPTIMIZERS"]


def _lr_lambda(opts: SGDOptions) -> Callable[[int], float]:
    ratio = opts.lr_final / opts.lr
    k = max(opts.decay_steps, 1)

    def factor(t: int) -> float:
        if opts.schedule == "const":
            return 1.0
        if opts.schedule == "step":
            return opts.gamma ** (t // k)
        s = min(t, k) / k
        if opts.schedule == "linear":
            return 1.0 + (ratio - 1.0) * s
        return ratio + (1.0 - ratio) * 0.5 * (1.0 + math.cos(math.pi * s))  # "cos"

    return factor


class _Optimizer:
    """What the training loop needs of one kind of optimizer: how to build it from the run's
    config, how to take a step, what to log per iteration, and what to checkpoint.

    Attributes:
        per_iteration: The keys of ``results.json``'s ``"iterations"`` (``"loss"`` first).
        broadcasts_model: Whether the optimizer broadcasts rank 0's model itself in a
            distributed run (else the runner does).
    """

    per_iteration: tuple[str, ...] = ("loss",)
    broadcasts_model = False

    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        self.model = model
        self.opt: Any = None
        self.scheduler: Any = None

    def step(self, x: Tensor, y: Tensor) -> tuple[Optional[dict], bool]:
        """One step on this rank's shard of a batch: the iteration's record (keys
        :attr:`per_iteration`; ``None``: nothing to log) and whether the run goes on (``False``
        once it diverged)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {
            "optimizer": self.opt.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])


class _SGN(_Optimizer):
    per_iteration = ("loss", "damping", "step_size", "cg_iters")
    broadcasts_model = True

    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        super().__init__(cfg, model, loss)
        # Every option is one of SGN's arguments, by the same name, on top of the paper's
        # configuration (SGN.paper): SGNOptions is the one place the runner's SGN settings live.
        self.opt = SGN.paper(model, loss, cuda_graphs=cfg.cuda_graphs, **asdict(cfg.sgn))

    def step(self, x, y):
        try:
            info = self.opt.step(x, y)
        except FloatingPointError:  # the step left the parameters as they were
            return None, False
        record = {
            "loss": info.loss,
            "damping": info.damping,
            "step_size": info.step_size,
            "cg_iters": info.iterations,
        }
        return record, True


class _Baseline(_Optimizer):
    """A first-order baseline: a gradient on this rank's shard, all-reduced across ranks."""

    per_iteration = ("loss", "lr")

    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        super().__init__(cfg, model, loss)
        self.loss = resolve_loss(loss)

    def step(self, x, y):
        lr = self.opt.param_groups[0]["lr"]
        # .item() inside synchronises; the original printed the loss too
        value = _baseline_step(self.model, self.opt, self.loss, x, y)
        if self.scheduler is not None:
            self.scheduler.step()
        return {"loss": value, "lr": lr}, math.isfinite(value)


class _SGD(_Baseline):
    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        super().__init__(cfg, model, loss)
        o = cfg.sgd
        self.opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(o))


class _Adam(_Baseline):
    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        super().__init__(cfg, model, loss)
        o = cfg.adam
        self.opt = torch.optim.Adam(
            model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps
        )


OPTIMIZERS: dict[str, type[_Optimizer]] = {"sgn": _SGN, "sgd": _SGD, "adam": _Adam}


def _baseline_step(model: nn.Module, opt, loss: OutputLoss, x: Tensor, y: Tensor) -> float:
    """One SGD or Adam step on this rank's shard ``(x, y)`` of a batch.

    In a distributed run the gradients and the loss are all-reduced in one flat vector, each
    rank's weighted by what its mean divides by (:meth:`~torch_sgn.losses.OutputLoss.normalizer`),
    so this is the full batch's gradient and loss, for unequal (or empty) shards too. Returns
    the batch's loss.
    """
    opt.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    weight = loss.normalizer(y)
    if weight:
        value = loss.value(model(x), y)
        value.backward()
        value = value.detach()
    else:  # an empty shard: nothing to add (the mean of nothing would be NaN)
        value = params[0].new_zeros(())
    if sgn_dist.world_size() > 1:
        share = 1.0 if loss.reduction == "sum" else weight
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [value.reshape(1), value.new_ones(1)])
        flat *= share
        dist.all_reduce(flat)
        flat = flat[:-1] / (flat[-1] if loss.reduction != "sum" else 1.0)
        for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        value = flat[-1]
    opt.step()
    return value.item()
