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


ENGINES = ("auto", "traced", "functional")


def _with_engine(cls: type, engine: str) -> type:
    """``cls`` (SGN or GGN) whose ``engine`` defaults to ``engine``: a subclass named at this
    module's top level, so that its instances pickle. Its ``__init__`` is a partial method (no
    frame of its own), so a warning still names the test's line."""
    __init__ = functools.partialmethod(cls.__init__, engine=engine)
    name = f"{cls.__name__}_{engine}"
    made = type(name, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})
    globals()[name] = made
    return made


def _engine_classes() -> dict:
    from torch_sgn import GGN, SGN

    return {(cls, e): _with_engine(cls, e) for cls in (SGN, GGN) for e in ENGINES}


ENGINE_CLASSES = _engine_classes()


@pytest.fixture(params=ENGINES)
def each_engine(request, monkeypatch):
    """Runs a test once per curvature engine: SGN and GGN, as the test's module names them,
    default to that engine (subclasses whose ``engine`` defaults to it; the library itself is
    not patched).

    ``"auto"`` is the layer-wise engine wherever it applies (every model of the shared case
    table); ``"traced"`` and ``"functional"`` run the same models through the other two, so
    the core tests hold for every engine unchanged.
    """
    for (cls, engine), made in ENGINE_CLASSES.items():
        if engine == request.param and getattr(request.module, cls.__name__, None) is cls:
            monkeypatch.setattr(request.module, cls.__name__, made)
    return request.param


#: test: which of its traced-engine cases (``each_engine``, by their parameters) run with the
#: slow tests, because other cases already do their work on that engine
TRACED_CASES_ALSO_SLOW = {
    # momentum changes how the step is assembled, not the engine's products: the traced
    # engine's cases without it solve the same systems through the same products
    "test_direct_step_solves_the_damped_system_for_every_loss": lambda p: p["momentum"] != 0,
    # its products equal the dense J^T H J (test_ggn_matches_dense_jacobian_reference's
    # traced cases), which is symmetric positive semi-definite for these convex losses
    "test_ggn_is_symmetric_positive_semidefinite": lambda p: True,
}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks
def pytest_collection_modifyitems(items):
    for item in items:
        rule = TRACED_CASES_ALSO_SLOW.get(getattr(item, "originalname", ""))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if rule is not None and params.get("each_engine") == "traced" and rule(params):
            item.add_marker(pytest.mark.slow)


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

    monkeypatch.setitem(graphs.CAPTURE, "cpu", capture)
    return made


@pytest.fixture
def dde_float64():
    """DeepXDE in float64, seeded; torch's default dtype and NumPy's and Python's random states
    as they were, after the test (the DeepXDE tests' modules use it for every test)."""
    import random

    import deepxde as dde
    import numpy as np

    dtype, np_state, py_state = torch.get_default_dtype(), np.random.get_state(), random.getstate()
    dde.config.set_default_float("float64")
    dde.config.set_random_seed(0)
    yield
    dde.config.set_default_float(str(dtype).replace("torch.", ""))
    np.random.set_state(np_state)
    random.setstate(py_state)
