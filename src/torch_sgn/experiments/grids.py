"""The paper's benchmarks as grids of runs (:data:`GRIDS`): per data set, SGN with 2, 3, 5 and
10 CG iterations, SGD at the original's learning rates and Adam, over seeds 1 to 5."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from .config import OPTIONS, RunConfig

__all__ = ["GRIDS", "Grid", "Setting"]


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
    return OPTIONS[optimizer](**options)


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
