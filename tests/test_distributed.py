"""Data-parallel SGN: 2 gloo processes against one process on the full batch, in float64.

Every process is started with a deadline and killed when it passes, so a bug cannot hang the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist_worker import CASES, run_case

from torch_sgn.distributed import is_main_process, rank, shard, world_size

WORKER = Path(__file__).with_name("_dist_worker.py")
SRC = Path(__file__).parents[1] / "src"

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    # one pytest-xdist worker (--dist loadgroup) where pytest-xdist can keep a group together
    pytest.mark.xdist_group("distributed"),
]


def _launch(scenario: str, out: Path, deadline: float, pg_timeout: float = 30.0) -> list:
    """Runs 2 ranks of ``scenario``; returns [(returncode, output)]; kills both at ``deadline``."""
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    env["SGN_TEST_PG_TIMEOUT"] = str(pg_timeout)
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = out / f"{scenario}.store"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(r), "2", str(store), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    end = time.monotonic() + deadline
    results = []
    try:
        for p in procs:
            output, _ = p.communicate(timeout=max(0.1, end - time.monotonic()))
            results.append((p.returncode, output))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.fixture(scope="session")
def equivalence(tmp_path_factory):
    """The ranks' results, launched once per test session. On pytest-xdist workers the first
    worker to ask launches them and the others read its files: the xdist_group above does not
    keep this module on one worker with every pytest (pytest-xdist's issue 1386), and a worker
    that runs other modules' tests in between would otherwise launch them again."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _launch_equivalence(tmp_path_factory.mktemp("dist"))
    from filelock import FileLock  # a dependency of torch

    out = tmp_path_factory.getbasetemp().parent / "dist"  # the session's, shared by its workers
    out.mkdir(exist_ok=True)
    with FileLock(str(out / "equivalence.lock")):
        if not (out / "launched").is_file():  # (a failed launch leaves none: the next tries again)
            results = _launch_equivalence(out)
            (out / "launched").touch()
            return results
    return [torch.load(out / f"equivalence_{r}.pt", weights_only=False) for r in range(2)]


def _launch_equivalence(out: Path) -> list:
    results = _launch("equivalence", out, deadline=90)
    for code, output in results:
        assert code == 0, output[-3000:]
    return [torch.load(out / f"equivalence_{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_two_ranks_match_one_process_on_the_full_batch(equivalence, case):
    reference = run_case(case)
    ranks = [e[case.name] for e in equivalence]
    expected = reference["final"]
    assert not torch.equal(expected, reference["before"])  # the steps moved the parameters
    # 1e-10 is meaningful only if rounding alone moves one process's result far less than that
    # (up to 1.1e-11 was seen on a 16-core machine).
    reordered = run_case(case, reverse=True)["final"]
    torch.testing.assert_close(reordered, expected, rtol=3e-11, atol=0)
    for got in ranks:
        torch.testing.assert_close(got["final"], expected, rtol=1e-10, atol=0)
        for a, b in zip(got["infos"], reference["infos"]):
            assert a.loss_evals == b.loss_evals and a.iterations == b.iterations
            assert a.solver == b.solver
            assert a.solver == case.solver or case.solver == "auto"
            assert a.accelerated == b.accelerated
            assert a.next_damping == pytest.approx(b.next_damping, rel=1e-10)
            assert a.loss == pytest.approx(b.loss, rel=1e-10)
    if case.solver == "auto":  # the probe's verdict, taken alike: CG steps, then exact ones
        solvers = [i.solver for i in reference["infos"]]
        assert solvers[0] == "cg" and solvers[-1] == "direct"
        assert [i.solver for i in ranks[0]["infos"]] == solvers
    # Bit-identical ranks: same parameters and the same decisions, to the last bit.
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
    assert [i.loss_after for i in ranks[0]["infos"]] == [i.loss_after for i in ranks[1]["infos"]]


def test_a_ddp_wrapped_model_with_batch_norm_keeps_the_ranks_alike(equivalence):
    # SGN evaluates the module DDP wraps: no buffer broadcast at each of its passes
    assert all(e["ddp_batch_norm"]["evaluates_the_module"] for e in equivalence)
    states = [e["ddp_batch_norm"]["state"] for e in equivalence]
    assert states[0]["1.num_batches_tracked"] == 3
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


def test_the_cases_exercise_trust_region_and_line_search(equivalence):
    infos = [i for case in CASES for i in equivalence[0][case.name]["infos"]]
    assert any(i.loss_evals > 1 for i in infos)  # the line search backtracked
    assert any(i.next_damping > i.damping for i in infos)  # the trust region shrank
    assert any(i.next_damping < i.damping for i in infos)  # and expanded
    assert any(i.accelerated for i in infos)  # direct steps with a geodesic acceleration


def test_construction_broadcasts_rank_0s_model(equivalence):
    for case in CASES:
        r0, r1 = equivalence[0][case.name], equivalence[1][case.name]
        assert not torch.equal(r0["before"], r1["before"])  # built differently
        assert torch.equal(r1["constructed"], r0["before"])
        assert torch.equal(r0["constructed"], r0["before"])


def test_disagreeing_or_failing_ranks_raise_on_every_rank(equivalence):
    for e in equivalence:
        assert "step counts differ across ranks" in e["checks"]["state"]
        assert "parameters differ across ranks" in e["checks"]["params"]
        assert e["checks"]["local_unchanged"]
    assert equivalence[1]["checks"]["local"].startswith("ValueError: mse expects targets")
    assert "1 other rank(s) of 2 failed" in equivalence[0]["checks"]["local"]
    for e in equivalence:
        assert e["checks"]["nan_unchanged"]
    assert equivalence[1]["checks"]["nan"].startswith("ValueError: inputs contain NaN")
    assert equivalence[0]["checks"]["nan"].startswith("FloatingPointError: the loss is nan")
    for where, message in (("gv", "in G v"), ("trial", "at a trial point")):
        assert equivalence[1]["checks"][where] == f"injected failure {message}"
        assert "1 other rank(s) of 2 failed" in equivalence[0]["checks"][where]
        for e in equivalence:  # at once, not after the process group's 30 s timeout
            assert e["checks"][f"{where}_unchanged"] and e["checks"][f"{where}_seconds"] < 10
    assert torch.equal(equivalence[0]["checks"]["after"], equivalence[1]["checks"]["after"])


@pytest.mark.slow  # waits for a failure across processes
def test_a_rank_that_exits_mid_step_makes_the_other_fail_fast(tmp_path):
    pg_timeout = 10.0
    results = _launch("rank_exits", tmp_path, deadline=60, pg_timeout=pg_timeout)
    assert results[1][0] == 3, results[1][1][-2000:]  # it died where the test made it die
    assert results[0][0] == 0, results[0][1][-2000:]
    survivor = torch.load(tmp_path / "rank_exits_0.pt")
    assert survivor["error"] is not None
    assert "rank 0 of 2" in survivor["error"] and "crashed" in survivor["error"]
    assert survivor["seconds"] < pg_timeout


@pytest.mark.slow  # waits out a timeout
def test_step_on_one_rank_only_fails_within_the_timeout(tmp_path):
    pg_timeout = 3.0
    results = _launch("step_on_one_rank", tmp_path, deadline=45, pg_timeout=pg_timeout)
    assert results[0][0] == 0, results[0][1][-2000:]
    survivor = torch.load(tmp_path / "step_on_one_rank_0.pt")
    assert survivor["error"] is not None
    assert "did not call SGN.step" in survivor["error"]
    assert pg_timeout * 0.9 <= survivor["seconds"] < pg_timeout + 10


def test_helpers_without_a_process_group():
    x, y = torch.arange(5), torch.arange(5) * 2
    assert rank() == 0 and world_size() == 1 and is_main_process()
    sx, sy = shard(x, y)
    assert torch.equal(sx, x) and torch.equal(sy, y)


def test_nccl_with_more_processes_than_devices_says_what_to_do(monkeypatch):
    from torch_sgn import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="start at most 1 processes per node, or pass"):
        distributed.init_from_env(backend="nccl")
