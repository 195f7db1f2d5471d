"""Starting ranks: a local launcher for one machine, and torchrun's environment for many.

``spawn(fn, world_size)`` forks one process per rank, gives each a gloo (or
NCCL) process group on a free localhost port and one intra-op thread, runs
``fn(rank, world_size, *args)``, and returns the ranks' results in rank order.
If any rank raises, the whole run fails with that rank's traceback and the
other ranks are killed: nothing hangs past ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["spawn", "free_port", "init_from_env", "RankFailed"]


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, backend, threads, timeout, args, results):
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report every failure, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()  # flush the report before the hard exit
        os._exit(1)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return their results.

    fn and its results must be picklable.  Raises RankFailed with the first
    failing rank's traceback, or TimeoutError after ``timeout`` seconds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, backend, threads_per_rank, timeout, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(values))} did not finish in {timeout}s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    report = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
                    raise RankFailed(_failure_report(dead[0], report, results))
                continue
            if not ok:
                raise RankFailed(_failure_report(rank, value, results))
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]


def _failure_report(rank: int, trace: str, results, grace: float = 2.0) -> str:
    """The first failure, plus any other rank's report that arrives within ``grace`` seconds.

    The first rank to fail is usually the cause; the others tend to fail on the
    broken connection right after it.
    """
    reports = [f"rank {rank} failed:\n{trace}"]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            other, ok, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not ok:
            reports.append(f"rank {other} failed too:\n{value}")
    return "\n".join(reports)


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    backend None: NCCL when CUDA is available, else gloo.  Returns (rank, world_size).
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"not launched by torchrun: missing {', '.join(missing)}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()
