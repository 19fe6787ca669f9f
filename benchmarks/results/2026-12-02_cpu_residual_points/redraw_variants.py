"""The exploratory runs before ``torch_sgn.deepxde.ResidualPoints``: a DeepXDE example with SGN
and the PDE's points redrawn every P steps, uniformly (DeepXDE's ``resample_train_points``) or
by the residual (RAD, Wu et al. 2023: p ~ |r|^k / mean(|r|^k) + c, from 100,000 uniform
candidates, the residual evaluated in one pass); ResidualPoints is this callback's "rad" mode
(evaluated in chunks). Poisson_Lshape's error is also measured against the finite-difference
solution of ``poisson_lshape_reference.py`` (h = 1/400).

    cd benchmarks/results/2026-12-02_cpu_residual_points
    python redraw_variants.py MODE PERIOD BUDGET K C EXAMPLE DEEPXDE/examples
    # MODE: rad or uniform, e.g. rad 25 300 1 1 Burgers
"""

import json
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "pinns"))
sys.path.insert(0, str(HERE.parents[1]))
import deepxde as dde  # noqa: E402
import deepxde_examples as dx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

mode, period, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
k = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
c = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0
example = sys.argv[6] if len(sys.argv) > 6 else "Burgers"
examples = sys.argv[7] if len(sys.argv) > 7 else "deepxde/examples"


class Redraw(dde.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_epoch_end(self):
        self.steps += 1
        if self.steps % period:
            return
        data = self.model.data
        n = data.num_domain
        if mode == "uniform":
            data.resample_train_points(pde_points=True, bc_points=False)
            return
        x = data.geom.random_points(100_000)
        pde = self.model._rad_pde
        r = np.abs(np.asarray(self.model.predict(x, operator=pde))).reshape(len(x), -1).sum(1)
        w = r**k / np.mean(r**k) + c
        idx = np.random.choice(len(x), size=n, replace=False, p=w / w.sum())
        data.replace_with_anchors(x[idx])


original_train = dde.Model.train
original_compile = dde.Model.compile


def train(self, *a, callbacks=None, **kw):
    return original_train(self, *a, callbacks=[*(callbacks or []), Redraw()], **kw)


dde.Model.train = train

args = types.SimpleNamespace(examples=examples, budget=budget, seed=0, float32=False)


def extra(model):
    out = {"mode": mode, "period": period, "k": k, "c": c}
    if example == "Poisson_Lshape":
        sys.path.insert(0, str(HERE.parent / "2026-12-01_cpu_deepxde_examples_300s_curves"))
        import poisson_lshape_reference as ref

        fd = ref.solve(400)
        d = np.load(Path(args.examples) / "dataset" / "Poisson_Lshape.npz")
        x = d["X_test"][np.isfinite(d["y_ref"]).all(1)]
        u, y = model.predict(x)[:, 0], fd(x)
        out["rel_l2_fd"] = float(np.linalg.norm(u - y) / np.linalg.norm(y))
        # where the error lies: the share of its square within a distance of the re-entrant
        # corner (0, 0), beside the share of the points there
        r = np.linalg.norm(x, axis=1)
        e2 = (u - y) ** 2
        out["near_corner"] = {
            str(radius): {
                "points": float(np.mean(r < radius)),
                "squared_error": float(e2[r < radius].sum() / e2.sum()),
            }
            for radius in (0.05, 0.1, 0.25, 0.5)
        }
    return out


# the RAD callback needs the example's pde: read it from the model's data
def compile_(self, *a, **kw):
    self._rad_pde = self.data.pde
    return original_compile(self, *a, **kw)


dde.Model.compile = compile_
r = dx.run(example, "sgn", args, extra=extra)
out = HERE / "variants" / f"variant_{example}_{mode}_{period}_{k}_{c}_{int(budget)}.json"
out.write_text(json.dumps(r, indent=1))
print(r["iterations"], r["rel_l2"], r["curve"][-1])
