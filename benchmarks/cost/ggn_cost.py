"""Cost of a Gauss-Newton product and of an SGN step, in gradients, on the paper's five models
and on three models that are not chains of known layers.

Command (from the repository root)::

    PYTHONPATH=src python benchmarks/cost/ggn_cost.py                # CPU, and CUDA when present
    PYTHONPATH=src python benchmarks/cost/ggn_cost.py --devices cpu --models boston sine
    PYTHONPATH=src python benchmarks/cost/ggn_cost.py --threads 1    # a CPU shared with other jobs
    PYTHONPATH=src python benchmarks/cost/ggn_cost.py --models resnet_bn transformer lstm \
        --engines functional traced --ks 2 5                     # any model: the traced engine

The models beyond the paper's (``workloads.ANY_MODELS``): ``resnet_bn``, a CIFAR-shaped ResNet
(three stages of residual blocks with batch norm in training mode, widths 16-32-64, batch 128);
``transformer``, a causal pre-norm transformer (2 layers, width 128, 4 heads, sequence 64,
batch 32, vocabulary 64, cross-entropy per position); ``lstm``, an embedding, one LSTM layer of
width 128 and a linear read-out per position (same data shape); ``bilstm``, the same with two
bidirectional LSTM layers and dropout 0.1 between them (a tagger; training mode); ``tcn``, a
temporal convolutional network with weight-normalized convolutions (``workloads.TCN``);
``transformer_pad``, the transformer with a scaled word embedding with a padding row
(``workloads.ScaledEmbedding``, a subclass with a forward of its own); ``gru``, the ``lstm`` model
with a GRU layer. Engines
that do not apply to a model (``fast`` and ``graphs`` on these) are left out of its rows;
``traced_graphs`` is the traced engine with ``cuda_graphs=True`` (CUDA only),
``traced_compiled`` with ``compile=True`` (its first call compiles, and is timed apart).

With ``--curvlinops`` (default on; skipped with a message when ``curvlinops-for-pytorch`` is
not installed) the ``G v`` of curvlinops' ``GGNLinearOperator`` is timed in the same rounds, on
a copy of the model whose batch norms use batch statistics without running ones
(``torch.func.replace_all_batch_norm_modules_``, as ``torch.func`` transforms need), with the
math attention kernel and without mkldnn recurrent kernels (the fused kernels have no
forward-mode rules); its largest relative deviation from the traced engine's product is printed
as a check that both compute the same matrix.

For each paper model at its batch size (random inputs and targets of the right shapes; the
cost does not depend on the values) and each engine (``functional``, ``fast``, and on CUDA
``graphs``: the layer-wise engine with ``cuda_graphs=True``, whose first set-up captures the graphs
and is timed apart, not in the medians) it prints:

* ``grad``: one plain PyTorch gradient, ``autograd.grad(loss(model(x), y), params)``;
* ``lin``: the engine's set-up for a step (loss, gradient and whatever the products reuse);
* ``Gv``: one ``G v`` product after that set-up;
* ``Gv/grad`` and ``CG it/grad``: the amortized cost of one CG iteration at k = 2, i.e.
  ``(Gv + max(lin - grad, 0) / 2) / grad`` (the set-up beyond a gradient spread over the step);
* ``step k``: a whole ``SGN.step`` with k CG iterations (``cg_tol=0``), line search off, trust
  region on (one loss evaluation), in gradients; the target is ``1.3 k + 1.5``;
* ``mem``: peak memory of one gradient / one step with k = 10, in MiB: the model's parameters
  and the batch plus the peak of what the call allocates (CPU: the torch profiler's
  allocation events summed in time order; CUDA: ``torch.cuda.max_memory_allocated`` less what
  was allocated before). The target is a ratio <= 2. ``mem step10`` is a fresh optimizer's
  first step, so it includes tracing and, with graphs, the capture (whose private pools it
  counts); ``mem later step10`` is the same optimizer's second step, what each step after the
  first allocates.

Times are medians over ``--repeats`` rounds after ``--warmup`` rounds; in every round each
quantity is measured once, in turn, so that load from other processes hits all alike. The
device is synchronised around every timed call. The hardware, versions, config and git commit
are printed first and saved with the results (``--out``).

Results on this repository's CPU machine: see ``docs/PERFORMANCE.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from torch_sgn import SGN
from torch_sgn.engines import cuda_graphs as graphs
from torch_sgn.engines.selection import select_engine
from torch_sgn.linearization import Batch
from torch_sgn.losses import resolve_loss
from torch_sgn.model.flat_model import FunctionalModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules
from measuring import environment, environment_line, peak_mib, sync, timed  # noqa: E402
from workloads import batch, engine_options, math_kernels  # noqa: E402


@dataclass
class Config:
    models: List[str] = field(
        default_factory=lambda: ["boston", "sine", "mnist", "fashion_mnist", "cifar10"]
    )
    devices: List[str] = field(default_factory=lambda: ["cpu", "cuda"])
    engines: List[str] = field(
        default_factory=lambda: ["functional", "layerwise", "traced", "graphs"]
    )
    ks: List[int] = field(default_factory=lambda: [2, 3, 5, 10])
    repeats: int = 15
    warmup: int = 3
    memory: bool = True
    curvlinops: bool = True  # time curvlinops' GGNLinearOperator too, where it is installed
    threads: int = 0  # CPU threads; 0 keeps torch's default
    out: str = ""
    from_json: str = ""  # print the tables of a saved run instead of measuring


def measure(name: str, device: torch.device, cfg: Config) -> Dict[str, object]:
    model, x, y, loss_name = batch(name, device)
    loss = resolve_loss(loss_name)
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient():
        return torch.autograd.grad(loss.value(model(x), y), params)

    fmodel = FunctionalModel(model)
    if model.training:  # dropout: every engine (and curvlinops, seeded alike) draws one mask
        torch.manual_seed(0)
        fmodel.freeze_rng()
    flat = fmodel.flat()
    v = torch.randn(flat.shape, generator=torch.Generator().manual_seed(1)).to(device)
    # "graphs" and "traced_graphs": the fast and the traced engine with cuda_graphs=True (CUDA
    # only)
    engines = [e for e in cfg.engines if "graphs" not in e or not graphs.device_obstacle(device)]
    options = {e: engine_options(e) for e in engines}
    lins = {}
    for e in engines:
        try:
            lins[e] = select_engine(fmodel, loss, **options[e])
        except ValueError as why:  # "layerwise" on a model that is not a chain of known layers
            print(f"  {name}: engine {e} left out ({why})", file=sys.stderr)
    engines = [e for e in engines if e in lins]
    current, first_call_s = {}, {}
    for e in engines:  # the graphs' first call captures them: its time is reported apart
        sync(device)
        start = time.perf_counter()
        try:
            lin = lins[e](flat, Batch(x, y))
            lin.ggn_vp(v)
        except NotImplementedError as why:  # e.g. forward-mode AD missing for a fused kernel
            print(f"  {name}: engine {e} left out ({str(why).splitlines()[0]})", file=sys.stderr)
            continue
        sync(device)
        first_call_s[e] = time.perf_counter() - start
        current[e] = lin
    engines = [e for e in engines if e in current]
    opts = {
        (e, k): SGN(
            copy.deepcopy(model),
            loss_name,
            cg_iters=k,
            cg_tol=0.0,
            line_search=False,
            solver="cg",
            **options[e],
        )  # fmt: skip
        for e in engines
        for k in cfg.ks
    }

    fresh = {key: copy.deepcopy(opt.state_dict()) for key, opt in opts.items()}
    cg_iters: Dict[str, List[int]] = {}

    def step(key):
        info = opts[key].step(x, y)
        cg_iters.setdefault(f"{key[0]}/step{key[1]}", []).append(info.iterations)

    def reset(key):
        # Every timed step starts from the initial point and state, so that k CG iterations
        # run on a well-conditioned problem (no drift to where CG stops early).
        opts[key]._fmodel.write(flat)
        opts[key].load_state_dict(fresh[key])

    tasks: Dict[str, Callable[[], object]] = {"grad": gradient}
    prepare: Dict[str, Callable[[], object]] = {}
    for e in engines:
        tasks[f"{e}/lin"] = lambda e=e: current.__setitem__(e, lins[e](flat, Batch(x, y)))
        tasks[f"{e}/Gv"] = lambda e=e: current[e].ggn_vp(v)
        for k in cfg.ks:
            tasks[f"{e}/step{k}"] = lambda e=e, k=k: step((e, k))
            prepare[f"{e}/step{k}"] = lambda e=e, k=k: reset((e, k))

    product_check = None
    if cfg.curvlinops:
        clo = _curvlinops_product(model, loss_name, x, y)
        if clo is not None:
            tasks["curvlinops/Gv"] = lambda: clo(v)
            try:
                torch.manual_seed(0)
                theirs = clo(v)
            except Exception as why:  # noqa: BLE001 - a failed peer must not lose our times
                print(f"  {name}: curvlinops left out ({_first_line(why)})", file=sys.stderr)
                del tasks["curvlinops/Gv"]
            else:
                if "traced" in engines:  # both must compute the same matrix
                    ours = current["traced"].ggn_vp(v)
                    product_check = ((ours - theirs).norm() / ours.norm()).item()

    times: Dict[str, List[float]] = {t: [] for t in tasks}
    for r in range(cfg.warmup + cfg.repeats):
        for t, fn in tasks.items():
            if t in prepare:
                prepare[t]()
            dt = timed(fn, device)
            if r >= cfg.warmup:
                times[t].append(dt)
    med = {t: statistics.median(ts) for t, ts in times.items()}
    spread = {t: (min(ts), max(ts)) for t, ts in times.items()}

    result: Dict[str, object] = {"model": name, "device": str(device), "median_s": med}
    result["range_s"] = spread
    result["engines"] = engines
    result["first_lin_s"] = first_call_s
    result["cg_iters_min"] = {t: min(its) for t, its in cg_iters.items()}
    result["curvlinops_vs_traced_rel_diff"] = product_check
    if "traced" in current and "functional" in current:  # two routes to the same matrix
        ours, theirs = current["traced"].ggn_vp(v), current["functional"].ggn_vp(v)
        result["functional_vs_traced_rel_diff"] = ((ours - theirs).norm() / ours.norm()).item()
    if cfg.memory:
        base = sum(t.numel() * t.element_size() for t in [x, y, *params])

        def fresh_sgn(e):
            return SGN(
                copy.deepcopy(model), loss_name, cg_iters=10, cg_tol=0.0,
                line_search=False, solver="cg", **options[e],
            )  # fmt: skip

        # A first step (it traces, and captures CUDA graphs, once per shape), and a later one
        # of the same optimizer: what every step after the first costs. Graphs' private pools,
        # reserved at capture, count in the first step's peak only.
        calls = {"grad": gradient}
        warmed: Dict[str, SGN] = {}
        for e in engines:
            calls[f"{e}/step10"] = lambda e=e: fresh_sgn(e).step(x, y)
            calls[f"{e}/step10_later"] = lambda e=e: warmed.pop(e).step(x, y)
        mem: Dict[str, float] = {}
        for t, fn in calls.items():
            if t.endswith("_later"):
                e = t.split("/")[0]
                warmed[e] = fresh_sgn(e)
                warmed[e].step(x, y)
            try:
                mem[t] = peak_mib(fn, device, base)
            except Exception as why:  # noqa: BLE001 - a failed profile must not lose the times
                print(f"  {name}: memory of {t} not measured ({_first_line(why)})", file=sys.stderr)
                mem[t] = float("nan")
            warmed.clear()
        result["peak_mib"] = mem
    return result


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _curvlinops_product(model, loss_name: str, x, y) -> Optional[Callable]:
    """``v -> G v`` by curvlinops' ``GGNLinearOperator``, or ``None`` (with a message) when
    curvlinops is not installed."""
    try:
        from curvlinops import GGNLinearOperator
    except ImportError as why:
        print(f"  curvlinops left out ({why}): pip install curvlinops-for-pytorch", file=sys.stderr)
        return None
    except Exception as why:  # noqa: BLE001 - e.g. a torchvision built for another torch
        print(f"  curvlinops left out: it cannot be imported ({_first_line(why)})", file=sys.stderr)
        return None
    twin = copy.deepcopy(model)
    torch.func.replace_all_batch_norm_modules_(twin)  # batch statistics, no running ones
    params = [p for p in twin.parameters() if p.requires_grad]
    loss = {"mse": nn.MSELoss(), "cross_entropy": nn.CrossEntropyLoss()}[loss_name]
    operator = GGNLinearOperator(twin, loss, params, [(x, y)], check_deterministic=False)

    recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())

    def product(v):
        with math_kernels(recurrent):
            return operator @ v

    return product


def _table(results: List[Dict[str, object]], cfg: Config, stat: str = "median") -> str:
    head = ["model", "engine", "grad ms", "lin ms", "Gv ms", "Gv/grad", "CG it/grad (k=2)"]
    head += [f"step {k} (<= {1.3 * k + 1.5:.1f})" for k in cfg.ks]
    later = cfg.memory and any(
        f"{e}/step10_later" in res.get("peak_mib", {})
        for res in results
        for e in res.get("engines", cfg.engines)
    )  # records made before the later step was measured have none
    if cfg.memory:
        head += ["mem grad MiB", "mem step10 MiB (ratio)"]
        head += ["mem later step10 MiB (ratio)"] if later else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        med = res["median_s"] if stat == "median" else {t: r[0] for t, r in res["range_s"].items()}
        g = med["grad"]
        for e in res.get("engines", cfg.engines):
            lin, gv = med[f"{e}/lin"], med[f"{e}/Gv"]
            row = [f"{res['model']} ({res['device']})", e, f"{g * 1e3:.2f}"]
            row += [f"{lin * 1e3:.2f}", f"{gv * 1e3:.2f}", f"{gv / g:.2f}"]
            row.append(f"{(gv + max(lin - g, 0) / 2) / g:.2f}")
            row += [
                f"{med[f'{e}/step{k}'] / g:.2f}"
                + ("" if res["cg_iters_min"][f"{e}/step{k}"] == k else " (CG stopped early)")
                for k in cfg.ks
            ]
            if cfg.memory:
                mem = res["peak_mib"]
                row += [
                    f"{mem['grad']:.1f}",
                    f"{mem[f'{e}/step10']:.1f} ({mem[f'{e}/step10'] / mem['grad']:.2f})",
                ]
                if later:
                    m = mem.get(f"{e}/step10_later", float("nan"))
                    row.append(f"{m:.1f} ({m / mem['grad']:.2f})")
            lines.append("| " + " | ".join(row) + " |")
        if "curvlinops/Gv" in med:
            gv = med["curvlinops/Gv"]
            row = [f"{res['model']} ({res['device']})", "curvlinops", f"{g * 1e3:.2f}", "-"]
            row += [f"{gv * 1e3:.2f}", f"{gv / g:.2f}"] + ["-"] * (len(head) - 6)
            lines.append("| " + " | ".join(row) + " |")
            if "traced/Gv" in med:
                check = res.get("curvlinops_vs_traced_rel_diff")
                lines.append(
                    f"<!-- {res['model']}: traced Gv / curvlinops Gv = "
                    f"{med['traced/Gv'] / gv:.2f}; relative difference of the products "
                    f"{check:.1e} -->"
                )
        if res.get("functional_vs_traced_rel_diff") is not None:
            lines.append(
                f"<!-- {res['model']}: relative difference of the traced and functional "
                f"engines' products {res['functional_vs_traced_rel_diff']:.1e} -->"
            )
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> None:
    cfg = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(cfg).items():
        if isinstance(default, list):
            kind = type(default[0])
            parser.add_argument(f"--{name}", nargs="+", type=kind, default=default)
        elif isinstance(default, bool):
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(f"--{name}", type=type(default), default=default)
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.from_json:
        with open(cfg.from_json) as f:
            saved = json.load(f)
        run = Config(**{**saved["config"], "from_json": ""})
        print(f"saved run: {saved['environment']}, config: {saved['config']}")
        for stat in ("median", "min"):
            print(f"{stat} over rounds:")
            print(_table(saved["results"], run, stat))
        return
    env = environment()
    print(
        "command: PYTHONPATH=src python " + " ".join(["benchmarks/cost/ggn_cost.py", *sys.argv[1:]])
    )
    print(environment_line(env))
    print(f"config: {asdict(cfg)}")
    devices = [torch.device(d) for d in cfg.devices if d != "cuda" or torch.cuda.is_available()]
    results, failed = [], []
    for device in devices:
        for name in cfg.models:
            try:  # one model failing must not lose the others' rows
                results.append(measure(name, device, cfg))
            except Exception as why:  # noqa: BLE001
                failed.append(f"{name} on {device}: {_first_line(why)}")
                print(f"  {name} on {device} FAILED: {_first_line(why)}", file=sys.stderr)
                continue
            print(f"  measured {name} on {device}", file=sys.stderr, flush=True)
            if cfg.out:  # written after every model, so that a crash keeps what was measured
                _save(cfg, env, results, failed)
    print(_table(results, cfg))
    for res in results:
        for e in ("graphs", "traced_graphs", "traced_compiled"):
            if e in res["engines"]:
                took = res["first_lin_s"][e]
                what = "compiles" if e == "traced_compiled" else "captures"
                print(f"{res['model']}: the first set-up of {e}, which {what}, took {took:.2f} s")
    print("fastest round of each quantity (less sensitive to load from other processes):")
    print(_table(results, cfg, "min"))
    for line in failed:
        print(f"FAILED: {line}")
    if cfg.out:
        _save(cfg, env, results, failed)


def _save(cfg: Config, env: Dict[str, str], results: List[Dict[str, object]], failed) -> None:
    record = {"config": asdict(cfg), "environment": env, "results": results, "failed": failed}
    with open(cfg.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
