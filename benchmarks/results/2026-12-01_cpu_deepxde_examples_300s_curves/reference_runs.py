"""What this record's reference scripts share (``allen_cahn_reference.py``,
``poisson_lshape_reference.py``): their arguments, the example trained as
``deepxde_examples.py`` trains it with the script's error measure, and where the JSON goes."""

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np

HERE = Path(__file__).resolve().parent


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("examples", help="a DeepXDE checkout's examples/ folder")
    parser.add_argument("--budget", type=float, default=None, help="also train with SGN")
    parser.add_argument(
        "--method", default="sgn", help="deepxde_examples.py's method (sgn, sgn_rad, ...)"
    )
    parser.add_argument("--out", default=None, help="the folder of the JSON (default: here)")
    return parser.parse_args()


def rel(a, b) -> float:
    """The relative L2 error of ``a`` against ``b``."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def train(example: str, args: argparse.Namespace, extra: Callable[[object], dict]) -> dict:
    """``{method: deepxde_examples.run(...)'s result, "environment": ...}``: the example trained
    by ``args.method`` for ``args.budget`` CPU s on one thread, seed 0, float64, ``extra`` (a
    function of the trained model) adding its entries to the result."""
    sys.path.insert(0, str(HERE.parents[1] / "pinns"))
    sys.path.insert(0, str(HERE.parents[1]))
    import deepxde_examples
    import measuring
    import torch

    torch.set_num_threads(1)
    run = argparse.Namespace(examples=args.examples, budget=args.budget, seed=0, float32=False)
    result = deepxde_examples.run(example, args.method, run, extra=extra)
    return {args.method: result, "environment": measuring.environment()}


def write(out: dict, stem: str, args: argparse.Namespace) -> None:
    """Prints ``out`` and writes it to ``STEM[_BUDGETs[_METHOD]].json`` in ``--out`` (this
    folder by default): the budget where the example was trained, the method where not
    ``sgn``."""
    print(json.dumps(out))
    if args.budget is not None:
        stem += f"_{args.budget:.0f}s" + ("" if args.method == "sgn" else f"_{args.method}")
    folder = Path(args.out) if args.out else HERE
    (folder / f"{stem}.json").write_text(json.dumps(out, indent=1))
