"""Cost of the routes around operators without a forward-mode rule, in gradients.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/cost/fallback_cost.py --threads 1
    PYTHONPATH=src python benchmarks/cost/fallback_cost.py --threads 1 --out record.json

The functional engine takes ``J v`` by forward-mode AD. Where an operator has none
(:mod:`torch_sgn.model.forward_mode`), it either switches the model to kernels that have one, or
takes ``J v`` by double backward. This measures both routes, float32 on the CPU, on

* ``transformer``: a causal pre-norm transformer (``nn.TransformerEncoderLayer``, 2 layers,
  width 64, 4 heads, sequence 32, batch 16, 64 tokens, cross-entropy per position), whose
  fused attention kernel has no forward-mode rule (switch: the math attention kernel; the
  double-backward route needs it too, the fused kernel's backward is not differentiable);
* ``lstm``: ``nn.LSTM`` (16 -> 64, sequence 32, batch 16, 10 classes from the last step),
  whose oneDNN kernel has no forward-mode rule (switch: oneDNN off; double backward works
  through oneDNN's kernel);
* ``gru``: ``nn.GRU`` of the same shape, whose kernels all have forward-mode rules: forward
  mode against double backward where both work;
* ``huber``: the LSTM with ``nn.HuberLoss`` (whose backward has no forward-mode rule; the
  output-space Hessian is taken by reverse-over-reverse) against ``nn.SmoothL1Loss`` (which has
  one: forward-over-reverse) and the closed-form ``"mse"``.

For each it prints, as medians over ``--repeats`` interleaved rounds after ``--warmup``:

* ``grad``: one plain gradient of the model with its default kernels, the unit;
* ``grad*``: the same under the route's kernel switches (every forward pass of the model runs
  with them once they are on);
* ``lin``: the engine's set-up of a step (loss, gradient, what the products reuse);
* ``Gv``: one ``G v`` product;
* ``CG it``: ``(Gv + max(lin - grad, 0) / 2) / grad``, one CG iteration at k = 2 with the set-up
  beyond a gradient spread over the step (as in ``ggn_cost.py``).

``lin`` and ``Gv`` are printed in milliseconds too: oneDNN's LSTM gradient, the unit of the
``lstm`` rows, varies several-fold with what ran before it (the allocator's state), while the
routes' own times compare directly.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch import nn

from torch_sgn.engines.functional import FunctionalEngine
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel
from torch_sgn.model.forward_mode import kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment  # noqa: E402


@dataclass
class Config:
    repeats: int = 15
    warmup: int = 3
    threads: int = 0  # 0: torch's default
    seed: int = 0
    out: str = ""


class Transformer(nn.Module):
    def __init__(self, vocab=64, width=64, heads=4, layers=2, length=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, tokens):
        h = self.embed(tokens) + self.position
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        return self.head(h).transpose(1, 2)  # (N, vocab, L) for cross-entropy per position


class RNN(nn.Module):
    def __init__(self, cell=nn.LSTM, features=16, hidden=64, classes=10):
        super().__init__()
        self.rnn = cell(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _cases(seed: int) -> List[dict]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tokens = torch.randint(0, 64, (16, 32), generator=g)
    x = torch.randn(16, 32, 16, generator=g)
    classes = torch.randint(0, 10, (16,), generator=g)
    real = torch.randn(16, 10, generator=g)
    lstm = RNN()
    return [
        dict(name="transformer", model=Transformer(), loss="cross_entropy",
             batch=Batch(tokens, torch.randint(0, 64, (16, 32), generator=g)),
             routes={"switch": ({"math_attention"}, False),
                     "double backward": ({"math_attention"}, True)}),
        dict(name="lstm", model=lstm, loss="cross_entropy", batch=Batch(x, classes),
             routes={"switch": ({"no_onednn"}, False), "double backward": (set(), True)}),
        dict(name="gru", model=RNN(nn.GRU), loss="cross_entropy", batch=Batch(x, classes),
             routes={"forward mode": (set(), False), "double backward": (set(), True)}),
        dict(name="huber", model=lstm, loss=nn.HuberLoss(), batch=Batch(x, real),
             routes={"rev-rev loss": ({"no_onednn"}, False)}),
        dict(name="smooth_l1", model=lstm, loss=nn.SmoothL1Loss(), batch=Batch(x, real),
             routes={"fwd-rev loss": ({"no_onednn"}, False)}),
        dict(name="mse", model=lstm, loss="mse", batch=Batch(x, real),
             routes={"closed form": ({"no_onednn"}, False)}),
    ]  # fmt: skip


def _timer(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def measure(case: dict, cfg: Config) -> Dict[str, Dict[str, float]]:
    model, batch = case["model"], case["batch"]
    loss = resolve_loss(case["loss"])
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(switches=frozenset()):
        with kernels(frozenset(switches)):
            value = loss.value(model(*batch.args), batch.targets)
            return torch.autograd.grad(value, params)

    timers: Dict[str, Callable[[], float]] = {"grad": _timer(gradient)}
    for route, (switches, double) in case["routes"].items():
        fmodel = FunctionalModel(model)
        fmodel.switches = frozenset(switches)
        engine = FunctionalEngine(fmodel, loss)
        engine.double_backward = double
        if "rev-rev" in route:  # skips the first, failing forward-mode try
            loss.reverse_over_reverse = True
        flat = fmodel.flat()
        v = torch.randn_like(flat)
        lin = engine(flat, batch)
        lin.ggn_vp(v)  # must not need another route
        timers[f"{route}: grad*"] = _timer(lambda s=switches: gradient(s))
        timers[f"{route}: lin"] = _timer(lambda e=engine, f=flat: e(f, batch))
        timers[f"{route}: Gv"] = _timer(lambda lin=lin, v=v: lin.ggn_vp(v))
    samples: Dict[str, List[float]] = {k: [] for k in timers}
    for r in range(cfg.warmup + cfg.repeats):
        for key, timer in timers.items():
            t = timer()
            if r >= cfg.warmup:
                samples[key].append(t)
    med = {k: statistics.median(v) for k, v in samples.items()}
    grad = med["grad"]
    out: Dict[str, Dict[str, float]] = {"grad": {"seconds": grad}}
    for route in case["routes"]:
        lin, gv, gs = med[f"{route}: lin"], med[f"{route}: Gv"], med[f"{route}: grad*"]
        out[route] = {
            "lin ms": lin * 1e3,
            "Gv ms": gv * 1e3,
            "grad*/grad": gs / grad,
            "lin/grad": lin / grad,
            "Gv/grad": gv / grad,
            "CG it/grad": (gv + max(lin - grad, 0.0) / 2) / grad,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in asdict(Config()).items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    cfg = Config(**vars(parser.parse_args()))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    commit = environment().get("commit", "")
    header = dict(
        torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
        processor=platform.processor(), threads=torch.get_num_threads(), commit=commit,
        config=asdict(cfg),
    )  # fmt: skip
    print(json.dumps(header))
    results = {}
    for case in _cases(cfg.seed):
        results[case["name"]] = measure(case, cfg)
        grad = results[case["name"]]["grad"]["seconds"]
        print(f"{case['name']}: gradient {grad * 1e3:.2f} ms")
        for route, row in results[case["name"]].items():
            if route != "grad":
                print(f"  {route:16s} " + "  ".join(f"{k} {v:5.2f}" for k, v in row.items()))
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(dict(header, results=results), f, indent=1)


if __name__ == "__main__":
    main()
