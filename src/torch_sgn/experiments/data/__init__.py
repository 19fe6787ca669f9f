"""The SGN paper's data sets, scaled and split as the paper did, plus a mini-batch iterator.

Every loader returns a :class:`Dataset` whose tensors already live on the requested device:
the whole data set is small enough to stay there, and :func:`batches` draws mini-batches
by indexing on the device, without host copies.

=============== ===================================== ========================================
name            source                                scaling
=============== ===================================== ========================================
boston          shipped CSV, Keras 404/102 split      inputs and targets divided by their max
sine            generated (or the original's file)    none
mnist           IDX files                             pixels / 255
fashion_mnist   IDX files                             each image: (x - mean) / std
cifar10         python pickle batches                 each image: (x - mean) / std
=============== ===================================== ========================================

The file-based sets are looked up, in this order, in

1. ``root`` (the loader's argument),
2. the directory named by the environment variable ``TORCH_SGN_DATA``,
3. the user cache, ``$XDG_CACHE_HOME/torch_sgn`` or ``~/.cache/torch_sgn``,

each in this package's layout (``<dir>/mnist/``, ``<dir>/fashion_mnist/``,
``<dir>/cifar-10-batches-py/``) and torchvision's (``<dir>/MNIST/raw/``,
``<dir>/FashionMNIST/raw/``, ``<dir>/cifar-10-batches-py/``), then, for Fashion-MNIST,
in the Debian package ``dataset-fashion-mnist``'s ``/usr/share/datasets/fashion-mnist/``.
IDX files may be gzipped (``.gz``) or not. When none holds the files and ``download`` is
true, they are downloaded from their canonical sources into the first of those three
directories (``root`` if given, else ``TORCH_SGN_DATA`` if set, else the cache), and their
MD5 checksums verified.

References:
    Gargiani, Zanelli, Diehl, Hutter. "On the Promise of the Stochastic Generalized
    Gauss-Newton Method for Training DNNs", 2020.
"""

from __future__ import annotations

from typing import Callable

from .dataset import DataFormatError, Dataset, DatasetNotFoundError, batches
from .files import ENV_VAR, cache_dir
from .images import cifar10, fashion_mnist, mnist, read_idx
from .regression import boston, sine

__all__ = [
    "ENV_VAR",
    "DataFormatError",
    "Dataset",
    "DatasetNotFoundError",
    "batches",
    "boston",
    "cache_dir",
    "cifar10",
    "fashion_mnist",
    "load",
    "mnist",
    "read_idx",
    "sine",
]


_LOADERS: dict[str, Callable[..., Dataset]] = {
    "boston": boston,
    "sine": sine,
    "mnist": mnist,
    "fashion_mnist": fashion_mnist,
    "cifar10": cifar10,
}


def load(name: str, **kwargs) -> Dataset:
    """Load a data set by name: the names of :data:`torch_sgn.experiments.models.PRESETS`.

    Args:
        name: ``"boston"``, ``"sine"``, ``"mnist"``, ``"fashion_mnist"`` or ``"cifar10"``.
        **kwargs: Passed to the loader (all take ``device`` and ``dtype``).

    Returns:
        The data set.
    """
    try:
        loader = _LOADERS[name]
    except KeyError:
        raise ValueError(f"unknown data set {name!r}; expected one of {sorted(_LOADERS)}") from None
    return loader(**kwargs)
