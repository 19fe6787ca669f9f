"""SGN next to Adam on a character-level causal transformer, on the CPU, with no download.

Command: python examples/char_transformer.py [--quick] [--epochs 4] [--threads 1]

The text is the docstrings of the Python standard library's top-level modules (modules,
classes and functions, read from the source files with ``ast``; nothing is imported or
downloaded), characters outside printable ASCII mapped to ``?``: about a megabyte of English
prose and examples, which differs slightly between Python versions. The last 10% is held out.

The model is a small pre-norm transformer (token and position embeddings, causal
``scaled_dot_product_attention``, LayerNorm, GELU MLP), not an ``nn.Sequential`` chain, so
``SGN``'s default ``engine="auto"`` takes the traced engine (see
``torch_sgn.engines.traced.engine``). An
epoch is a fixed set of random windows of the training text; the loss is cross-entropy per
character in nats.

Output of ``python examples/char_transformer.py --threads 1`` (2-core x86 CPU shared with other
jobs, so the seconds are loose; torch 2.13, Python 3.11). Per epoch SGN(10) goes about as far
as Adam; each of its steps costs some 15 Adam steps here (10 CG iterations, the set-up and the
trust region's loss), so per second Adam is far ahead on this model::

    text: 889020 characters, alphabet of 98
    SGN  epoch 1  train loss 3.1533  held-out loss 2.8453    16.4 s
    SGN  epoch 2  train loss 2.7630  held-out loss 2.8217    31.0 s
    SGN  epoch 3  train loss 2.6653  held-out loss 2.7381    44.5 s
    SGN  epoch 4  train loss 2.6407  held-out loss 2.7296    58.7 s
    Adam epoch 1  train loss 3.4700  held-out loss 3.1015     1.1 s
    Adam epoch 2  train loss 2.8900  held-out loss 2.9021     2.1 s
    Adam epoch 3  train loss 2.7399  held-out loss 2.7887     3.1 s
    Adam epoch 4  train loss 2.6700  held-out loss 2.7352     4.0 s
"""

from __future__ import annotations

import argparse
import ast
import string
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torch_sgn import SGN
from torch_sgn.experiments.models import CausalTransformer

ALPHABET = sorted(set(string.printable) - set("\r\x0b\x0c")) + ["?"]


def stdlib_docstrings() -> str:
    """The docstrings of the standard library's top-level modules, in file-name order."""
    parts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts))  # each text once


def encode(text: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(ALPHABET)}
    unknown = index["?"]
    return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.long)


def windows(ids: torch.Tensor, count: int, length: int, g: torch.Generator):
    """``count`` random windows of ``length + 1`` characters: inputs and next characters."""
    start = torch.randint(0, len(ids) - length - 1, (count,), generator=g)
    chunks = torch.stack([ids[s : s + length + 1] for s in start.tolist()])
    return chunks[:, :-1], chunks[:, 1:]


@torch.no_grad()
def evaluate(model: nn.Module, x, y) -> float:
    return sum(
        F.cross_entropy(model(xb), yb).item() for xb, yb in zip(x.split(64), y.split(64))
    ) / len(x.split(64))


def train(name, make_optimizer, data, epochs: int, batch_size: int, length: int) -> None:
    torch.manual_seed(0)
    model = CausalTransformer(len(ALPHABET), width=64, length=length)
    optimizer = make_optimizer(model)
    (x, y), (xv, yv) = data
    g = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        losses = []
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            if isinstance(optimizer, SGN):
                losses.append(optimizer.step(x[idx], y[idx]).loss)
            else:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        print(
            f"{name:4s} epoch {epoch}  train loss {sum(losses) / len(losses):.4f}  "
            f"held-out loss {evaluate(model, xv, yv):.4f}  {time.perf_counter() - start:6.1f} s"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps on a few windows")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--windows", type=int, default=1024, help="training windows per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.epochs, args.windows, args.batch_size, args.length = 2, 32, 16, 32
    ids = encode(stdlib_docstrings())
    split = int(0.9 * len(ids))
    g = torch.Generator().manual_seed(0)
    data = (
        windows(ids[:split], args.windows, args.length, g),
        windows(ids[split:], max(64, args.windows // 8), args.length, g),
    )
    print(f"text: {len(ids)} characters, alphabet of {len(ALPHABET)}")
    optimizers = {
        "SGN": lambda m: SGN(m, "cross_entropy", cg_iters=3 if args.quick else 10),
        "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=3e-3),
    }
    for name, make in optimizers.items():
        train(name, make, data, args.epochs, args.batch_size, args.length)


if __name__ == "__main__":
    main()
