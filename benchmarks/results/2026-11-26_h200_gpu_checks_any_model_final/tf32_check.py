import sys, copy
sys.path.insert(0, "src"); sys.path.insert(0, "benchmarks")
import torch
from ggn_cost import _batch
from torch_sgn.engines import select_engine
from torch_sgn.functional import FunctionalModel
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
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
    print(f"resnet_bn float32 allow_tf32={tf32}: traced vs functional relative difference "
          f"{float((out['functional'] - out['traced']).norm() / out['functional'].norm()):.2e}", flush=True)
