"""Peak resident memory of one SGN step, a cross-check of ``ggn_cost.py``'s profiler numbers.

Command (from the repository root; one fresh process per engine)::

    PYTHONPATH=src python benchmarks/cost/step_rss.py fashion_mnist functional
    PYTHONPATH=src python benchmarks/cost/step_rss.py fashion_mnist fast

Prints the process's resident memory before the step and its peak (``ru_maxrss``) before and
after one ``SGN.step`` with 10 CG iterations (line search off), after one plain gradient, so
the "before" peak already holds the gradient's. Linux only (``/proc/self/statm``).
"""

import resource
import sys
from pathlib import Path

import torch

from torch_sgn import SGN
from torch_sgn.experiments.models import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402


def main() -> None:
    name, engine = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    env = environment()
    print(environment_line(env))
    p = PRESETS[name]
    model = p.build()
    x = torch.randn(p.batch_size, *p.input_shape)
    with torch.no_grad():
        out = model(x)
    y = torch.randn(out.shape) if p.loss == "mse" else torch.randint(0, 10, (p.batch_size,))
    opt = SGN(
        model,
        p.loss,
        cg_iters=10,
        cg_tol=0.0,
        line_search=False,
        engine=engine,
        solver="cg",
    )
    loss = opt._loss.value(model(x), y)
    torch.autograd.grad(loss, list(model.parameters()))

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    rss = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
    before = peak()
    opt.step(x, y)
    print(
        f"{name} {engine}: resident {rss:.0f} MiB, peak {before:.0f} MiB after a gradient, "
        f"{peak():.0f} MiB after a step"
    )


if __name__ == "__main__":
    main()
