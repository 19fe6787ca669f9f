import gzip
import hashlib
import io
import json
import os
import pickle
import struct
import tarfile
import urllib.error
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_sgn.experiments import data
from torch_sgn.experiments.data import (
    DataFormatError,
    DatasetNotFoundError,
    batches,
    boston,
    cifar10,
    fashion_mnist,
    load,
    mnist,
    read_idx,
    sine,
)
from torch_sgn.experiments.data import files as data_files
from torch_sgn.experiments.data import images as data_images
from torch_sgn.experiments.models import PRESETS

IDX_FILES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]
REAL_FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test sees the user's data, the system copies or the network."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    monkeypatch.setattr(data_files, "SYSTEM_DIRS", {})

    def no_network(url, dest):
        raise AssertionError(f"test tried to download {url}")

    monkeypatch.setattr(data_files, "fetch", no_network)


# --------------------------------------------------------------------------- writers
# Written from the format specifications, independently of the code under test.


def idx_bytes(array: np.ndarray) -> bytes:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C, np.dtype(np.float64): 0x0E}
    header = bytes([0, 0, codes[array.dtype], array.ndim])
    header += struct.pack(">" + "I" * array.ndim, *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path: Path, content: bytes, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        content = gzip.compress(content)
    path.write_bytes(content)
    return path


def make_idx_set(directory: Path, n_train=7, n_test=3, gz=False, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, array in arrays.items():
        write(directory / name, idx_bytes(array), gz=gz)
    return arrays


def make_cifar_batches(directory: Path, per_batch=4, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    batches_ = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        content = {
            b"batch_label": name.encode(),
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, per_batch)],
        }
        batches_[name] = content
        write(directory / name, pickle.dumps(content, protocol=2))
    return batches_


def assert_standardized(x: torch.Tensor):
    flat = x.flatten(1).double()
    n = len(flat)
    assert torch.allclose(flat.mean(1), torch.zeros(n, dtype=flat.dtype), atol=1e-5)
    assert torch.allclose(flat.std(1, correction=0), torch.ones(n, dtype=flat.dtype), atol=1e-5)


# --------------------------------------------------------------------------- Boston


def test_boston_split_sizes_and_max_scaling():
    ds = boston()
    assert (ds.n_train, ds.n_test) == (404, 102)
    assert ds.x_train.shape == (404, 13) and ds.y_train.shape == (404, 1)
    assert ds.x_test.shape == (102, 13) and ds.y_test.shape == (102, 1)
    assert ds.task == "regression" and ds.num_classes is None
    for array in (ds.x_train, ds.y_train, ds.x_test, ds.y_test):
        assert array.dtype == torch.float32
        assert array.max() == 1.0 and array.min() >= 0.0


def test_boston_matches_the_keras_split():
    # Keras' boston_housing.load_data() documents these as its first training examples
    # (e.g. F. Chollet, Deep Learning with Python, section 3.6).
    ds = boston(dtype=torch.float64)
    first_row = [1.23247, 0.0, 8.14, 0.0, 0.538, 6.142, 91.7, 3.9769, 4.0, 307.0, 21.0, 396.9]
    first_row += [18.72]
    targets = [15.2, 42.3, 50.0, 21.1, 17.7, 18.5, 11.3, 15.6, 15.6, 14.4]
    # The maxima of both arrays: TAX 711 and MEDV 50.
    torch.testing.assert_close(ds.x_train[0] * 711, torch.tensor(first_row, dtype=torch.float64))
    torch.testing.assert_close(ds.y_train[:10, 0] * 50, torch.tensor(targets, dtype=torch.float64))
    rows = torch.cat([ds.x_train, ds.x_test])
    assert len(torch.unique(rows, dim=0)) == 506  # a partition: no row in both


# --------------------------------------------------------------------------- sine


def test_sine_generation():
    state = torch.get_rng_state()
    ds = sine(n=10000, noise=0.01, frequency=10.0, seed=3, dtype=torch.float64)
    assert torch.equal(torch.get_rng_state(), state)
    assert (ds.n_train, ds.n_test) == (7000, 3000)
    assert ds.x_train.shape == (7000, 1) and ds.y_test.shape == (3000, 1)
    x = torch.cat([ds.x_train, ds.x_test])
    assert x.min() >= -1 and x.max() <= 1
    assert abs(x.mean().item()) < 0.05 and abs(x.var().item() - 1 / 3) < 0.02
    residual = torch.cat(
        [ds.y_train - torch.sin(10 * ds.x_train), ds.y_test - torch.sin(10 * ds.x_test)]
    )
    assert abs(residual.std().item() - 0.01) < 0.0005


def test_sine_is_seeded():
    a, b, c = sine(n=500, seed=1), sine(n=500, seed=1), sine(n=500, seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert (a.n_train, a.n_test) == (350, 150)


def test_sine_original_file():
    ds = sine(original=True, dtype=torch.float64)
    assert (ds.n_train, ds.n_test) == (7000, 3000)
    assert ds.x_train.shape == (7000, 1) and ds.y_train.shape == (7000, 1)
    # The file is what its name says: sin(10 x) plus noise of standard deviation 0.01.
    residual = ds.y_train - torch.sin(10 * ds.x_train)
    assert abs(residual.std().item() - 0.01) < 0.001
    assert ds.x_train[0, 0].item() == 0.386863601830985  # the file's first value, exactly


def test_sine_from_path(tmp_path):
    content = {"X_train": [[0.1], [0.2]], "y_train": [1.0, 2.0], "X_test": [[0.3]], "y_test": [3.0]}
    path = tmp_path / "sine.json"
    path.write_text(json.dumps(content))
    ds = sine(path=path, dtype=torch.float64)
    assert ds.x_train.tolist() == [[0.1], [0.2]] and ds.y_test.tolist() == [[3.0]]
    with pytest.raises(ValueError, match="not both"):
        sine(path=path, original=True)
    path.write_text(json.dumps({"X_train": [[0.1]]}))
    with pytest.raises(DataFormatError, match="sine.json"):
        sine(path=path)


# --------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([-5, 70000, 2**31 - 1], dtype=np.int32),
        np.linspace(-1, 1, 6).reshape(3, 2),
    ],
    ids=["uint8", "int32", "float64"],
)
def test_read_idx_roundtrip(tmp_path, gz, array):
    path = write(tmp_path / "a-idx", idx_bytes(array), gz=gz)
    out = read_idx(path)
    assert out.dtype == array.dtype.newbyteorder("=") and np.array_equal(out, array)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_corrupt_magic(tmp_path, gz):
    content = bytearray(idx_bytes(np.zeros((2, 2), np.uint8)))
    content[0] = 0x42
    path = write(tmp_path / "bad", bytes(content), gz=gz)
    with pytest.raises(DataFormatError, match="magic number") as info:
        read_idx(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "cut, message",
    [(3, "less than the 4-byte magic"), (9, "truncated IDX header"), (-1, "truncated IDX file")],
)
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_truncated(tmp_path, cut, message, gz):
    content = idx_bytes(np.zeros((3, 4), np.uint8))[:cut]
    path = write(tmp_path / "short", content, gz=gz)
    with pytest.raises(DataFormatError, match=message) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_read_idx_trailing_bytes_and_truncated_gzip(tmp_path):
    path = write(tmp_path / "long", idx_bytes(np.zeros(4, np.uint8)) + b"\0")
    with pytest.raises(DataFormatError, match="trailing"):
        read_idx(path)
    gz = gzip.compress(idx_bytes(np.zeros((50, 50), np.uint8)))
    path = write(tmp_path / "cut.gz", gz[: len(gz) // 2])
    with pytest.raises(DataFormatError, match="gzip") as info:
        read_idx(path)
    assert "cut.gz" in str(info.value)


# --------------------------------------------------------------------------- MNIST formats


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_loader(tmp_path, gz):
    arrays = make_idx_set(tmp_path / "mnist", gz=gz)
    ds = mnist(root=tmp_path, download=False)
    assert ds.x_train.shape == (7, 1, 28, 28) and ds.x_test.shape == (3, 1, 28, 28)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert (ds.task, ds.num_classes, ds.name) == ("classification", 10, "mnist")
    expected = torch.from_numpy(arrays["train-images-idx3-ubyte"]).float()[:, None] / 255
    torch.testing.assert_close(ds.x_train, expected)
    assert ds.y_test.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_fashion_mnist_loader_standardizes_each_image(tmp_path):
    arrays = make_idx_set(tmp_path / "fashion_mnist", gz=True)
    ds = fashion_mnist(root=tmp_path, download=False, dtype=torch.float64)
    assert ds.x_train.shape == (7, 1, 28, 28) and ds.x_train.dtype == torch.float64
    assert_standardized(ds.x_train)
    assert_standardized(ds.x_test)
    raw = torch.from_numpy(arrays["t10k-images-idx3-ubyte"]).double()[:, None]
    expected = (raw - raw.mean((1, 2, 3), keepdim=True)) / raw.std(
        (1, 2, 3), keepdim=True, correction=0
    )
    torch.testing.assert_close(ds.x_test, expected)


def test_constant_image_standardizes_to_zero(tmp_path):
    arrays = make_idx_set(tmp_path / "fashion_mnist")
    arrays["t10k-images-idx3-ubyte"][0] = 7
    write(
        tmp_path / "fashion_mnist" / "t10k-images-idx3-ubyte",
        idx_bytes(arrays["t10k-images-idx3-ubyte"]),
    )
    ds = fashion_mnist(root=tmp_path, download=False)
    assert torch.count_nonzero(ds.x_test[0]) == 0


def test_mnist_loader_rejects_wrong_shapes_and_labels(tmp_path):
    arrays = make_idx_set(tmp_path / "mnist")
    write(tmp_path / "mnist" / "t10k-labels-idx1-ubyte", idx_bytes(np.arange(4, dtype=np.uint8)))
    with pytest.raises(DataFormatError, match="expected 3 labels"):
        mnist(root=tmp_path, download=False)
    write(tmp_path / "mnist" / "t10k-labels-idx1-ubyte", idx_bytes(np.array([0, 1, 10], np.uint8)))
    with pytest.raises(DataFormatError, match=r"\[0, 10\)"):
        mnist(root=tmp_path, download=False)
    images = arrays["train-images-idx3-ubyte"].reshape(7, 14, 56)
    write(tmp_path / "mnist" / "train-images-idx3-ubyte", idx_bytes(images))
    with pytest.raises(DataFormatError, match="train-images-idx3-ubyte: expected uint8 images"):
        mnist(root=tmp_path, download=False)


# --------------------------------------------------------------------------- CIFAR-10


def test_cifar10_loader(tmp_path):
    content = make_cifar_batches(tmp_path / "cifar-10-batches-py")
    ds = cifar10(root=tmp_path, download=False, dtype=torch.float64)
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert ds.y_train.dtype == torch.int64 and ds.num_classes == 10
    assert_standardized(ds.x_train)
    # Row layout: 1024 red values, then green, then blue, each row-major.
    row = content["data_batch_2"][b"data"][1].astype(np.float64)
    image = (row - row.mean()) / row.std()
    c, h, w = 2, 5, 17
    assert ds.x_train[4 + 1, c, h, w].item() == pytest.approx(image[c * 1024 + h * 32 + w])
    assert ds.y_test.tolist() == content["test_batch"][b"labels"]


def test_cifar10_reads_pickles_of_numpy_before_2(tmp_path):
    # The real batches were pickled with numpy 1.x, which named numpy.core, not numpy._core.
    content = make_cifar_batches(tmp_path / "cifar-10-batches-py")
    for path in (tmp_path / "cifar-10-batches-py").iterdir():
        old = path.read_bytes().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"numpy.core.multiarray" in old
        path.write_bytes(old)
    ds = cifar10(root=tmp_path, download=False)
    assert ds.y_train[:4].tolist() == content["data_batch_1"][b"labels"]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) // 2], "corrupt or truncated CIFAR-10 batch"),
        (lambda b: b"garbage" + b, "corrupt or truncated CIFAR-10 batch"),
        (lambda b: pickle.dumps({b"labels": [1]}), "lacks the keys \\['data'\\]"),
        (
            lambda b: pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [1, 2]}),
            "3072",
        ),
        (lambda b: pickle.dumps([1, 2]), "expected a pickled dict"),
    ],
    ids=["truncated", "corrupt", "missing key", "bad shape", "not a dict"],
)
def test_cifar10_corrupt_batch(tmp_path, damage, message):
    make_cifar_batches(tmp_path / "cifar-10-batches-py")
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataFormatError, match=message) as info:
        cifar10(root=tmp_path, download=False)
    assert str(path) in str(info.value)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar10_refuses_pickles_that_run_code(tmp_path):
    make_cifar_batches(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(
        pickle.dumps({b"data": _Exploit()})
    )
    with pytest.raises(DataFormatError, match="refusing to load"):
        cifar10(root=tmp_path, download=False)


def test_cifar10_missing_batch(tmp_path):
    make_cifar_batches(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        cifar10(root=tmp_path, download=False)
    message = str(info.value)
    assert "incomplete: missing data_batch_3" in message
    assert str(tmp_path / "cifar-10-batches-py") in message


# --------------------------------------------------------------------------- lookup


def test_lookup_order_root_then_env_then_cache(tmp_path, monkeypatch):
    # Each place holds a different copy, told apart by its first label.
    places = {
        "root": tmp_path / "r",
        "env": tmp_path / "e",
        "cache": tmp_path / "xdg" / "torch_sgn",
    }
    firsts = {}
    for i, (key, place) in enumerate(places.items()):
        firsts[key] = int(make_idx_set(place / "mnist", seed=i)["train-labels-idx1-ubyte"][0])
    assert len(set(firsts.values())) == 3
    monkeypatch.setenv(data.ENV_VAR, str(places["env"]))
    assert mnist(root=places["root"], download=False).y_train[0] == firsts["root"]
    assert mnist(download=False).y_train[0] == firsts["env"]
    monkeypatch.delenv(data.ENV_VAR)
    assert mnist(download=False).y_train[0] == firsts["cache"]


def test_torchvision_layout_is_found(tmp_path):
    make_idx_set(tmp_path / "MNIST" / "raw", gz=True)
    make_idx_set(tmp_path / "FashionMNIST" / "raw")
    make_cifar_batches(tmp_path / "cifar-10-batches-py")
    assert mnist(root=tmp_path, download=False).n_train == 7
    assert fashion_mnist(root=tmp_path, download=False).n_train == 7
    assert cifar10(root=tmp_path, download=False).n_train == 20


def test_mnist_and_fashion_mnist_do_not_mix(tmp_path):
    make_idx_set(tmp_path / "mnist")
    with pytest.raises(DatasetNotFoundError, match="Fashion-MNIST not found"):
        fashion_mnist(root=tmp_path, download=False)


def test_system_dir_is_searched_last(tmp_path, monkeypatch):
    system = tmp_path / "usr-share"
    make_idx_set(system, n_train=5, gz=True)
    monkeypatch.setitem(data_files.SYSTEM_DIRS, "fashion_mnist", (system,))
    assert fashion_mnist(download=False).n_train == 5
    make_idx_set(tmp_path / "xdg" / "torch_sgn" / "fashion_mnist", n_train=6)
    assert fashion_mnist(download=False).n_train == 6


def test_not_found_message_lists_places_and_files(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        mnist(root=tmp_path / "mine", download=False)
    message = str(info.value)
    for place in [
        tmp_path / "mine" / "mnist",
        tmp_path / "mine" / "MNIST" / "raw",
        tmp_path / "xdg" / "torch_sgn" / "mnist",
    ]:
        assert str(place) in message
    for name in IDX_FILES:
        assert name in message
    assert "download=False" in message
    assert isinstance(info.value, FileNotFoundError)


# --------------------------------------------------------------------------- download


@pytest.fixture
def fake_mnist_server(tmp_path, monkeypatch):
    """Serve generated MNIST .gz files; the MD5 table lists their checksums."""
    served, md5s = {}, []
    rng = np.random.default_rng(5)
    shapes = {"images": (4, 28, 28), "labels": (4,)}
    for name in IDX_FILES:
        array = rng.integers(0, 10, shapes[name.split("-")[1]], dtype=np.uint8)
        content = gzip.compress(idx_bytes(array))
        served[name + ".gz"] = content
        md5s.append((name + ".gz", hashlib.md5(content).hexdigest()))
    source = replace(
        data_files.SOURCES["mnist"],
        mirrors=("https://a.example/", "https://b.example/"),
        resources=tuple(md5s),
    )
    monkeypatch.setitem(data_files.SOURCES, "mnist", source)
    calls = []

    def fetch(url, dest):
        calls.append(url)
        if url.startswith("https://a.example/"):
            raise urllib.error.URLError("mirror a is down")
        Path(dest).write_bytes(served[url.rsplit("/", 1)[1]])

    monkeypatch.setattr(data_files, "fetch", fetch)
    return served, calls


def test_download_lands_in_cache(tmp_path, fake_mnist_server):
    served, calls = fake_mnist_server
    ds = mnist()
    target = tmp_path / "xdg" / "torch_sgn" / "mnist"
    assert sorted(p.name for p in target.iterdir()) == sorted(served)
    assert ds.n_train == 4
    assert len(calls) == 8  # every file: mirror a fails, mirror b serves
    calls.clear()
    mnist()  # found now: no download
    assert calls == []


def test_download_goes_to_explicit_root(tmp_path, fake_mnist_server):
    mnist(root=tmp_path / "mine")
    assert len(list((tmp_path / "mine" / "mnist").glob("*.gz"))) == 4
    assert not (tmp_path / "xdg").exists()


def test_download_checksum_mismatch_leaves_nothing(tmp_path, monkeypatch, fake_mnist_server):
    source = data_files.SOURCES["mnist"]
    bad = ((source.resources[0][0], "0" * 32),) + source.resources[1:]
    monkeypatch.setitem(data_files.SOURCES, "mnist", replace(source, resources=bad))
    with pytest.raises(DatasetNotFoundError, match="MD5 checksum mismatch"):
        mnist()
    target = tmp_path / "xdg" / "torch_sgn" / "mnist"
    assert list(target.iterdir()) == []  # no partial file, no temporary file


def test_offline_error_lists_expected_files(tmp_path, monkeypatch):
    def offline(url, dest):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(data_files, "fetch", offline)
    with pytest.raises(DatasetNotFoundError) as info:
        fashion_mnist()
    message = str(info.value)
    assert "Download failed" in message and "Name or service not known" in message
    for name in IDX_FILES:
        assert name in message
    assert str(tmp_path / "xdg" / "torch_sgn" / "fashion_mnist") in message
    assert list((tmp_path / "xdg" / "torch_sgn" / "fashion_mnist").iterdir()) == []


def test_cifar10_download_extracts_only_the_batches(tmp_path, monkeypatch):
    content = make_cifar_batches(tmp_path / "src" / "cifar-10-batches-py", per_batch=2)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in content:
            tar.add(tmp_path / "src" / "cifar-10-batches-py" / name, f"cifar-10-batches-py/{name}")
        evil = tarfile.TarInfo("cifar-10-batches-py/../../escaped")
        evil.size = 3
        tar.addfile(evil, io.BytesIO(b"bad"))
        link = tarfile.TarInfo("cifar-10-batches-py/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    archive = buffer.getvalue()
    source = data_files.SOURCES["cifar10"]
    monkeypatch.setitem(
        data_files.SOURCES,
        "cifar10",
        replace(source, resources=(("cifar-10-python.tar.gz", hashlib.md5(archive).hexdigest()),)),
    )
    monkeypatch.setattr(data_files, "fetch", lambda url, dest: Path(dest).write_bytes(archive))
    ds = cifar10()
    cache = tmp_path / "xdg" / "torch_sgn"
    assert sorted(p.name for p in cache.iterdir()) == ["cifar-10-batches-py"]  # tarball gone
    assert sorted(p.name for p in (cache / "cifar-10-batches-py").iterdir()) == sorted(content)
    assert not (tmp_path / "xdg" / "escaped").exists()
    assert ds.n_train == 10 and ds.n_test == 2


@pytest.mark.skipif(not REAL_FASHION.is_dir(), reason="Debian dataset-fashion-mnist absent")
def test_real_fashion_mnist_from_the_debian_package(monkeypatch):
    monkeypatch.setitem(data_files.SYSTEM_DIRS, "fashion_mnist", (REAL_FASHION,))
    ds = fashion_mnist(download=False)  # about 1.5 s
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    # The well-known first training labels (ankle boot, T-shirt, ...); a balanced test set.
    assert ds.y_train[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert torch.bincount(ds.y_test).tolist() == [1000] * 10
    assert_standardized(ds.x_train[:500])
    assert_standardized(ds.x_test[-500:])


# --------------------------------------------------------------------------- batches


def test_batches_cover_an_epoch_without_duplicates():
    x = torch.arange(404.0)[:, None]
    y = 2 * x
    gen = torch.Generator().manual_seed(0)
    epoch = list(batches(x, y, 101, gen))
    assert len(epoch) == 4
    seen = torch.cat([xb[:, 0] for xb, _ in epoch])
    assert len(torch.unique(seen)) == 404
    for xb, yb in epoch:
        assert xb.shape == (101, 1) and torch.equal(yb, 2 * xb)


def test_batches_drop_the_remainder_and_are_seeded():
    x = torch.arange(1050.0)
    y = torch.arange(1050)
    first = [xb for xb, _ in batches(x, y, 100, torch.Generator().manual_seed(7))]
    again = [xb for xb, _ in batches(x, y, 100, torch.Generator().manual_seed(7))]
    assert len(first) == 10 and all(len(b) == 100 for b in first)
    assert len(torch.unique(torch.cat(first))) == 1000
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    gen = torch.Generator().manual_seed(7)
    epoch1 = torch.cat([xb for xb, _ in batches(x, y, 100, gen)])
    epoch2 = torch.cat([xb for xb, _ in batches(x, y, 100, gen)])
    assert not torch.equal(epoch1, epoch2)  # each epoch a fresh permutation


def test_batches_validate_arguments():
    x, y = torch.zeros(10, 2), torch.zeros(10)
    with pytest.raises(ValueError, match="between 1 and"):
        batches(x, y, 11)
    with pytest.raises(ValueError, match="y has 9"):
        batches(x, y[:9], 2)


def test_dataset_batches_and_paper_iterations_per_epoch():
    ds = boston()
    assert len(list(ds.batches(PRESETS["boston"].batch_size, torch.Generator()))) == 4


# --------------------------------------------------------------------------- dispatch


def test_dataset_to_casts_floats_only(tmp_path):
    make_idx_set(tmp_path / "mnist")
    ds = mnist(root=tmp_path, download=False).to(dtype=torch.float64)
    assert ds.x_train.dtype == torch.float64 and ds.y_train.dtype == torch.int64


def test_load_dispatches_by_preset_name():
    assert set(data._LOADERS) == set(PRESETS)
    assert torch.equal(load("boston").x_test, boston().x_test)
    assert torch.equal(load("sine", n=100, seed=4).y_train, sine(n=100, seed=4).y_train)
    with pytest.raises(ValueError, match="fashion_mnist"):
        load("fashion")


def test_float64_results_are_not_rounded_through_float32():
    ds = sine(n=10, dtype=torch.float64)
    assert ds.x_train.dtype == torch.float64
    assert not torch.equal(ds.x_train, ds.x_train.float().double())


def test_stds_are_population_stds():
    # A two-pixel image [0, 2] has population std 1: standardised to [-1, 1].
    x = data_images._standardize_per_image(torch.tensor([[[0.0, 2.0]]]))
    assert x.tolist() == [[[-1.0, 1.0]]]
