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

import dataclasses
import gzip
import hashlib
import http.client
import importlib.resources
import io
import json
import logging
import math
import os
import pickle
import shutil
import struct
import tarfile
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Literal, Optional, Union

import numpy as np
import torch
from torch import Tensor

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

logger = logging.getLogger(__name__)

ENV_VAR = "TORCH_SGN_DATA"
"""Environment variable naming a directory that holds (or receives) the data sets."""

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


# --------------------------------------------------------------------------- regression


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


# --------------------------------------------------------------------------- file formats

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


# --------------------------------------------------------------------------- file lookup


def cache_dir() -> Path:
    """The user cache directory: ``$XDG_CACHE_HOME/torch_sgn`` or ``~/.cache/torch_sgn``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_sgn"


@dataclass(frozen=True)
class _Source:
    """Where a file-based data set lives on disk and on the web."""

    name: str  # this package's subdirectory, and the name in `load`
    title: str
    subdirs: tuple[str, ...]  # searched under every data root, in order
    files: tuple[str, ...]  # needed files; for IDX sets also accepted with ".gz"
    gzip_ok: bool
    mirrors: tuple[str, ...]
    resources: tuple[tuple[str, str], ...]  # downloaded (file name, MD5)


_SOURCES: dict[str, _Source] = {
    "mnist": _Source(
        name="mnist",
        title="MNIST",
        subdirs=("mnist", "MNIST/raw"),
        files=(
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        ),
        gzip_ok=True,
        mirrors=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "http://yann.lecun.com/exdb/mnist/",
        ),
        resources=(
            ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
            ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
            ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
            ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
        ),
    ),
    "fashion_mnist": _Source(
        name="fashion_mnist",
        title="Fashion-MNIST",
        subdirs=("fashion_mnist", "FashionMNIST/raw"),
        files=(
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        ),
        gzip_ok=True,
        # An S3 website endpoint: plain HTTP only; the MD5 check guards the content.
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        resources=(
            ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
            ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
            ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
        ),
    ),
    "cifar10": _Source(
        name="cifar10",
        title="CIFAR-10",
        subdirs=("cifar-10-batches-py",),
        files=tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",),
        gzip_ok=False,
        mirrors=("https://www.cs.toronto.edu/~kriz/",),
        resources=(("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),),
    ),
}

# System-wide copies, searched after the data roots. Debian's `dataset-fashion-mnist`
# ships the four .gz files (recompressed: their MD5s differ from the canonical ones).
_SYSTEM_DIRS: dict[str, tuple[Path, ...]] = {
    "fashion_mnist": (Path("/usr/share/datasets/fashion-mnist"),),
}


def _data_roots(root: Optional[PathLike]) -> list[Path]:
    roots = [Path(root).expanduser()] if root is not None else []
    if os.environ.get(ENV_VAR):
        roots.append(Path(os.environ[ENV_VAR]).expanduser())
    roots.append(cache_dir())
    return roots


def _candidate_dirs(source: _Source, root: Optional[PathLike]) -> list[Path]:
    dirs = [r / s for r in _data_roots(root) for s in source.subdirs]
    dirs += _SYSTEM_DIRS.get(source.name, ())
    return list(dict.fromkeys(dirs))  # drop duplicates, keep the order


def _files_in(directory: Path, source: _Source) -> dict[str, Path]:
    """The needed files present in ``directory``, uncompressed preferred."""
    found = {}
    for name in source.files:
        options = [name, name + ".gz"] if source.gzip_ok else [name]
        for option in options:
            if (directory / option).is_file():
                found[name] = directory / option
                break
    return found


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(url: str, dest: Path) -> None:
    """Download ``url`` to ``dest``. The single point of network access (tests replace it)."""
    request = urllib.request.Request(url, headers={"User-Agent": "torch-sgn"})
    with urllib.request.urlopen(request, timeout=60) as response, open(dest, "wb") as f:
        shutil.copyfileobj(response, f, 1 << 20)


def _download(url: str, dest: Path, md5: str) -> None:
    """Download to a temporary file beside ``dest``, verify, then rename: all or nothing."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        logger.info("downloading %s to %s", url, dest)
        _fetch(url, tmp)
        got = _md5(tmp)
        if got != md5:
            raise DataFormatError(f"{url}: MD5 checksum mismatch: expected {md5}, got {got}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _download_any(source: _Source, file: str, md5: str, dest: Path) -> None:
    """Try each mirror in turn; raise with every mirror's failure."""
    failures = []
    for mirror in source.mirrors:
        try:
            _download(mirror + file, dest, md5)
            return
        except (OSError, http.client.HTTPException, DataFormatError) as e:
            failures.append(f"{mirror + file}: {type(e).__name__}: {e}")
    raise OSError("; ".join(failures))


def _extract_cifar(archive: Path, root: Path, source: _Source) -> None:
    """Extract the batch files of the CIFAR-10 tarball into ``root/cifar-10-batches-py``."""
    final = root / source.subdirs[0]
    final.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".cifar-10-batches-py.", dir=root))
    try:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for member in tar:
                    # Write only regular files of the expected folder: no links, no paths.
                    member_path = PurePosixPath(member.name)
                    if not member.isfile() or member_path.parent.name != source.subdirs[0]:
                        continue
                    src = tar.extractfile(member)
                    assert src is not None  # a regular file
                    with src, open(staging / member_path.name, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
            raise DataFormatError(f"{archive}: corrupt CIFAR-10 archive ({e})") from e
        missing = [f for f in source.files if not (staging / f).is_file()]
        if missing:
            raise DataFormatError(f"{archive}: archive lacks {missing}")
        for path in staging.iterdir():
            os.replace(path, final / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _not_found(source: _Source, looked: list[Path], target: Path, reason: str):
    lines = [f"{source.title} not found. Looked in:"]
    for directory in looked:
        partial = _files_in(directory, source) if directory.is_dir() else {}
        note = ""
        if partial:
            missing = [f for f in source.files if f not in partial]
            note = f"  (incomplete: missing {', '.join(missing)})"
        lines.append(f"  {directory}{note}")
    gz = " (each may also be gzipped, with a .gz suffix)" if source.gzip_ok else ""
    lines.append(f"Expected these files{gz}:")
    lines += [f"  {f}" for f in source.files]
    lines.append(
        f"Put them in {target}/, or under a directory passed as root= or named by "
        f"${ENV_VAR}, in the layouts listed above."
    )
    lines.append(reason)
    return DatasetNotFoundError("\n".join(lines))


def _locate(source: _Source, root: Optional[PathLike], download: bool) -> dict[str, Path]:
    """Find the files of ``source`` (see the module docstring), downloading if allowed."""
    looked = _candidate_dirs(source, root)
    for directory in looked:
        found = _files_in(directory, source)
        if len(found) == len(source.files):
            return found

    download_root = _data_roots(root)[0]
    target = download_root / source.subdirs[0]
    if not download:
        raise _not_found(source, looked, target, "Downloading is disabled (download=False).")
    try:
        if source.name == "cifar10":
            ((file, md5),) = source.resources
            archive = download_root / file
            _download_any(source, file, md5, archive)
            try:
                _extract_cifar(archive, download_root, source)
            finally:
                archive.unlink(missing_ok=True)
        else:
            present = _files_in(target, source)
            for file, md5 in source.resources:
                if file.removesuffix(".gz") not in present:
                    _download_any(source, file, md5, target / file)
    except (OSError, DataFormatError) as e:
        raise _not_found(source, looked, target, f"Download failed: {e}") from e
    found = _files_in(target, source)
    if len(found) != len(source.files):  # only if the canonical file set ever changes
        raise _not_found(source, looked, target, "Download did not produce all files.")
    return found


# --------------------------------------------------------------------------- images


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
    source: _Source,
    root: Optional[PathLike],
    download: bool,
    device: Device,
    dtype: torch.dtype,
    scaling: str,
) -> Dataset:
    paths = _locate(source, root, download)
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
    downloaded as the module docstring describes; downloads come from the
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
    return _load_idx_set(_SOURCES["mnist"], root, download, device, dtype, "max")


def fashion_mnist(
    root: Optional[PathLike] = None,
    download: bool = True,
    *,
    device: Device = None,
    dtype: torch.dtype = torch.float32,
) -> Dataset:
    """Fashion-MNIST (Zalando): 60000 training and 10000 test images, 10 classes.

    Each image is standardised by its own mean and (population) standard deviation, as in
    the paper. Besides the usual places (module docstring), the Debian package's
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
    return _load_idx_set(_SOURCES["fashion_mnist"], root, download, device, dtype, "image")


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
    source = _SOURCES["cifar10"]
    paths = _locate(source, root, download)
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
