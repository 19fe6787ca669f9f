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

import json
import logging
import math
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import __version__
from .. import distributed as sgn_dist
from ..losses import OutputLoss, resolve_loss
from ..optimizer import SGN
from ..options import PAPER_OPTIONS as _PAPER
from .data import Dataset, load
from .models import PRESETS

__all__ = [
    "GRIDS",
    "AdamOptions",
    "Grid",
    "RunConfig",
    "SGDOptions",
    "SGNOptions",
    "Setting",
    "run",
    "run_grid",
]

logger = logging.getLogger(__name__)

FORMAT = "torch-sgn/results-1"
"""Value of ``"format"`` in every ``results.json`` this module writes."""

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------- configs


@dataclass
class SGNOptions:
    """Options of :class:`torch_sgn.SGN` for a run, on top of the paper's configuration.

    The run's optimizer is ``SGN.paper(model, loss, **options)``
    (:meth:`torch_sgn.SGN.paper`); each default here is read from
    :data:`torch_sgn.options.PAPER_OPTIONS`, so the paper's runs are defined in one place.
    """

    cg_iters: int = _PAPER["cg_iters"]
    damping: float = _PAPER["damping"]
    damping_min: float = _PAPER["damping_min"]
    cg_tol: float = _PAPER["cg_tol"]
    lr: float = _PAPER["lr"]
    line_search: bool = _PAPER["line_search"]
    trust_region: bool = _PAPER["trust_region"]
    momentum: float = _PAPER["momentum"]
    warmup_cg_iters: Optional[int] = _PAPER["warmup_cg_iters"]
    warmup_steps: int = _PAPER["warmup_steps"]
    preconditioner: bool = _PAPER["preconditioner"]


@dataclass
class SGDOptions:
    """SGD (:class:`torch.optim.SGD`) with the original's learning-rate schedules.

    ``schedule``: ``"const"``; ``"step"`` (multiply by ``gamma`` every ``decay_steps``
    iterations); ``"cos"`` and ``"linear"`` (from ``lr`` to ``lr_final`` over ``decay_steps``
    iterations, then constant). The paper's runs: constant, no momentum.
    """

    lr: float = 0.1
    momentum: float = 0.0
    schedule: Literal["const", "step", "cos", "linear"] = "const"
    lr_final: float = 1e-3
    decay_steps: int = 1000
    gamma: float = 0.1


@dataclass
class AdamOptions:
    """Adam (:class:`torch.optim.Adam`); defaults are PyTorch's."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


@dataclass
class RunConfig:
    """One training run.

    Attributes:
        preset: Name in :data:`torch_sgn.experiments.models.PRESETS` (network, data set, loss,
            batch).
        optimizer: ``"sgn"``, ``"sgd"`` or ``"adam"``; only its options are used.
        seed: Seed of the mini-batch order (the network's initialisation has the paper's fixed
            seed unless ``init_seed`` is given).
        epochs: Epoch budget; ``None`` for none.
        time_budget: Training-time budget in seconds, checked at the end of each epoch (as the
            original did); ``None`` for none. At least one budget is required.
        batch_size: Mini-batch size; ``None`` for the preset's.
        init: ``"paper"`` or ``"torch"`` initialisation.
        init_seed: Initialisation seed; ``None`` for the paper's.
        device: Torch device.
        dtype: ``"float32"`` or ``"float64"``.
        threads: ``torch.set_num_threads`` for the run; ``None`` leaves it.
        cuda_graphs: SGN's ``cuda_graphs`` (replay its step's work as CUDA graphs; SGN on a
            CUDA device only).
        data_root: Directory with the file-based data sets; ``None`` for the default lookup.
        checkpoint_every: Seconds of wall time between checkpoints (taken at epoch ends);
            0 checkpoints after every epoch.
        sgn: Options when ``optimizer == "sgn"``.
        sgd: Options when ``optimizer == "sgd"``.
        adam: Options when ``optimizer == "adam"``.
    """

    preset: str = "boston"
    optimizer: Literal["sgn", "sgd", "adam"] = "sgn"
    seed: int = 1
    epochs: Optional[int] = None
    time_budget: Optional[float] = None
    batch_size: Optional[int] = None
    init: Literal["paper", "torch"] = "paper"
    init_seed: Optional[int] = None
    device: str = "cpu"
    dtype: Literal["float32", "float64"] = "float32"
    threads: Optional[int] = None
    cuda_graphs: bool = False
    data_root: Optional[str] = None
    checkpoint_every: float = 60.0
    sgn: SGNOptions = field(default_factory=SGNOptions)
    sgd: SGDOptions = field(default_factory=SGDOptions)
    adam: AdamOptions = field(default_factory=AdamOptions)

    def __post_init__(self) -> None:
        for name, kind in _OPTIMIZERS.items():  # accept the dicts of a config.json
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, kind.options_type(**value))
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; expected sgn, sgd or adam")
        if self.epochs is None and self.time_budget is None:
            raise ValueError("give an epoch budget, a time budget, or both")
        if self.sgd.schedule not in ("const", "step", "cos", "linear"):
            raise ValueError(f"unknown SGD schedule {self.sgd.schedule!r}")

    @property
    def options(self) -> Any:
        """The options of the chosen optimizer."""
        return getattr(self, self.optimizer)

    @property
    def label(self) -> str:
        """The setting as the paper names it: ``SGN(5)``, ``SGD(0.1)``, ``Adam(0.001)``."""
        return _OPTIMIZERS[self.optimizer].label(self.options)

    @property
    def name(self) -> str:
        """Directory name of the run: ``sgn_5_seed1``, ``sgd_0.1_seed1``, ``adam_0.001_seed1``."""
        return f"{_OPTIMIZERS[self.optimizer].key(self.options)}_seed{self.seed}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        return cls(**d)


# --------------------------------------------------------------------------- files


def _atomic_write_bytes(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(_jsonable(obj), indent=1) + "\n").encode())


def _atomic_torch_save(path: Path, obj: Any) -> None:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _atomic_write_bytes(path, buffer.getvalue())


def _jsonable(obj: Any) -> Any:
    # JSON has no NaN or infinity: write them as null (a diverged run's losses).
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


_NOT_IDENTITY = ("threads", "checkpoint_every", "data_root", "cuda_graphs")


def same_run(a: Optional[dict], b: Optional[dict]) -> bool:
    """Whether two configs (as dicts) describe the same run: how many threads, whether CUDA
    graphs replay the steps (both change results at most in rounding: other kernels), how
    often to checkpoint and where the data files lie do not (an older config without one of
    these keys matches too)."""
    if a is None or b is None:
        return False

    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in _NOT_IDENTITY}

    return strip(a) == strip(b)


def read_json(path: PathLike) -> Optional[dict]:
    """A JSON file's content, or ``None`` when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _git_commit() -> Optional[str]:
    """HEAD of the checkout this package was imported from, ``-dirty`` when the package's own
    files differ from it (untracked files included), or ``None`` outside a git checkout."""
    package = Path(__file__).resolve().parents[1]  # torch_sgn/, the library and this tooling
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=package,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    commit = out.stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "."],
        cwd=package,
        capture_output=True,
        text=True,
        timeout=5,
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


# Read once, when the code is imported: a long run records the code it runs, not the state of
# the checkout when it ends.
_GIT_COMMIT = _git_commit()


def device_name(device: torch.device) -> str:
    """A human name of the device: the GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _environment(device: torch.device) -> dict:
    return {
        "torch_sgn": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "git_commit": _GIT_COMMIT,
        "world_size": sgn_dist.world_size(),
        "backend": dist.get_backend() if sgn_dist.world_size() > 1 else None,
    }


# --------------------------------------------------------------------------- training


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


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


# --------------------------------------------------------------------------- optimizers


class _Optimizer:
    """What the training loop needs of one kind of optimizer: how to build it from the run's
    config, how to take a step, what to log per iteration, and what to checkpoint.

    Attributes:
        options_type: The options dataclass of :class:`RunConfig` for this optimizer.
        per_iteration: The keys of ``results.json``'s ``"iterations"`` (``"loss"`` first).
        broadcasts_model: Whether the optimizer broadcasts rank 0's model itself in a
            distributed run (else the runner does).
    """

    options_type: type = object
    per_iteration: tuple[str, ...] = ("loss",)
    broadcasts_model = False

    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        self.model = model
        self.opt: Any = None
        self.scheduler: Any = None

    @staticmethod
    def label(options: Any) -> str:
        """The setting as the paper names it, e.g. ``SGN(5)``."""
        raise NotImplementedError

    @staticmethod
    def key(options: Any) -> str:
        """The run directory's prefix, e.g. ``sgn_5``."""
        raise NotImplementedError

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
    options_type = SGNOptions
    per_iteration = ("loss", "damping", "step_size", "cg_iters")
    broadcasts_model = True

    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        super().__init__(cfg, model, loss)
        # Every option is one of SGN's arguments, by the same name, on top of the paper's
        # configuration (SGN.paper): SGNOptions is the one place the runner's SGN settings live.
        self.opt = SGN.paper(model, loss, cuda_graphs=cfg.cuda_graphs, **asdict(cfg.sgn))

    @staticmethod
    def label(options: SGNOptions) -> str:
        return f"SGN({options.cg_iters})"

    @staticmethod
    def key(options: SGNOptions) -> str:
        return f"sgn_{options.cg_iters}"

    def step(self, x, y):
        try:
            info = self.opt.step(x, y)
        except FloatingPointError:  # the step left the parameters as they were
            return None, False
        record = {
            "loss": info.loss,
            "damping": info.damping,
            "step_size": info.step_size,
            "cg_iters": info.cg_iters,
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
    options_type = SGDOptions

    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        super().__init__(cfg, model, loss)
        o = cfg.sgd
        self.opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(o))

    @staticmethod
    def _extra(options: SGDOptions, sep: str, m: str) -> str:
        extra = "" if options.schedule == "const" else f"{sep}{options.schedule}"
        return extra + (f"{m}{options.momentum:g}" if options.momentum else "")

    @classmethod
    def label(cls, options: SGDOptions) -> str:
        return f"SGD({options.lr:g}{cls._extra(options, ', ', ', m=')})"

    @classmethod
    def key(cls, options: SGDOptions) -> str:
        return f"sgd_{options.lr:g}{cls._extra(options, '_', '_m')}"


class _Adam(_Baseline):
    options_type = AdamOptions

    def __init__(self, cfg: RunConfig, model: nn.Module, loss: str):
        super().__init__(cfg, model, loss)
        o = cfg.adam
        self.opt = torch.optim.Adam(
            model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps
        )

    @staticmethod
    def label(options: AdamOptions) -> str:
        return f"Adam({options.lr:g})"

    @staticmethod
    def key(options: AdamOptions) -> str:
        return f"adam_{options.lr:g}"


_OPTIMIZERS: dict[str, type[_Optimizer]] = {"sgn": _SGN, "sgd": _SGD, "adam": _Adam}


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
        "iterations": {k: [] for k in _OPTIMIZERS[cfg.optimizer].per_iteration},
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
    wanted = _jsonable(cfg.to_dict())
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
        self.wanted = _jsonable(cfg.to_dict())
        self.device = torch.device(cfg.device)
        dtype = getattr(torch, cfg.dtype)
        self.preset = preset = PRESETS[cfg.preset]
        self.data = (load_data(cfg) if data is None else data).to(self.device, dtype)
        self.batch_size = min(cfg.batch_size or preset.batch_size, self.data.n_train)
        self.model = preset.build(cfg.init, cfg.init_seed).to(device=self.device, dtype=dtype)
        self.optimizer = _OPTIMIZERS[cfg.optimizer](cfg, self.model, preset.loss)
        self.gen = torch.Generator(self.device).manual_seed(cfg.seed)
        self.distributed = sgn_dist.world_size() > 1
        self.main = sgn_dist.is_main_process()
        if self.distributed and not self.optimizer.broadcasts_model:
            with torch.no_grad():
                for t in list(self.model.parameters()) + list(self.model.buffers()):
                    dist.broadcast(t, 0)
        if self.main:
            _atomic_write_json(
                out / "config.json",
                {"config": self.wanted, "environment": _environment(self.device)},
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
        _atomic_torch_save(
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
            return _jsonable(res)
        _atomic_write_json(self.out / "results.json", res)
        self.ckpt_path.unlink(missing_ok=True)
        return read_json(self.out / "results.json")


# --------------------------------------------------------------------------- grids


@dataclass(frozen=True)
class Setting:
    """One line of a grid: an optimizer with its options, and optional budget overrides."""

    optimizer: Literal["sgn", "sgd", "adam"]
    options: dict = field(default_factory=dict)
    epochs: Optional[int] = None
    time_budget: Optional[float] = None


@dataclass(frozen=True)
class Grid:
    """A paper benchmark: a preset, its settings, seeds, budgets and report points.

    Attributes:
        name: Key in :data:`GRIDS`.
        preset: Network and data set.
        settings: The optimizers compared.
        seeds: Seeds of the mini-batch order.
        epochs: Epoch budget of every setting without its own.
        time_budget: Time budget (seconds) of every setting without its own.
        report_times: Default ``T`` of the report's "after T seconds" table.
        report_epochs: Default ``E`` of the report's "after E epochs" table.
        description: One line for humans.
    """

    name: str
    preset: str
    settings: tuple[Setting, ...]
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    epochs: Optional[int] = None
    time_budget: Optional[float] = None
    report_times: tuple[float, ...] = ()
    report_epochs: tuple[int, ...] = ()
    description: str = ""

    def configs(
        self,
        seeds: Optional[Sequence[int]] = None,
        only: Optional[Sequence[str]] = None,
        epochs: Optional[int] = None,
        time_budget: Optional[float] = None,
        **overrides: Any,
    ) -> list[RunConfig]:
        """The grid's runs, setting by setting, seed by seed.

        Args:
            seeds: Replace the grid's seeds.
            only: Keep only settings whose run-name prefix (``sgn_5``, ``sgd_0.1``,
                ``adam_0.001``) or label (``SGN(5)``) is listed.
            epochs: Replace every epoch budget.
            time_budget: Replace every time budget.
            **overrides: Other :class:`RunConfig` fields (device, threads, ...).
        """
        out = []
        for s in self.settings:
            for seed in seeds or self.seeds:
                opts = {s.optimizer: _options(s.optimizer, s.options)}
                cfg = RunConfig(
                    preset=self.preset,
                    optimizer=s.optimizer,
                    seed=seed,
                    epochs=epochs if epochs is not None else (s.epochs or self.epochs),
                    time_budget=time_budget
                    if time_budget is not None
                    else (s.time_budget or self.time_budget),
                    **opts,
                    **overrides,
                )
                if only and not any(
                    cfg.name.rsplit("_seed", 1)[0] == o or cfg.label == o for o in only
                ):
                    continue
                out.append(cfg)
        return out


def _options(optimizer: str, options: dict) -> Any:
    return _OPTIMIZERS[optimizer].options_type(**options)


def _paper_settings(sgd_lrs: Sequence[float], sgd_epochs=None, sgn_epochs=None, adam_epochs=None):
    sgn = [Setting("sgn", {"cg_iters": k}, epochs=sgn_epochs) for k in (2, 3, 5, 10)]
    sgd = [Setting("sgd", {"lr": lr}, epochs=sgd_epochs) for lr in sgd_lrs]
    return tuple(sgn + sgd + [Setting("adam", {"lr": 1e-3}, epochs=adam_epochs)])


# The SGD learning rates are those of the original's published results for each data set.
GRIDS: dict[str, Grid] = {
    g.name: g
    for g in [
        Grid(
            "boston",
            "boston",
            _paper_settings([0.001, 0.01, 0.1, 1.0]),
            time_budget=10.0,
            report_times=(2.0, 10.0),
            report_epochs=(30,),
            description="Boston housing, 10 s of training per run as the paper",
        ),
        Grid(
            "boston-quick",
            "boston",
            _paper_settings([0.01, 0.1]),
            seeds=(1, 2, 3),
            time_budget=4.0,
            report_times=(1.0, 4.0),
            report_epochs=(10,),
            description="Boston housing, a few minutes on 2 CPU cores: 7 settings x 3 seeds x 4 s",
        ),
        Grid(
            "sine",
            "sine",
            _paper_settings([0.001, 0.01, 0.1, 1.0]),
            time_budget=100.0,
            report_times=(10.0, 100.0),
            report_epochs=(50,),
            description="Sine wave (frequency 10, the original's data), 100 s per run as the paper",
        ),
        Grid(
            "mnist",
            "mnist",
            _paper_settings([0.001, 0.01, 0.1, 1.0, 10.0], sgd_epochs=600, adam_epochs=600),
            epochs=100,
            report_times=(25.0, 100.0),
            report_epochs=(8, 33),
            description="MNIST: SGN 100 epochs, SGD and Adam 600, as the original's runs",
        ),
        Grid(
            "fashion_mnist",
            "fashion_mnist",
            _paper_settings([0.001, 0.01, 0.1, 1.0], sgd_epochs=100, adam_epochs=100),
            epochs=10,
            report_times=(50.0, 150.0),
            report_epochs=(5, 10),
            description="Fashion-MNIST: SGN 10 epochs, SGD and Adam 100, as the original's runs",
        ),
        Grid(
            "cifar10",
            "cifar10",
            _paper_settings([0.001, 0.01, 0.1, 1.0], sgd_epochs=100, adam_epochs=100),
            epochs=10,
            report_times=(650.0, 2000.0),
            report_epochs=(3, 9),
            description="CIFAR-10: SGN 10 epochs, SGD and Adam 100, as the original's runs",
        ),
    ]
}
"""The paper's benchmarks, by name."""


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
            _atomic_write_json(out / cfg.preset / "grid.json", {"grid": grid})
        bar.set_postfix_str(f"{cfg.preset} {cfg.label} seed {cfg.seed}")
        done = read_json(run_dir / "results.json")
        if done is not None and done.get("status") not in (None, "running"):
            old = read_json(run_dir / "config.json") or {}
            if same_run(old.get("config"), _jsonable(cfg.to_dict())):
                results.append(done)
                continue
        key = (cfg.preset, cfg.data_root)
        if key not in datasets:
            datasets[key] = load_data(cfg)
        results.append(run(cfg, run_dir, quiet=quiet, data=datasets[key], position=1))
    bar.close()
    return results
