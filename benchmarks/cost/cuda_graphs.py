"""What CUDA graphs would buy the layer-wise engine on the paper's models (a measurement, not a
feature).

Command (from the repository root, on a machine with CUDA)::

    PYTHONPATH=src python benchmarks/cost/cuda_graphs.py

The paper's models are small enough that a GPU spends most of a product launching kernels.
For each paper model at its batch size (random data, as ``ggn_cost.py``) this prints, in
milliseconds (medians over ``--repeats`` after warm-up, device synchronised):

* ``grad``: one plain PyTorch gradient;
* ``Gv eager`` / ``Gv graph``: one ``G v`` of the layer-wise engine, run as is, and captured once
  in a CUDA graph and replayed (input copied into the graph's static buffer first);
* ``CG eager`` / ``CG graph``: ``k`` iterations of the conjugate gradient method on
  ``G + damping I``: the library's ``conjugate_gradient`` (one host sync per iteration for its
  tests) against the same iterations written without host syncs and captured in one graph.

Each replay is checked against the eager result. The conv nets' products run autograd's
backward through the graph recorded by the step's forward pass; capturing it failed on an H200
(torch 2.11: a capture error, and wrong values on the next model), so they are not captured
and only their eager times are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line  # noqa: E402
from workloads import batch  # noqa: E402

from torch_sgn.engines.selection import select_engine  # noqa: E402
from torch_sgn.linearization import Batch  # noqa: E402
from torch_sgn.losses import resolve_loss  # noqa: E402
from torch_sgn.model.flat_model import FunctionalModel  # noqa: E402
from torch_sgn.solve.cg import conjugate_gradient  # noqa: E402

DAMPING = 1e-4


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    times = []
    for r in range(warmup + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if r >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as the CUDA graph docs ask
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _cg_without_syncs(matvec: Callable, b: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` plain CG iterations from zero, step lengths kept on the device."""
    x = torch.zeros_like(b)
    r = -b
    p = b.clone()
    rr = torch.dot(r, r)
    for _ in range(k):
        ap = matvec(p)
        alpha = rr / torch.dot(p, ap)
        x = torch.addcmul(x, alpha, p)
        r = torch.addcmul(r, alpha, ap)
        rr_next = torch.dot(r, r)
        p = torch.addcmul(-r, rr_next / rr, p)
        rr = rr_next
    return x


def measure(name: str, k: int, repeats: int) -> dict:
    device = torch.device("cuda")
    model, x, y, loss_name = batch(name, device)
    loss = resolve_loss(loss_name)
    params = [p for p in model.parameters() if p.requires_grad]
    fmodel = FunctionalModel(model)
    flat = fmodel.flat()
    engine = select_engine(fmodel, loss, "layerwise")
    lin = engine(flat, Batch(x, y))
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(flat.shape, generator=gen).to(device)
    row = {"model": name}
    row["grad"] = _median_ms(lambda: torch.autograd.grad(loss.value(model(x), y), params), repeats)
    row["Gv eager"] = _median_ms(lambda: lin.ggn_vp(v), repeats)

    def damped(u):
        return lin.ggn_vp(u) + DAMPING * u

    b = -lin.grad
    row["CG eager"] = _median_ms(lambda: conjugate_gradient(damped, b, max_iters=k), repeats)
    if not all(step.by_hand for step in engine._steps):
        row["error"] = "not captured: its products run autograd's backward"
        return row
    try:
        static_v = v.clone()
        graph, out = _capture(lambda: lin.ggn_vp(static_v))

        def replay():
            static_v.copy_(v)
            graph.replay()

        row["Gv graph"] = _median_ms(replay, repeats)
        torch.testing.assert_close(out, lin.ggn_vp(v), rtol=1e-4, atol=1e-6)
        static_b = b.clone()
        cg_graph, cg_out = _capture(lambda: _cg_without_syncs(damped, static_b, k))

        def cg_replay():
            static_b.copy_(b)
            cg_graph.replay()

        row["CG graph"] = _median_ms(cg_replay, repeats)
        torch.testing.assert_close(cg_out, _cg_without_syncs(damped, b, k), rtol=1e-3, atol=1e-6)
    except Exception as e:  # report and go on: a measurement, not a feature
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["boston", "sine", "mnist", "fashion_mnist", "cifar10"]
    )
    parser.add_argument("--k", type=int, default=10, help="CG iterations")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_graphs.py needs CUDA")
    print(
        "command: PYTHONPATH=src python "
        + " ".join(["benchmarks/cost/cuda_graphs.py", *sys.argv[1:]])
    )
    env = environment()
    print(environment_line(env))
    print(f"k={args.k}")
    cols = ["grad", "Gv eager", "Gv graph", "CG eager", "CG graph"]
    print("| model | " + " | ".join(f"{c} ms" for c in cols) + " | CG eager/graph | note |")
    print("|---|" + "---|" * (len(cols) + 2))
    for name in args.models:
        row = measure(name, args.k, args.repeats)
        cells = [f"{row[c]:.3f}" if c in row else "-" for c in cols]
        speedup = f"{row['CG eager'] / row['CG graph']:.1f}x" if "CG graph" in row else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {speedup} | {row.get('error', '')} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
