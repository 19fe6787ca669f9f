"""A run's configuration: each optimizer's options (:class:`SGNOptions`, :class:`SGDOptions`,
:class:`AdamOptions`, with how the paper names the setting) and :class:`RunConfig`; and which
fields make two configs the same run (:func:`same_run`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

from ..options import PAPER_OPTIONS as _PAPER
from .models import PRESETS

__all__ = ["OPTIONS", "AdamOptions", "RunConfig", "SGDOptions", "SGNOptions", "same_run"]


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

    def label(self) -> str:
        """The setting as the paper names it, e.g. ``SGN(5)``."""
        return f"SGN({self.cg_iters})"

    def key(self) -> str:
        """The run directory's prefix, e.g. ``sgn_5``."""
        return f"sgn_{self.cg_iters}"


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

    def _extra(self, sep: str, m: str) -> str:
        extra = "" if self.schedule == "const" else f"{sep}{self.schedule}"
        return extra + (f"{m}{self.momentum:g}" if self.momentum else "")

    def label(self) -> str:
        """The setting as the paper names it, e.g. ``SGD(0.1)``."""
        return f"SGD({self.lr:g}{self._extra(', ', ', m=')})"

    def key(self) -> str:
        """The run directory's prefix, e.g. ``sgd_0.1``."""
        return f"sgd_{self.lr:g}{self._extra('_', '_m')}"


@dataclass
class AdamOptions:
    """Adam (:class:`torch.optim.Adam`); defaults are PyTorch's."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def label(self) -> str:
        """The setting as the paper names it, e.g. ``Adam(0.001)``."""
        return f"Adam({self.lr:g})"

    def key(self) -> str:
        """The run directory's prefix, e.g. ``adam_0.001``."""
        return f"adam_{self.lr:g}"


#: each optimizer's options dataclass, by the name :attr:`RunConfig.optimizer` takes
OPTIONS: dict[str, type] = {"sgn": SGNOptions, "sgd": SGDOptions, "adam": AdamOptions}


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
        for name, kind in OPTIONS.items():  # accept the dicts of a config.json
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, kind(**value))
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}")
        if self.optimizer not in OPTIONS:
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
        return self.options.label()

    @property
    def name(self) -> str:
        """Directory name of the run: ``sgn_5_seed1``, ``sgd_0.1_seed1``, ``adam_0.001_seed1``."""
        return f"{self.options.key()}_seed{self.seed}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        return cls(**d)


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
