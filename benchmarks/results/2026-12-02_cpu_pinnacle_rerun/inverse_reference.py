"""Does each PINNacle inverse problem's reference solve the PDE its class trains?

The class's own ``pde`` (through DeepXDE's ``dde.grad``) evaluated at the reference ``(u, a)``
(the class's ``u_ref`` and ``a_ref``, written again in torch so that autograd differentiates
them) on 20,000 uniform points of its domain, float64; the residual's root mean square beside
the source term's, and the same with the source's ``(2x + 1)``, ``(2y + 1)`` read as
``(2x - 1)``, ``(2y - 1)`` (what ``-div(a grad u)`` of the reference gives).

    python benchmarks/results/2026-12-02_cpu_pinnacle_rerun/inverse_reference.py PINNACLE
"""

import importlib
import os
import sys

os.environ.setdefault("DDE_BACKEND", "pytorch")
root = os.path.abspath(sys.argv[1])
sys.path.append(root)
import deepxde as dde  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from poisson_inv_corrected import corrected_source  # noqa: E402

dde.config.set_default_float("float64")
os.chdir(root)
inverse = importlib.import_module("src.pde.inverse")
pi = np.pi
gen = np.random.default_rng(0)


def rms(t):
    return float(t.pow(2).mean().sqrt())


def poisson_reference(xy):
    x, y = xy[:, 0:1], xy[:, 1:2]
    u = torch.sin(pi * x) * torch.sin(pi * y)
    a = 1 / (1 + x**2 + y**2 + (x - 1) ** 2 + (y - 1) ** 2)
    return torch.cat([u, a], dim=1)


def heat_reference(xyt):
    x, y, t = xyt[:, 0:1], xyt[:, 1:2], xyt[:, 2:3]
    u = torch.exp(-t) * torch.sin(pi * x) * torch.sin(pi * y)
    a = 2 + torch.sin(pi * x) * torch.sin(pi * y)
    return torch.cat([u, a], dim=1)


def residual(pde, points, reference):
    x = torch.tensor(points, requires_grad=True)
    r = pde.pde(x, reference(x))
    dde.grad.clear()
    return r.detach()


pde = inverse.PoissonInv()
points = gen.uniform(0, 1, size=(20000, 2))
r = residual(pde, points, poisson_reference)
source = pde.f_src(torch.tensor(points))
a = poisson_reference(torch.tensor(points))[:, 1:2]
corrected = corrected_source(torch.tensor(points), a)  # -div(a grad u) of the reference
print(
    f"PoissonInv: residual of the class's PDE at the reference: rms {rms(r):.3e}, "
    f"max {float(r.abs().max()):.3e}; the source's rms {rms(source):.3e}"
)
print(
    f"PoissonInv: the class's PDE with the corrected source at the reference: rms "
    f"{rms(r - source + corrected):.3e}"
)

pde = inverse.HeatInv()
points = np.concatenate(
    [gen.uniform(-1, 1, size=(20000, 2)), gen.uniform(0, 1, size=(20000, 1))], 1
)
r = residual(pde, points, heat_reference)
source = pde.f_src(torch.tensor(points))
print(
    f"HeatInv: residual of the class's PDE at the reference: rms {rms(r):.3e}, "
    f"max {float(r.abs().max()):.3e}; the source's rms {rms(source):.3e}"
)
