"""Where the file-based data sets are found on disk, and their downloads (the order of the
places searched: :mod:`torch_sgn.experiments.data`). :func:`fetch` is the single point of
network access."""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

from .dataset import DataFormatError, DatasetNotFoundError, PathLike

__all__ = ["ENV_VAR", "SOURCES", "SYSTEM_DIRS", "Source", "cache_dir", "fetch", "locate"]


logger = logging.getLogger(__name__)


ENV_VAR = "TORCH_SGN_DATA"
"""Environment variable naming a directory that holds (or receives) the data sets."""


def cache_dir() -> Path:
    """The user cache directory: ``$XDG_CACHE_HOME/torch_sgn`` or ``~/.cache/torch_sgn``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_sgn"


@dataclass(frozen=True)
class Source:
    """Where a file-based data set lives on disk and on the web."""

    name: str  # this package's subdirectory, and the name in `load`
    title: str
    subdirs: tuple[str, ...]  # searched under every data root, in order
    files: tuple[str, ...]  # needed files; for IDX sets also accepted with ".gz"
    gzip_ok: bool
    mirrors: tuple[str, ...]
    resources: tuple[tuple[str, str], ...]  # downloaded (file name, MD5)


SOURCES: dict[str, Source] = {
    "mnist": Source(
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
    "fashion_mnist": Source(
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
    "cifar10": Source(
        name="cifar10",
        title="CIFAR-10",
        subdirs=("cifar-10-batches-py",),
        files=tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",),
        gzip_ok=False,
        mirrors=("https://www.cs.toronto.edu/~kriz/",),
        resources=(("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),),
    ),
}


#: System-wide copies by data set, searched after the data roots. Debian's
#: `dataset-fashion-mnist` ships the four .gz files (recompressed: their MD5s differ from the
#: canonical ones).
SYSTEM_DIRS: dict[str, tuple[Path, ...]] = {
    "fashion_mnist": (Path("/usr/share/datasets/fashion-mnist"),),
}


def _data_roots(root: Optional[PathLike]) -> list[Path]:
    roots = [Path(root).expanduser()] if root is not None else []
    if os.environ.get(ENV_VAR):
        roots.append(Path(os.environ[ENV_VAR]).expanduser())
    roots.append(cache_dir())
    return roots


def _candidate_dirs(source: Source, root: Optional[PathLike]) -> list[Path]:
    dirs = [r / s for r in _data_roots(root) for s in source.subdirs]
    dirs += SYSTEM_DIRS.get(source.name, ())
    return list(dict.fromkeys(dirs))  # drop duplicates, keep the order


def _files_in(directory: Path, source: Source) -> dict[str, Path]:
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


def fetch(url: str, dest: Path) -> None:
    """Downloads ``url`` to ``dest``: the single point of network access (a test or an offline
    set-up replaces it)."""
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
        fetch(url, tmp)
        got = _md5(tmp)
        if got != md5:
            raise DataFormatError(f"{url}: MD5 checksum mismatch: expected {md5}, got {got}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _download_any(source: Source, file: str, md5: str, dest: Path) -> None:
    """Try each mirror in turn; raise with every mirror's failure."""
    failures = []
    for mirror in source.mirrors:
        try:
            _download(mirror + file, dest, md5)
            return
        except (OSError, http.client.HTTPException, DataFormatError) as e:
            failures.append(f"{mirror + file}: {type(e).__name__}: {e}")
    raise OSError("; ".join(failures))


def _extract_cifar(archive: Path, root: Path, source: Source) -> None:
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


def _not_found(source: Source, looked: list[Path], target: Path, reason: str):
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


def locate(source: Source, root: Optional[PathLike], download: bool) -> dict[str, Path]:
    """Find the files of ``source`` in the places :mod:`torch_sgn.experiments.data` lists,
    downloading if allowed."""
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
