"""One rank of the distributed tests: ``python _dist_worker.py SCENARIO RANK WORLD STORE OUT``.

Run by ``test_distributed.py`` in separate processes (gloo, file store, float64). Each rank saves
what it saw to ``OUT/SCENARIO_RANK.pt``; the test compares it with one process on the full batch.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from torch_sgn import SGN, stepper
from torch_sgn.distributed import shard
from torch_sgn.engines.selection import select_engine

STEPS = 5
SETTINGS = dict(cg_iters=6, cg_tol=0.0, line_search=True, trust_region=True)


@dataclass(frozen=True)
class Case:
    name: str
    loss: Callable[[], object]
    sizes: tuple  # examples per rank; None: torch_sgn.distributed.shard
    # "real", "smooth" (of the inputs), "index" or "index-first-ignored" (rank 0's 5 targets
    # are -100)
    targets: str
    lr: float = 1.0
    # Cross-entropy on a tiny batch is ill-conditioned: with less damping, merely reversing the
    # batch's order moves one process's result by 1e-8 (the test checks the order-sensitivity).
    damping: float = 1e-3
    solver: str = "cg"
    cg_iters: int = SETTINGS["cg_iters"]
    ddp: bool = False  # the ranks pass the model wrapped in DistributedDataParallel
    weight_decay: float = 0.0


CASES = [
    Case("mse-equal-shards", lambda: "mse", None, "real"),
    Case("ce-unequal-shards", lambda: "cross_entropy", (9, 4), "index", lr=4.0, damping=0.1),
    Case("mse-sum-unequal", lambda: nn.MSELoss(reduction="sum"), (3, 8), "real"),
    Case(
        "ce-class-weights-unequal",
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)),
        (7, 5),
        "index",
        lr=4.0,
        damping=0.1,
    ),
    # A shard with no target that counts: its mean is NaN, its weight 0.
    Case("ce-shard-all-ignored", lambda: "cross_entropy", (5, 7), "index-first-ignored", 4.0, 0.1),
    # The direct solver: each rank's Gauss-Newton matrix weighted and all-reduced like G v.
    Case("mse-unequal-direct", lambda: "mse", (5, 7), "real", damping=0.01, solver="direct"),
    Case(
        "ce-class-weights-direct",
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)),
        (4, 8),
        "index",
        lr=4.0,
        damping=0.1,
        solver="direct",
    ),
    # solver="auto": CG steps (one iteration: poor ones) with a probe of the exact step at step
    # 0, judged at step 1 on the reduced loss, every rank alike; exact steps from then on.
    Case(
        "mse-unequal-auto", lambda: "mse", (5, 7), "smooth", damping=0.01, solver="auto", cg_iters=1
    ),
    Case(
        "ce-shard-all-ignored-direct",
        lambda: "cross_entropy",
        (5, 7),
        "index-first-ignored",
        4.0,
        0.1,
        solver="direct",
    ),
    # A model wrapped in DistributedDataParallel: SGN takes its module and all-reduces itself.
    Case("mse-unequal-ddp-wrapped", lambda: "mse", (5, 7), "real", ddp=True),
    # The penalty is added once, after the reduction; one process solves the direct case
    # through the batch's outputs, the ranks through G.
    Case("mse-unequal-weight-decay", lambda: "mse", (5, 7), "real", weight_decay=0.05),
    Case(
        "ce-unequal-weight-decay-direct",
        lambda: "cross_entropy",
        (4, 8),
        "index",
        damping=0.1,
        solver="direct",
        weight_decay=0.05,
    ),  # fmt: skip
]


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Sigmoid(), nn.Linear(6, 3)).double()


def batch(case: Case, step: int, reverse: bool = False) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + len(case.name))
    n = 12 if case.sizes is None else sum(case.sizes)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    if case.targets == "real":
        y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    elif case.targets == "smooth":  # a function of the inputs, which an exact step can fit
        y = torch.tanh(x[:, :3] - x[:, 3:])
    else:
        y = torch.randint(0, 3, (n,), generator=g)
        if case.targets == "index-first-ignored":
            y[:5] = -100
    return (x.flip(0), y.flip(0)) if reverse else (x, y)


def flat(model: nn.Module) -> torch.Tensor:
    return nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def run_case(case: Case, rank: int = 0, world: int = 1, reverse: bool = False) -> dict:
    """``world == 1``: one process on the full batch (the reference); else this rank's shard.

    ``reverse`` feeds each batch in reverse order: the same problem with other rounding.
    """
    model = build_model(100 + rank)  # ranks start different: the broadcast must fix that
    before = flat(model)
    settings = {**SETTINGS, "cg_iters": case.cg_iters}
    net = nn.parallel.DistributedDataParallel(model) if case.ddp and world > 1 else model
    opt = SGN(
        net, case.loss(), lr=case.lr, damping=case.damping, solver=case.solver,
        weight_decay=case.weight_decay, **settings,
    )  # fmt: skip
    after_construction = flat(model)
    infos = []
    for step in range(STEPS):
        x, y = batch(case, step, reverse)
        if world > 1:
            if case.sizes is None:
                x, y = shard(x, y)
            else:
                x, y = x.split(case.sizes)[rank], y.split(case.sizes)[rank]
        infos.append(opt.step(x, y))
    return dict(before=before, constructed=after_construction, final=flat(model), infos=infos)


def main() -> None:
    scenario, rank, world, store, out = sys.argv[1:6]
    rank, world = int(rank), int(world)
    timeout = float(os.environ.get("SGN_TEST_PG_TIMEOUT", "30"))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    result = {}
    if scenario == "equivalence":
        result = {case.name: run_case(case, rank, world) for case in CASES}
        result["checks"] = consistency_checks(rank)
        result["ddp_batch_norm"] = ddp_batch_norm(rank)
    elif scenario in ("rank_exits", "step_on_one_rank"):
        result = failure(scenario, rank, os.path.join(out, f"{scenario}_0.pt"))
    torch.save(result, os.path.join(out, f"{scenario}_{rank}.pt"))
    if scenario == "equivalence":
        dist.destroy_process_group()
    # Gloo has aborted a process in the interpreter's teardown ("terminate called without an
    # active exception"): after a timed-out collective on torch 2.11, and rarely after a clean
    # destroy_process_group on torch 2.13. The result is saved: leave without that teardown,
    # as `torch-sgn run` does.
    print("saved", flush=True)
    os._exit(0)


def ddp_batch_norm(rank: int) -> dict:
    """A model with batch norm wrapped in DistributedDataParallel, three steps on this rank's
    shards: its state afterwards (the ranks' must agree, buffers included)."""
    torch.manual_seed(100 + rank)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    model = model.double()
    opt = SGN(nn.parallel.DistributedDataParallel(model), "mse", solver="cg", cg_iters=3)
    case = CASES[0]
    for step in range(3):
        opt.step(*shard(*batch(case, step)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"state": state, "evaluates_the_module": opt._fmodel.model is model}


def consistency_checks(rank: int) -> dict:
    """Ranks whose optimizer state or parameters disagree: every rank must raise."""
    case = CASES[0]
    model = build_model(0)
    opt, switch = _switchable(lambda: SGN(model, case.loss(), solver="cg", **SETTINGS))
    x, y = shard(*batch(case, 0))
    opt.step(x, y)
    old = copy.deepcopy(opt.state_dict())
    opt.step(x, y)
    if rank == 1:
        opt.load_state_dict(old)  # one rank resumes from an older checkpoint
    errors = {}
    try:
        opt.step(x, y)
    except RuntimeError as e:
        errors["state"] = str(e)
    opt.load_state_dict(old)  # now every rank is at the same step again
    if rank == 1:
        with torch.no_grad():
            model[0].bias.add_(1e-3)  # changed outside SGN on one rank only
    try:
        opt.step(x, y)
    except RuntimeError as e:
        errors["params"] = str(e)
    model.load_state_dict(build_model(0).state_dict())  # identical again
    opt.load_state_dict(old)
    before = flat(model)
    try:  # bad targets on rank 1 only: its local computation raises inside the step
        opt.step(x, y[:, :2] if rank == 1 else y)
    except (RuntimeError, ValueError) as e:
        errors["local"] = f"{type(e).__name__}: {e}"
    errors["local_unchanged"] = torch.equal(flat(model), before)
    bad = x.clone()
    if rank == 1:
        bad[0, 0] = float("nan")  # reaches the reduced loss, so every rank raises at once
    try:
        opt.step(bad, y)
    except (FloatingPointError, ValueError) as e:
        errors["nan"] = f"{type(e).__name__}: {e}"
    errors["nan_unchanged"] = torch.equal(flat(model), before)
    for where in ("gv", "trial"):  # rank 1 raises between two collectives, mid-step
        if rank == 1:
            switch.fail = _failing(where)
        start = time.monotonic()
        try:
            opt.step(x, y)
        except RuntimeError as e:
            errors[where] = str(e)
        errors[f"{where}_seconds"] = time.monotonic() - start
        errors[f"{where}_unchanged"] = torch.equal(flat(model), before)
        switch.fail = None
    opt.step(x, y)  # and the ranks go on together
    errors["after"] = flat(model)
    return errors


class _Switch:
    """The optimizer's engine, whose linearizations ``fail`` (a ``lin -> lin`` that makes one
    fail) while it is set: a failure inside the engine's own products, which the data-parallel
    communicator reduces, so the other ranks learn of it."""

    def __init__(self, engine):
        self.engine, self.fail = engine, None

    def __getattr__(self, name):  # what SGN reads of its engine
        return getattr(self.engine, name)

    def __call__(self, *args):
        lin = self.engine(*args)
        return lin if self.fail is None else self.fail(lin)


def _switchable(build: Callable[[], SGN]) -> tuple:
    """``(opt, switch)``: the optimizer ``build()`` makes, its engine chosen by
    :func:`torch_sgn.engines.selection.select_engine` as always and wrapped in a
    :class:`_Switch`."""
    chosen = []

    def select(*args, **kwargs):
        chosen.append(_Switch(select_engine(*args, **kwargs)))
        return chosen[-1]

    stepper.select_engine = select
    try:
        opt = build()
    finally:
        stepper.select_engine = select_engine
    return opt, chosen[-1]


def _interrupt_product(n: int, interrupt: Callable[[], None]):
    """``lin -> lin`` whose ``n``-th ``G v`` product calls ``interrupt()`` first."""

    def interrupted(lin):
        calls, product = [], lin.ggn_vp

        def ggn_vp(v):
            calls.append(1)
            if len(calls) == n:
                interrupt()
            return product(v)

        return dataclasses.replace(lin, ggn_vp=ggn_vp)

    return interrupted


def _raise(message: str) -> Callable[[], None]:
    def interrupt():
        raise RuntimeError(message)

    return interrupt


def _failing(where: str):
    """``lin -> lin`` whose second ``G v`` product (or first trial-point loss) raises."""
    if where == "gv":
        return _interrupt_product(2, _raise("injected failure in G v"))

    def failing(lin):
        def value_at(flat):
            raise RuntimeError("injected failure at a trial point")

        return dataclasses.replace(lin, value_at=value_at)

    return failing


def failure(scenario: str, rank: int, survivor: str) -> dict:
    case = CASES[0]
    model = build_model(0)
    opt, switch = _switchable(lambda: SGN(model, case.loss(), solver="cg", **SETTINGS))
    x, y = shard(*batch(case, 0))
    opt.step(x, y)  # one good step first
    if rank == 1 and scenario == "rank_exits":  # dies inside CG, between two all-reduces
        switch.fail = _interrupt_product(3, lambda: os._exit(3))
    if rank == 1 and scenario == "step_on_one_rank":
        for _ in range(600):  # alive but never calls step, until rank 0 has reported
            if os.path.exists(survivor):
                os._exit(0)
            time.sleep(0.1)
        os._exit(1)
    start = time.monotonic()
    try:
        opt.step(x, y)
        return dict(error=None, seconds=time.monotonic() - start)
    except RuntimeError as e:
        return dict(error=str(e), seconds=time.monotonic() - start)


if __name__ == "__main__":
    main()
