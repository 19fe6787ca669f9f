"""The arithmetic of a Gauss-Newton product against a gradient's: floating-point operations of
the matrix products and convolutions, and the number of operators run, counted (not timed).

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/cost/product_flops.py
    PYTHONPATH=src python benchmarks/cost/product_flops.py --models resnet_bn transformer \\
        --out f.json

For each model of ``benchmarks/cost/ggn_cost.py`` named (default: the paper's five and the ResNet,
the transformer, the LSTM, the GRU and the TCN) it runs, on the CPU in float32, one gradient
(``backward`` of the loss), the step's set-up and one ``G v`` product of the engine that
``engine="auto"`` picks (the layer-wise engine on the paper's chains, the traced engine on the
others), under a dispatch mode that adds up

* ``flops``: the floating-point operations of every matrix product and convolution (PyTorch's
  own formulas, ``torch.utils.flop_counter``; a multiply-add counts two), in-place
  accumulations (``addmm_``, ``baddbmm_``) included;
* ``ops``: the ATen operators called (each a kernel launch on a GPU).

The gradient runs with the kernels the traced engine records (the math attention kernel,
recurrent layers without oneDNN and cuDNN: :func:`workloads.math_kernels`), so that its
attention and recurrences are counted as the matrix products they are. The counts do not depend
on the hardware or the load: they say how far a product's cost is set by its arithmetic. For a
linear or convolutional layer a gradient does three products of its size (the forward pass,
and the backward pass's two: by the weights and by the input) and ``G v`` four (the tangent's
two, ``dx W`` and ``x dW``, and the reverse pass's two), so where such layers dominate, a
product costs about 4/3 of a gradient's arithmetic; the first layer, whose input has no tangent
and needs no gradient, does two of each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
import measuring  # noqa: E402  (the record's environment)
import workloads  # noqa: E402  (the models, batches and kernel switches of the cost table)

from torch_sgn.engines.not_applicable import NotApplicable  # noqa: E402
from torch_sgn.engines.selection import select_engine  # noqa: E402
from torch_sgn.linearization import Batch  # noqa: E402
from torch_sgn.losses import resolve_loss  # noqa: E402
from torch_sgn.model.flat_model import FunctionalModel  # noqa: E402

MODELS = ["boston", "sine", "mnist", "fashion_mnist", "cifar10",
          "resnet_bn", "transformer", "lstm", "gru", "tcn"]  # fmt: skip

_aten = torch.ops.aten
#: in-place accumulations, counted by the formula of their out-of-place forms
_IN_PLACE = {_aten.addmm_: _aten.addmm, _aten.baddbmm_: _aten.baddbmm}


class _Counting(TorchDispatchMode):
    """Adds up the matrix products' and convolutions' floating-point operations and the number
    of operators called."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self.ops = 0
        self.by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        packet = func.overloadpacket
        formula = flop_registry.get(_IN_PLACE.get(packet, packet))
        if formula is not None:
            shape = lambda t: t.shape if isinstance(t, torch.Tensor) else t  # noqa: E731
            n = formula(
                *tree_map(shape, args), **tree_map(shape, kwargs), out_val=tree_map(shape, out)
            )
            self.flops += n
            self.by_op[packet.__name__] += n
        return out


def _first_applicable(chain, flat, batch):
    """``(name, engine)``: the first of the chain's layer-wise and traced engines that applies."""
    for name, engine in zip(("layer-wise", "traced"), chain.engines):
        try:
            engine(flat, batch)
        except NotApplicable:
            continue
        return name, engine
    raise SystemExit("neither the layer-wise nor the traced engine applies")


def measure(name: str) -> Dict[str, object]:
    model, x, y, loss_name = workloads.batch(name, torch.device("cpu"))
    loss = resolve_loss(loss_name)
    fmodel = FunctionalModel(model)
    if model.training:
        fmodel.freeze_rng()
    flat = fmodel.flat()
    v = torch.randn(flat.shape, generator=torch.Generator().manual_seed(1))
    used, engine = _first_applicable(select_engine(fmodel, loss, "auto"), flat, Batch(x, y))
    lin = engine(flat, Batch(x, y))  # (traces where the traced engine runs)
    lin.ggn_vp(v)

    counts = {}
    with workloads.math_kernels(recurrent=True), _Counting() as c:
        model.zero_grad(set_to_none=True)
        loss.value(model(x), y).backward()
    counts["grad"] = c
    with _Counting() as c:
        lin = engine(flat, Batch(x, y))
    counts["setup"] = c
    with _Counting() as c:
        lin.ggn_vp(v)
    counts["product"] = c
    grad = counts["grad"].flops
    return {
        "model": name,
        "engine": used,
        "grad GFLOP": grad / 1e9,
        **{f"{k} flops/grad": counts[k].flops / grad for k in ("setup", "product")},
        **{f"{k} ops": counts[k].ops for k in ("grad", "setup", "product")},
        "by op (GFLOP)": {k: {o: n / 1e9 for o, n in c.by_op.items()} for k, c in counts.items()},
    }


def _table(rows: List[Dict[str, object]]) -> str:
    head = ["model", "engine", "grad GFLOP", "setup flops/grad", "product flops/grad",
            "grad ops", "setup ops", "product ops"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r[h]:.3f}" if isinstance(r[h], float) else str(r[h]) for h in head]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    env = measuring.environment()
    print(measuring.environment_line(env))
    rows = []
    for name in args.models:
        rows.append(measure(name))
        print(f"  counted {name}", flush=True)
    print(_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "models": args.models, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
