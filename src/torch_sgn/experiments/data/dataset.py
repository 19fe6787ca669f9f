"""A data set as tensors on its device (:class:`Dataset`), its errors, and the mini-batch
iterator (:func:`batches`)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Literal, Optional, Union

import torch
from torch import Tensor

__all__ = ["DataFormatError", "Dataset", "DatasetNotFoundError", "Device", "PathLike", "batches"]


Device = Optional[Union[str, torch.device]]


PathLike = Union[str, "os.PathLike[str]"]


class DataFormatError(ValueError):
    """A data file is corrupt, truncated or not in the expected format."""


class DatasetNotFoundError(FileNotFoundError):
    """A data set's files are not on disk and could not be downloaded."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held as tensors.

    Attributes:
        name: Name of the data set, as in :func:`load`.
        x_train: Training inputs, first dimension the examples.
        y_train: Training targets: ``(N, 1)`` floats for regression, ``(N,)`` int64
            class labels for classification.
        x_test: Test inputs.
        y_test: Test targets.
        task: ``"regression"`` or ``"classification"``.
        num_classes: Number of classes; ``None`` for regression.
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    task: Literal["regression", "classification"]
    num_classes: Optional[int] = None

    @property
    def n_train(self) -> int:
        """Number of training examples."""
        return self.x_train.shape[0]

    @property
    def n_test(self) -> int:
        """Number of test examples."""
        return self.x_test.shape[0]

    def to(self, device: Device = None, dtype: Optional[torch.dtype] = None) -> Dataset:
        """A copy on ``device`` with floating-point tensors cast to ``dtype``.

        Integer class labels keep their dtype. ``None`` leaves device or dtype unchanged.
        """

        def move(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

        return dataclasses.replace(
            self,
            x_train=move(self.x_train),
            y_train=move(self.y_train),
            x_test=move(self.x_test),
            y_test=move(self.y_test),
        )

    def batches(
        self, batch_size: int, generator: Optional[torch.Generator] = None
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of shuffled training mini-batches; see :func:`batches`."""
        return batches(self.x_train, self.y_train, batch_size, generator)


def _device(device: torch.device) -> torch.device:
    """``device`` with its index made explicit (``cuda`` is the current CUDA device)."""
    if device.index is None and device.type != "cpu":
        return torch.empty(0, device=device).device
    return device


def batches(
    x: Tensor, y: Tensor, batch_size: int, generator: Optional[torch.Generator] = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """One epoch of mini-batches in a random order.

    The order is a random permutation drawn from ``generator``, on the data's device; the
    epoch yields ``len(x) // batch_size`` full batches and drops the remainder (as the
    paper's runs did: 4 iterations per epoch on Boston housing with 404 examples and
    batches of 101). Batches are gathered with :meth:`~torch.Tensor.index_select` on the
    device, so no data crosses to the host. Call once per epoch with the same generator
    for a reproducible sequence of epochs.

    Args:
        x: Inputs, first dimension the examples.
        y: Targets, same first dimension.
        batch_size: Examples per batch, at most ``len(x)``.
        generator: Source of the permutation, on the same device as ``x``; ``None`` uses
            the global RNG.

    Returns:
        An iterator of ``(x_batch, y_batch)``.

    Raises:
        ValueError: For mismatched lengths, a batch size out of range, or a generator on
            another device.
    """
    n = x.shape[0]
    if y.shape[0] != n:
        raise ValueError(f"x has {n} examples but y has {y.shape[0]}")
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be between 1 and the {n} examples, got {batch_size}")
    if y.device != x.device:
        raise ValueError(f"x is on {x.device} but y on {y.device}")
    if generator is not None and _device(generator.device) != _device(x.device):
        raise ValueError(
            f"generator is on {generator.device} but the data on {x.device}; "
            "create it with torch.Generator(device=x.device)"
        )

    def epoch() -> Iterator[tuple[Tensor, Tensor]]:
        perm = torch.randperm(n, generator=generator, device=x.device)
        for i in range(n // batch_size):
            idx = perm[i * batch_size : (i + 1) * batch_size]
            yield x.index_select(0, idx), y.index_select(0, idx)

    return epoch()
