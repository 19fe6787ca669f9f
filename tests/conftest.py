import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["auto", "functional"])
def each_engine(request, monkeypatch):
    """Runs a test once per curvature engine: SGN and GGN built in it default to that engine.

    ``"auto"`` is the fast layer-wise engine wherever it applies (every model of the shared
    case table), so the core tests hold for both engines unchanged.
    """
    from torch_sgn import GGN, SGN

    for cls in (SGN, GGN):
        monkeypatch.setattr(
            cls, "__init__", functools.partialmethod(cls.__init__, engine=request.param)
        )
    return request.param
