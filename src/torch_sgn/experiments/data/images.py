"""The image sets: MNIST and Fashion-MNIST (IDX files) and CIFAR-10 (pickled batches), read,
checked and scaled as the paper did."""

from __future__ import annotations

import gzip
import math
import pickle
import struct
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .dataset import DataFormatError, Dataset, Device, PathLike
from .files import SOURCES, Source, locate

__all__ = ["cifar10", "fashion_mnist", "mnist", "read_idx"]


_IDX_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _read_maybe_gzipped(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":  # the gzip magic number
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataFormatError(f"{path}: corrupt or truncated gzip data ({e})") from e


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file (the MNIST format), raw or gzipped.

    The format: two zero bytes, a type code (0x08 unsigned byte, 0x09 signed byte, 0x0B
    int16, 0x0C int32, 0x0D float32, 0x0E float64), the number of dimensions ``d``, then
    ``d`` big-endian uint32 sizes and the data in C order, big-endian.

    Args:
        path: The file; gzip is detected from its content, not its name.

    Returns:
        The array, in native byte order.

    Raises:
        DataFormatError: For a bad magic number, or a file shorter or longer than its
            header says; the message names the file.
    """
    path = Path(path)
    data = _read_maybe_gzipped(path)
    if len(data) < 4:
        raise DataFormatError(
            f"{path}: truncated IDX file: {len(data)} bytes, less than the 4-byte magic number"
        )
    if data[:2] != b"\0\0" or data[2] not in _IDX_TYPES:
        raise DataFormatError(
            f"{path}: not an IDX file: magic number 0x{data[:4].hex()} should be two zero "
            f"bytes, a type code in {{{', '.join(f'0x{c:02x}' for c in _IDX_TYPES)}}} "
            "and the number of dimensions"
        )
    dtype, ndim = _IDX_TYPES[data[2]], data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataFormatError(
            f"{path}: truncated IDX header: {ndim} dimensions need {header} bytes, "
            f"the file has {len(data)}"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = math.prod(shape) * dtype.itemsize
    found = len(data) - header
    if found != expected:
        what = "truncated IDX file" if found < expected else "IDX file with trailing bytes"
        raise DataFormatError(
            f"{path}: {what}: shape {shape} of {dtype.name} needs {expected} data bytes, "
            f"found {found}"
        )
    array = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=header)
    return array.reshape(shape).astype(dtype.newbyteorder("="))


_PICKLE_ALLOWED = {
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    # The CIFAR-10 batches are pickles, and unpickling can run arbitrary code; allow only
    # what a dict of numpy arrays and lists needs.
    def find_class(self, module: str, name: str):
        if module.startswith("numpy.core"):  # pickled by numpy < 2
            module = "numpy._core" + module[len("numpy.core") :]
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module.startswith("numpy._core") and not hasattr(np, "_core"):  # numpy < 2
            module = "numpy.core" + module[len("numpy._core") :]
        return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch: images ``(N, 3, 32, 32)`` uint8, labels int64."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except OSError:
        raise
    except Exception as e:  # truncation and corruption surface as many exception types
        raise DataFormatError(
            f"{path}: corrupt or truncated CIFAR-10 batch ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(batch, dict):
        raise DataFormatError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    missing = {"data", "labels"} - set(batch)
    if missing:
        raise DataFormatError(f"{path}: CIFAR-10 batch lacks the keys {sorted(missing)}")
    data, labels = batch["data"], np.asarray(batch["labels"])
    if not (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.shape[1] == 3 * 32 * 32
    ):
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data)
        raise DataFormatError(f"{path}: 'data' should be uint8 of shape (N, 3072), got {desc}")
    _check_labels(labels, data.shape[0], 10, path)
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _check_labels(labels: np.ndarray, n: int, num_classes: int, path: Path) -> None:
    if labels.shape != (n,):
        raise DataFormatError(f"{path}: expected {n} labels, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer) or (
        n and (labels.min() < 0 or labels.max() >= num_classes)
    ):
        raise DataFormatError(f"{path}: labels must be integers in [0, {num_classes})")


def _standardize_per_image(x: Tensor) -> Tensor:
    """``(x - mean) / std`` per image, over all its pixels and channels, in place.

    The standard deviation is the population one (``correction=0``), floored at
    ``1 / sqrt(pixels)`` as ``tf.image.per_image_standardization`` does, so that a
    constant image maps to zeros instead of NaN.
    """
    dims = tuple(range(1, x.ndim))
    std, mean = torch.std_mean(x, dim=dims, keepdim=True, correction=0)
    floor = 1.0 / math.sqrt(math.prod(x.shape[1:]))
    return x.sub_(mean).div_(std.clamp_min_(floor))


def _images_to_tensor(
    images: np.ndarray, device: Device, dtype: torch.dtype, scaling: str
) -> Tensor:
    # Cast on the device: uint8 crosses to it, not floats four times the size.
    x = torch.from_numpy(images).to(device)
    compute = torch.promote_types(dtype, torch.float32)
    x = x.to(compute)
    if scaling == "max":
        x.div_(255.0)
    else:
        x = _standardize_per_image(x)
    return x.to(dtype)


def _load_idx_set(
    source: Source,
    root: Optional[PathLike],
    download: bool,
    device: Device,
    dtype: torch.dtype,
    scaling: str,
) -> Dataset:
    paths = locate(source, root, download)
    arrays = {}
    for split in ("train", "t10k"):
        images_path = paths[f"{split}-images-idx3-ubyte"]
        labels_path = paths[f"{split}-labels-idx1-ubyte"]
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
            raise DataFormatError(
                f"{images_path}: expected uint8 images of shape (N, 28, 28), "
                f"got {images.dtype} {images.shape}"
            )
        _check_labels(labels, images.shape[0], 10, labels_path)
        arrays[split] = (
            _images_to_tensor(images[:, None], device, dtype, scaling),
            torch.from_numpy(labels.astype(np.int64)).to(device),
        )
    (x_train, y_train), (x_test, y_test) = arrays["train"], arrays["t10k"]
    return Dataset(source.name, x_train, y_train, x_test, y_test, "classification", 10)


def mnist(
    root: Optional[PathLike] = None,
    download: bool = True,
    *,
    device: Device = None,
    dtype: torch.dtype = torch.float32,
) -> Dataset:
    """MNIST handwritten digits: 60000 training and 10000 test images, 10 classes.

    Pixels are divided by their maximum, 255, as in the paper. Files are looked up and
    downloaded as :mod:`torch_sgn.experiments.data` describes; downloads come from the
    ``ossci-datasets`` S3 mirror (falling back to yann.lecun.com).

    Args:
        root: Data directory searched first, holding ``mnist/`` or ``MNIST/raw/``.
        download: Download when no copy is found.
        device: Device of the returned tensors.
        dtype: Floating-point dtype of the images.

    Returns:
        Images ``(N, 1, 28, 28)`` in [0, 1], labels ``(N,)`` int64.

    Raises:
        DatasetNotFoundError: No copy found and none could be downloaded.
        DataFormatError: A file is corrupt or truncated.
    """
    return _load_idx_set(SOURCES["mnist"], root, download, device, dtype, "max")


def fashion_mnist(
    root: Optional[PathLike] = None,
    download: bool = True,
    *,
    device: Device = None,
    dtype: torch.dtype = torch.float32,
) -> Dataset:
    """Fashion-MNIST (Zalando): 60000 training and 10000 test images, 10 classes.

    Each image is standardised by its own mean and (population) standard deviation, as in
    the paper. Besides the usual places (:mod:`torch_sgn.experiments.data`), the Debian package's
    ``/usr/share/datasets/fashion-mnist/`` is searched.

    Args:
        root: Data directory searched first, holding ``fashion_mnist/`` or
            ``FashionMNIST/raw/``.
        download: Download when no copy is found.
        device: Device of the returned tensors.
        dtype: Floating-point dtype of the images.

    Returns:
        Images ``(N, 1, 28, 28)``, each with mean 0 and standard deviation 1; labels
        ``(N,)`` int64.

    Raises:
        DatasetNotFoundError: No copy found and none could be downloaded.
        DataFormatError: A file is corrupt or truncated.
    """
    return _load_idx_set(SOURCES["fashion_mnist"], root, download, device, dtype, "image")


def cifar10(
    root: Optional[PathLike] = None,
    download: bool = True,
    *,
    device: Device = None,
    dtype: torch.dtype = torch.float32,
) -> Dataset:
    """CIFAR-10: 50000 training and 10000 test colour images, 32x32, 10 classes.

    Read from the python version's pickled batches (``cifar-10-batches-py/data_batch_1``
    .. ``data_batch_5`` and ``test_batch``). Each image is standardised by the mean and
    (population) standard deviation of all its 3072 values, channels together.

    Args:
        root: Data directory searched first, holding ``cifar-10-batches-py/``.
        download: Download (163 MB) when no copy is found.
        device: Device of the returned tensors.
        dtype: Floating-point dtype of the images.

    Returns:
        Images ``(N, 3, 32, 32)``, labels ``(N,)`` int64.

    Raises:
        DatasetNotFoundError: No copy found and none could be downloaded.
        DataFormatError: A file is corrupt or truncated.
    """
    source = SOURCES["cifar10"]
    paths = locate(source, root, download)
    parts = {}
    for split, names in (("train", source.files[:5]), ("test", source.files[5:])):
        batches_read = [_read_cifar_batch(paths[name]) for name in names]
        images = np.concatenate([b[0] for b in batches_read])
        labels = np.concatenate([b[1] for b in batches_read])
        parts[split] = (
            _images_to_tensor(images, device, dtype, "image"),
            torch.from_numpy(labels).to(device),
        )
    (x_train, y_train), (x_test, y_test) = parts["train"], parts["test"]
    return Dataset("cifar10", x_train, y_train, x_test, y_test, "classification", 10)
