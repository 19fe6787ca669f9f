"""One mini-batch as the optimizer and the engines pass it: :class:`Batch`, and :data:`Inputs`,
what a model's forward takes (a leaf module: every layer may name them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

from torch import Tensor

__all__ = ["Batch", "Inputs"]

Inputs = Union[Tensor, Tuple[Tensor, ...]]


@dataclass(frozen=True)
class Batch:
    """One mini-batch: the model's ``inputs`` (a tensor, or a tuple passed positionally) and the
    loss's ``targets``."""

    inputs: Inputs
    targets: Tensor

    @property
    def args(self) -> Tuple[Tensor, ...]:
        """The inputs as the tuple of positional arguments of the model's forward."""
        return self.inputs if isinstance(self.inputs, tuple) else (self.inputs,)

    def __len__(self) -> int:
        """The number of samples (the leading dimension of the first input)."""
        return self.args[0].shape[0]

    def subset(self, index: Tensor) -> Batch:
        """The samples at ``index`` (along the leading dimension of inputs and targets)."""
        xs = tuple(x[index] for x in self.args)
        return Batch(xs if isinstance(self.inputs, tuple) else xs[0], self.targets[index])
