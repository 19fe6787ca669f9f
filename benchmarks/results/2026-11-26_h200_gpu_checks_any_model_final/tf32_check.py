"""The ResNet's traced and functional products on CUDA in float32, with TF32 on and off.

Run from the repository root on a CUDA machine: ``python tf32_check.py`` (output: tf32_check.txt).
"""

import copy
import sys

sys.path[:0] = ["src", "benchmarks"]

import torch  # noqa: E402
from ggn_cost import _batch  # noqa: E402

from torch_sgn.engines import select_engine  # noqa: E402
from torch_sgn.functional import FunctionalModel  # noqa: E402
from torch_sgn.linearization import Batch  # noqa: E402
from torch_sgn.losses import resolve_loss  # noqa: E402

dev = torch.device("cuda")
for tf32 in (True, False):
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    model, x, y, loss = _batch("resnet_bn", dev)
    g = torch.Generator(device=dev).manual_seed(0)
    v = torch.randn(sum(p.numel() for p in model.parameters()), device=dev, generator=g)
    out = {}
    for engine in ("functional", "traced"):
        fm = FunctionalModel(copy.deepcopy(model))
        lin = select_engine(fm, resolve_loss(loss), engine)(fm.flat(), Batch(x, y))
        out[engine] = lin.ggn_vp(v)
    diff = float((out["functional"] - out["traced"]).norm() / out["functional"].norm())
    print(
        f"resnet_bn float32 allow_tf32={tf32}: traced vs functional relative difference {diff:.2e}"
    )
