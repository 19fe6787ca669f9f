"""The regression sets: Boston housing (shipped with the package) and the sine curve."""

from __future__ import annotations

import importlib.resources
import io
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .dataset import DataFormatError, Dataset, Device, PathLike

__all__ = ["boston", "sine"]


def _package_file(name: str):
    return importlib.resources.files("torch_sgn.experiments").joinpath("datasets").joinpath(name)


def _keras_split(n: int, test_split: float = 0.2, seed: int = 113) -> tuple[np.ndarray, ...]:
    # Keras `boston_housing.load_data`: shuffle with a seeded legacy RandomState, then
    # the first int(n * (1 - test_split)) rows are the training set.
    indices = np.arange(n)
    np.random.RandomState(seed).shuffle(indices)
    n_train = int(n * (1 - test_split))
    return indices[:n_train], indices[n_train:]


def boston(device: Device = None, dtype: torch.dtype = torch.float32) -> Dataset:
    """Boston housing regression (506 rows, 13 features; target: median value MEDV).

    Split exactly like Keras ``boston_housing.load_data(test_split=0.2, seed=113)``, as the
    paper did: 404 training and 102 test rows. Then, following the original code, the
    inputs are divided by the global maximum of their array and the targets by theirs,
    each of the training and test arrays by its *own* maximum.

    .. note::
        Per-array scaling is how we read the original ("inputs divided by the array's
        global max"). With this split it changes nothing: the training and test inputs
        share the maximum 711 (TAX) and the targets the maximum 50, so every feature ends
        up divided by 711 and the target by 50.

    .. warning::
        Feature ``B`` rests on a racist assumption; the data set is shipped only to
        reproduce the paper. See ``datasets/README.md`` in the package.

    Args:
        device: Device of the returned tensors.
        dtype: Floating-point dtype of the returned tensors.

    Returns:
        ``x`` of shape ``(N, 13)``, ``y`` of shape ``(N, 1)``, both in [0, 1].
    """
    path = _package_file("boston_house_prices.csv")
    table = np.loadtxt(io.StringIO(path.read_text()), delimiter=",", skiprows=1)
    if table.shape != (506, 14):
        raise DataFormatError(f"{path}: expected 506 rows of 14 columns, got {table.shape}")
    train, test = _keras_split(len(table))
    x, y = table[:, :13], table[:, 13:]
    parts = [a / a.max() for a in (x[train], y[train], x[test], y[test])]
    x_train, y_train, x_test, y_test = (
        torch.as_tensor(a, dtype=dtype, device=device) for a in parts
    )
    return Dataset("boston", x_train, y_train, x_test, y_test, "regression")


def sine(
    n: int = 10000,
    noise: float = 0.01,
    frequency: float = 10.0,
    seed: int = 0,
    path: Optional[PathLike] = None,
    original: bool = False,
    *,
    device: Device = None,
    dtype: torch.dtype = torch.float32,
) -> Dataset:
    """Noisy sine wave regression: ``y = sin(frequency * x) + eps``.

    Generated with a local generator (the global RNG is untouched): ``x ~ U(-1, 1)``,
    ``eps ~ N(0, noise^2)``, in float64 before the cast to ``dtype``; the first 30% of the
    points are the test set, the rest the training set.

    Args:
        n: Number of points.
        noise: Standard deviation of the noise.
        frequency: Angular frequency of the sine.
        seed: Seed of the generation.
        path: Load this JSON file instead, with keys ``X_train``, ``y_train``, ``X_test``,
            ``y_test`` (the original code's format); the other generation arguments are
            then ignored.
        original: Load the exact data of the paper's runs (frequency 10, noise 0.01,
            7000 training and 3000 test points), shipped with the package.
        device: Device of the returned tensors.
        dtype: Floating-point dtype of the returned tensors.

    Returns:
        ``x`` and ``y`` of shape ``(N, 1)``.
    """
    if original and path is not None:
        raise ValueError("pass either original=True or path, not both")
    if original or path is not None:
        if original:
            source = _package_file("sinusoidal_data_10.0_0.01.json")
            where = str(source)
            text = source.read_text()
        else:
            where = os.fspath(path)
            text = Path(path).read_text()
        try:
            raw = json.loads(text)
            arrays = [np.asarray(raw[k], dtype=np.float64) for k in ("X_train", "y_train")]
            arrays += [np.asarray(raw[k], dtype=np.float64) for k in ("X_test", "y_test")]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataFormatError(
                f"{where}: expected JSON with numeric lists X_train, y_train, X_test, y_test "
                f"({type(e).__name__}: {e})"
            ) from e
        x_train, y_train, x_test, y_test = (a.reshape(-1, 1) for a in arrays)
        if len(x_train) != len(y_train) or len(x_test) != len(y_test):
            raise DataFormatError(f"{where}: inputs and targets differ in length")
        parts = [torch.from_numpy(a) for a in (x_train, y_train, x_test, y_test)]
    else:
        if n < 2:
            raise ValueError(f"n must be at least 2, got {n}")
        gen = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 1, generator=gen, dtype=torch.float64) * 2 - 1
        y = torch.sin(frequency * x) + noise * torch.randn(n, 1, generator=gen, dtype=torch.float64)
        n_test = n * 3 // 10
        parts = [x[n_test:], y[n_test:], x[:n_test], y[:n_test]]
    x_train, y_train, x_test, y_test = (p.to(device=device, dtype=dtype) for p in parts)
    return Dataset("sine", x_train, y_train, x_test, y_test, "regression")
