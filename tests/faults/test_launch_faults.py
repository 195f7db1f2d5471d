"""Fault injection into local ranks: every failure ends the job within seconds, names the rank, leaves no process.

Each rank writes its PID to a file first, so the test can check afterwards that none is left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from ringmoe.parallel.launch import RankFailed, spawn
from ringmoe.parallel.watchdog import activity

WORLD = 3


def _record_pid(folder: str, rank: int) -> None:
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _pids(folder) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("rank*.pid"))]


def _assert_no_process_left(folder) -> None:
    pids = _pids(folder)
    assert len(pids) == WORLD
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: not even a zombie


def _faulty(rank, world, folder, fault):
    _record_pid(folder, rank)
    with activity("warm-up barrier"):
        dist.barrier()
    if rank == 1:
        with activity(f"layer 2 {fault}"):
            if fault == "raise":
                raise ZeroDivisionError("rank one divided by zero")
            if fault == "exit":
                os._exit(3)
            if fault == "exit0":
                os._exit(0)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault == "hang":
                time.sleep(600)
            if fault == "junk":
                return lambda: None  # not picklable
    with activity("final all_reduce"):
        x = torch.ones(1)
        dist.all_reduce(x)
    return torch.full((2,), float(rank))  # a tensor travels by value


@pytest.mark.parametrize("fault, expected", [
    ("raise", "rank 1 failed: ZeroDivisionError: rank one divided by zero"),
    ("exit", "rank 1 exited with code 3"),
    ("exit0", "rank 1 exited with code 0 without returning a result"),
    ("kill", "rank 1 was killed by SIGKILL"),
    ("junk", "rank 1 failed: TypeError: fn returned a value that cannot be pickled"),
])
def test_a_failing_rank_is_named_first_and_nothing_is_left(tmp_path, fault, expected):
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        spawn(_faulty, WORLD, str(tmp_path), fault, timeout=60)
    elapsed = time.monotonic() - start
    assert failure.value.rank == 1
    assert str(failure.value).startswith(expected), str(failure.value)
    assert elapsed < 20, f"took {elapsed:.1f} s"
    _assert_no_process_left(tmp_path)


@pytest.mark.parametrize("fault, state", [("stop", "stopped (SIGSTOP"), ("hang", "time.sleep(600)")])
def test_a_stuck_rank_is_named_with_what_it_was_doing(tmp_path, fault, state):
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        spawn(_faulty, WORLD, str(tmp_path), fault, timeout=120, stall_timeout=2)
    elapsed = time.monotonic() - start
    report = str(failure.value)
    headline = report.splitlines()[0]
    assert failure.value.rank == 1, report
    assert headline.startswith("no rank made progress for 2 s: rank 1 "), report
    assert state in headline and f"layer 2 {fault}" in headline, report
    # the healthy ranks are reported as waiting in the collective the stuck rank never reached
    assert "waiting: rank 0" in report and "all_reduce" in report, report
    assert elapsed < 20, f"took {elapsed:.1f} s"
    _assert_no_process_left(tmp_path)


def test_the_overall_timeout_names_only_the_unfinished_rank(tmp_path):
    with pytest.raises(RankFailed) as failure:
        spawn(_faulty, WORLD, str(tmp_path), "hang", timeout=4)
    report = str(failure.value)
    assert report.startswith("the job did not finish in 4 s: rank 1 "), report
    _assert_no_process_left(tmp_path)


def test_healthy_ranks_return_tensors_in_rank_order(tmp_path):
    values = spawn(_faulty, WORLD, str(tmp_path), "none", timeout=60, stall_timeout=30)
    assert [v.tolist() for v in values] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    _assert_no_process_left(tmp_path)


def test_bad_launcher_arguments_are_refused():
    with pytest.raises(ValueError, match="stall_timeout"):
        spawn(_faulty, 2, "/tmp", "none", stall_timeout=0)
    with pytest.raises(ValueError, match="world_size"):
        spawn(_faulty, 0, "/tmp", "none")


def _threaded_work(rank, world):
    return float((torch.randn(400, 400) @ torch.randn(400, 400)).shape[0] + torch.randn(2000, 2000).sum() * 0)


def test_ranks_with_threads_do_not_hang_after_the_parent_used_openmp():
    """libgomp is not fork-safe: a child forked from a thread that ran an OpenMP team waits on it forever."""
    x = torch.randn(1500, 1500)
    (x @ x).sum()  # the parent's main thread now owns an OpenMP team
    assert spawn(_threaded_work, 2, threads_per_rank=2, timeout=30, stall_timeout=20) == [400.0, 400.0]
