import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One intra-op thread in every test process (serial, or each pytest-xdist worker): the
    tests' models are tiny, so a second thread gains nothing, and two threads in each of two
    workers, or beside other jobs on the cores, wait on each other many times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["auto", "traced", "functional"])
def each_engine(request, monkeypatch):
    """Runs a test once per curvature engine: SGN and GGN built in it default to that engine.

    ``"auto"`` is the layer-wise engine wherever it applies (every model of the shared case
    table); ``"traced"`` and ``"functional"`` run the same models through the other two, so
    the core tests hold for every engine unchanged.
    """
    from torch_sgn import GGN, SGN

    for cls in (SGN, GGN):
        monkeypatch.setattr(
            cls, "__init__", functools.partialmethod(cls.__init__, engine=request.param)
        )
    return request.param


@pytest.fixture
def cpu_graph_captures(monkeypatch):
    """Lets ``SGN(cuda_graphs=True)`` "capture" on the CPU with an eager stand-in (a replay
    calls the captured function again, over the same static buffers); returns the list of
    captures made (the number of functions in each)."""
    from torch_sgn.engines import cuda_graphs as graphs

    made = []

    def capture(fns, device):
        made.append(len(fns))
        for fn in fns:  # the warm-up run
            fn()
        return list(fns)

    monkeypatch.setitem(graphs._CAPTURE, "cpu", capture)
    return made
