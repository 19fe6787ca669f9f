"""Training runs and grids of runs for the paper's benchmarks (Section 4).

A run trains one preset network (:data:`torch_sgn.experiments.models.PRESETS`) with one optimizer
and one seed, and writes two files into its own directory:

* ``config.json``: the full :class:`RunConfig`, the versions of torch-sgn, torch, numpy and
  Python, the device's name, the git commit, the number of threads;
* ``results.json``: per epoch (epoch 0 is the untrained network) the cumulative training
  time, train loss (and accuracy) on the whole training set, the mean mini-batch loss of the
  epoch (the original's ``avg_loss``), test loss (and accuracy); per iteration the mini-batch
  loss, and for SGN the damping, step size and CG iterations, for the baselines the learning
  rate.

The training clock covers only the optimizer steps and drawing the mini-batches: it stops for
evaluation, checkpoints and data loading, and synchronises the device before every reading.

Runs are resumable. Every ``checkpoint_every`` seconds (at an epoch's end) the model,
optimizer, scheduler, RNG states and the results so far are saved to ``checkpoint.pt``; every
file is written to a temporary name and renamed, so a run killed at any moment leaves either
the old or the new file, never a torn one. Calling :func:`run` again continues from the last
checkpoint; a finished run (``results.json`` with ``"status"`` not ``"running"``) is skipped.

Grids (:data:`GRIDS`) name the paper's settings per benchmark: SGN with 2, 3, 5 and 10 CG
iterations (10 iterations for the first 10 steps, as the paper's runs), SGD with the learning
rates of the original's published results for that data set, and Adam at its default 1e-3,
over seeds 1 to 5.

This module is the only part of torch-sgn that prints (progress bars, unless ``quiet``).

Distributed runs. When ``torch.distributed`` is initialised with more than one process (the
command line does it under ``torchrun``, see :func:`torch_sgn.distributed.init_from_env`),
:func:`run` trains data-parallel: every rank draws the same mini-batch sequence (the same
seeded generator) and trains on its slice (:func:`torch_sgn.distributed.shard`). SGN reduces
across ranks by itself; the SGD and Adam baselines all-reduce their gradients (and the batch
loss), each rank weighted by its share of the batch, so every rank takes the full batch's
step. Every rank evaluates (the models are identical, so nobody waits on anybody); only rank
0 writes files and shows progress. The training clock is the slowest rank's. On resume every
rank loads ``checkpoint.pt``, which rank 0 wrote: across nodes, ``out_dir`` must be on a file
system that every node sees. :func:`run_grid` is single-process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import distributed as sgn_dist
from ..losses import resolve_loss
from .config import AdamOptions, RunConfig, SGDOptions, SGNOptions, same_run
from .data import Dataset, load
from .grids import GRIDS, Grid, Setting
from .models import PRESETS
from .optimizers import OPTIMIZERS
from .records import (
    FORMAT,
    PathLike,
    atomic_torch_save,
    atomic_write_json,
    device_name,
    environment,
    jsonable,
    read_json,
)

__all__ = [
    "FORMAT",
    "GRIDS",
    "AdamOptions",
    "Grid",
    "RunConfig",
    "SGDOptions",
    "SGNOptions",
    "Setting",
    "device_name",
    "evaluate",
    "load_data",
    "read_json",
    "run",
    "run_grid",
    "same_run",
]

logger = logging.getLogger(__name__)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@torch.no_grad()
def evaluate(
    model: nn.Module, loss: str, x: Tensor, y: Tensor, chunk: int = 10000
) -> tuple[float, Optional[float]]:
    """Mean loss and, for classification, accuracy of ``model`` on ``(x, y)``."""
    fn = resolve_loss(loss)
    total, count, correct = 0.0, 0.0, 0
    was_training = model.training
    model.eval()
    for i in range(0, x.shape[0], chunk):
        out = model(x[i : i + chunk])
        target = y[i : i + chunk]
        weight = fn.normalizer(target)  # a chunk's mean times what it divides by: its sum
        total += fn.value(out, target).item() * weight
        count += weight
        if loss == "cross_entropy":
            correct += (out.argmax(1) == target).sum().item()
    model.train(was_training)
    return total / count, (correct / x.shape[0] if loss == "cross_entropy" else None)


def _new_results(cfg: RunConfig) -> dict:
    return {
        "format": FORMAT,
        "status": "running",
        "label": cfg.label,
        "task": None,
        "epochs": {
            "epoch": [],
            "time": [],
            "iterations": [],
            "train_loss": [],
            "train_acc": [],
            "batch_loss": [],
            "test_loss": [],
            "test_acc": [],
        },
        "iterations": {k: [] for k in OPTIMIZERS[cfg.optimizer].per_iteration},
    }


@dataclass
class _Progress:
    """Where a run stands: its results so far, epochs, training seconds and iterations done."""

    results: dict
    epoch: int = 0
    elapsed: float = 0.0
    iters: int = 0


def _record_epoch(res, epoch, elapsed, iters, model, loss, data, batch_losses) -> None:
    train_loss, train_acc = evaluate(model, loss, data.x_train, data.y_train)
    test_loss, test_acc = evaluate(model, loss, data.x_test, data.y_test)
    e = res["epochs"]
    e["epoch"].append(epoch)
    e["time"].append(elapsed)
    e["iterations"].append(iters)
    e["train_loss"].append(train_loss)
    e["train_acc"].append(train_acc)
    e["batch_loss"].append(float(np.mean(batch_losses)) if batch_losses else None)
    e["test_loss"].append(test_loss)
    e["test_acc"].append(test_acc)


def load_data(cfg: RunConfig) -> Dataset:
    """The data set of ``cfg``'s preset, on the CPU; sine is the original's exact data."""
    name = PRESETS[cfg.preset].dataset
    if name == "sine":
        return load(name, original=True)
    if name == "boston":
        return load(name)
    return load(name, root=cfg.data_root)


def run(
    cfg: RunConfig,
    out_dir: PathLike,
    *,
    quiet: bool = False,
    data: Optional[Dataset] = None,
    on_epoch: Optional[Callable[[int], None]] = None,
    position: int = 0,
) -> dict:
    """Train one run, resuming from its checkpoint if there is one; returns the results.

    Args:
        cfg: The run.
        out_dir: The run's directory; created if needed.
        quiet: No progress bar.
        data: The data set, already loaded (grids share it between runs); ``None`` loads it.
        on_epoch: Called with the epoch number after each epoch's checkpoint (if any) is
            written: a hook for tests that simulate a kill.
        position: tqdm position of the epoch bar (below the grid's bar).

    Returns:
        The content of ``results.json``.

    Raises:
        RuntimeError: When ``out_dir`` holds a run of another configuration.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wanted = jsonable(cfg.to_dict())
    old = read_json(out / "config.json")
    if old is not None and not same_run(old.get("config"), wanted):
        raise RuntimeError(
            f"{out} holds a run of another configuration; choose another directory or "
            f"delete it.\n  there: {old.get('config')}\n  asked: {wanted}"
        )
    done = read_json(out / "results.json")
    if done is not None and done.get("status") not in (None, "running"):
        logger.info("%s: finished already, skipped", out)
        return done

    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _Training(cfg, out, data).train(on_epoch, quiet, position)
    finally:
        torch.set_num_threads(threads)


class _Training:
    """One run's training: set up, then :meth:`train` runs its parts (restore, epochs,
    evaluation, checkpoints) and writes the results."""

    def __init__(self, cfg: RunConfig, out: Path, data: Optional[Dataset]):
        self.cfg, self.out = cfg, out
        self.ckpt_path = out / "checkpoint.pt"
        self.wanted = jsonable(cfg.to_dict())
        self.device = torch.device(cfg.device)
        dtype = getattr(torch, cfg.dtype)
        self.preset = preset = PRESETS[cfg.preset]
        self.data = (load_data(cfg) if data is None else data).to(self.device, dtype)
        self.batch_size = min(cfg.batch_size or preset.batch_size, self.data.n_train)
        self.model = preset.build(cfg.init, cfg.init_seed).to(device=self.device, dtype=dtype)
        self.optimizer = OPTIMIZERS[cfg.optimizer](cfg, self.model, preset.loss)
        self.gen = torch.Generator(self.device).manual_seed(cfg.seed)
        self.distributed = sgn_dist.world_size() > 1
        self.main = sgn_dist.is_main_process()
        if self.distributed and not self.optimizer.broadcasts_model:
            with torch.no_grad():
                for t in list(self.model.parameters()) + list(self.model.buffers()):
                    dist.broadcast(t, 0)
        if self.main:
            atomic_write_json(
                out / "config.json",
                {"config": self.wanted, "environment": environment(self.device)},
            )

    def train(self, on_epoch, quiet: bool, position: int) -> dict:
        cfg = self.cfg
        progress = self.restore()
        if self.distributed:  # every rank has read the checkpoint before rank 0 may replace it
            dist.barrier()
        from tqdm.auto import tqdm

        bar = tqdm(
            total=cfg.epochs,
            initial=progress.epoch,
            desc=f"{cfg.preset} {cfg.label} seed {cfg.seed}",
            unit="ep",
            leave=False,
            disable=quiet or not self.main,
            position=position,
            dynamic_ncols=True,
        )
        last_ckpt = time.monotonic()
        status = "running"
        try:
            while self.budget_left(progress):
                batch_losses, diverged = self.epoch(progress)
                self.evaluate(progress, batch_losses)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{progress.results['epochs']['train_loss'][-1]:.4g}",
                    t=f"{progress.elapsed:.1f}s",
                )
                if diverged:
                    status = "diverged"
                    break
                due = time.monotonic() - last_ckpt >= cfg.checkpoint_every
                if self.main and due and self.budget_left(progress):
                    self.checkpoint(progress)
                    last_ckpt = time.monotonic()
                if on_epoch is not None:
                    on_epoch(progress.epoch)
        finally:
            bar.close()
        return self.finish(progress, status)

    def budget_left(self, progress: _Progress) -> bool:
        cfg = self.cfg
        if cfg.epochs is not None and progress.epoch >= cfg.epochs:
            return False
        return cfg.time_budget is None or progress.elapsed < cfg.time_budget

    def restore(self) -> _Progress:
        """The progress saved in the checkpoint, with the model, optimizer and random states
        restored; a new run's (with the untrained network evaluated) if there is none."""
        ckpt = None
        if self.ckpt_path.exists():
            try:
                ckpt = torch.load(self.ckpt_path, map_location=self.device, weights_only=True)
            except Exception as e:  # a checkpoint from an older torch, or damaged by hand
                logger.warning(
                    "%s: unreadable checkpoint (%s); restarting the run", self.ckpt_path, e
                )
        if ckpt is not None and same_run(ckpt.get("config"), self.wanted):
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt)
            self.gen.set_state(ckpt["generator"].to(self.gen.get_state().device))
            torch.set_rng_state(ckpt["cpu_rng"])
            progress = _Progress(ckpt["results"], ckpt["epoch"], ckpt["time"], ckpt["iters"])
            logger.info(
                "%s: resuming after epoch %d (%.1f s)", self.out, progress.epoch, progress.elapsed
            )
            return progress
        progress = _Progress(_new_results(self.cfg))
        progress.results["task"] = self.data.task
        self.evaluate(progress, [], advance=False)
        return progress

    def epoch(self, progress: _Progress) -> tuple[list[float], bool]:
        """One pass over the training set, timed; returns the mini-batch losses and whether
        the run diverged. The clock covers the steps and drawing the batches only."""
        batch_losses: list[float] = []
        per_iter = progress.results["iterations"]
        diverged = False
        _synchronize(self.device)
        start = time.perf_counter()
        for x, y in self.data.batches(self.batch_size, self.gen):
            x_r, y_r = sgn_dist.shard(x, y)  # the whole batch in a single process
            record, going = self.optimizer.step(x_r, y_r)
            if record is not None:
                batch_losses.append(record["loss"])
                for key, value in record.items():
                    per_iter[key].append(value)
            if not going:
                diverged = True
                break
            progress.iters += 1
        _synchronize(self.device)
        took = time.perf_counter() - start
        if self.distributed:  # the slowest rank's time, so that every rank sees the same budget
            took_t = torch.tensor([took], dtype=torch.float64, device=self.device)
            dist.all_reduce(took_t, dist.ReduceOp.MAX)
            took = took_t.item()
        progress.elapsed += took
        return batch_losses, diverged

    def evaluate(self, progress: _Progress, batch_losses: list[float], advance=True) -> None:
        """Ends an epoch (``advance``; epoch 0 is the untrained network): records the loss
        and accuracy on the training and test sets and the epoch's mean mini-batch loss."""
        if advance:
            progress.epoch += 1
        _record_epoch(
            progress.results, progress.epoch, progress.elapsed, progress.iters, self.model,
            self.preset.loss, self.data, batch_losses,
        )  # fmt: skip

    def checkpoint(self, progress: _Progress) -> None:
        """Saves everything :meth:`restore` needs, atomically."""
        atomic_torch_save(
            self.ckpt_path,
            {
                "config": self.wanted,
                "model": self.model.state_dict(),
                **self.optimizer.state_dict(),  # "optimizer" and "scheduler"
                "generator": self.gen.get_state(),
                "cpu_rng": torch.get_rng_state(),
                "results": progress.results,
                "epoch": progress.epoch,
                "time": progress.elapsed,
                "iters": progress.iters,
            },
        )

    def finish(self, progress: _Progress, status: str) -> dict:
        """Writes ``results.json`` (rank 0) and removes the checkpoint; returns the results."""
        res = progress.results
        res["status"] = "finished" if status == "running" else status
        res["total_time"] = progress.elapsed
        res["total_iterations"] = progress.iters
        res["total_epochs"] = progress.epoch
        if not self.main:
            return jsonable(res)
        atomic_write_json(self.out / "results.json", res)
        self.ckpt_path.unlink(missing_ok=True)
        return read_json(self.out / "results.json")


def run_grid(
    configs: Sequence[RunConfig],
    out_dir: PathLike,
    *,
    grid: Optional[str] = None,
    quiet: bool = False,
) -> list[dict]:
    """Run every configuration into ``out_dir/<preset>/<run name>/``; finished runs are skipped.

    The data set is loaded once per preset and shared. A ``grid.json`` beside the runs names
    the grid (the report reads its default report points from it).

    Returns:
        The results of every run, in order.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    results = []
    datasets: dict[tuple, Dataset] = {}
    bar = tqdm(configs, desc="grid", unit="run", disable=quiet, dynamic_ncols=True)
    for cfg in bar:
        run_dir = out / cfg.preset / cfg.name
        if grid is not None:
            atomic_write_json(out / cfg.preset / "grid.json", {"grid": grid})
        bar.set_postfix_str(f"{cfg.preset} {cfg.label} seed {cfg.seed}")
        done = read_json(run_dir / "results.json")
        if done is not None and done.get("status") not in (None, "running"):
            old = read_json(run_dir / "config.json") or {}
            if same_run(old.get("config"), jsonable(cfg.to_dict())):
                results.append(done)
                continue
        key = (cfg.preset, cfg.data_root)
        if key not in datasets:
            datasets[key] = load_data(cfg)
        results.append(run(cfg, run_dir, quiet=quiet, data=datasets[key], position=1))
    bar.close()
    return results
