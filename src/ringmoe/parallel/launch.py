"""Starting ranks: a local launcher for one machine, and torchrun's environment for many.

``spawn(fn, world_size)`` forks one process per rank, gives each a gloo (or
NCCL) process group on a free localhost port and one intra-op thread, runs
``fn(rank, world_size, *args)``, and returns the ranks' results in rank order.

It fails fast and leaves nothing behind:

- the first rank to fail (it raised, exited, was killed, or returned something
  that cannot be pickled) is named first in ``RankFailed``, with its traceback
  or its exit code / signal; the others are killed at once;
- with ``stall_timeout``, a job in which no rank reported progress (see
  ``watchdog.activity``) for that long is stopped, naming the rank that holds
  it up and what it was doing; ``timeout`` bounds the whole run the same way;
- SIGTERM or SIGINT to the launching process kills every rank before the
  exception (``JobInterrupted`` / KeyboardInterrupt) leaves ``spawn``; ranks die
  with their parent even if it is killed outright (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import watchdog

__all__ = ["spawn", "free_port", "init_from_env", "join_torchrun", "die_with_parent", "name_process",
           "process_alive", "RankFailed", "JobInterrupted"]


class RankFailed(RuntimeError):
    """A rank failed or the job stalled.  ``rank``: the rank named first (the cause); ``reason``: one line."""

    def __init__(self, message: str, rank: int | None = None, reason: str = ""):
        super().__init__(message)
        self.rank, self.reason = rank, reason or message.splitlines()[0]


class JobInterrupted(Exception):
    """The launching process got SIGTERM (SIGINT raises KeyboardInterrupt); every rank was stopped."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stack_files(world_size: int) -> tuple[dict[int, str], list[int], Path | None]:
    """Where each rank dumps its stack on SIGUSR1: ({rank: path}, descriptors to close, folder to delete).

    On Linux an anonymous in-memory file per rank (memfd), reached by every process as /proc/PID/fd/N:
    nothing exists on disk, so even a SIGKILLed launcher leaves nothing behind.  Elsewhere a temporary folder,
    deleted when the job stops."""
    if hasattr(os, "memfd_create") and Path(f"/proc/{os.getpid()}/fd").is_dir():
        fds = [os.memfd_create(f"ringmoe-rank{rank}-stack") for rank in range(world_size)]
        return {rank: f"/proc/{os.getpid()}/fd/{fd}" for rank, fd in enumerate(fds)}, fds, None
    folder = Path(tempfile.mkdtemp(prefix="ringmoe-stacks-"))
    return {rank: str(folder / f"rank{rank}.stack") for rank in range(world_size)}, [], folder


def name_process(name: str) -> None:
    """Name this process as ps, top and /proc/PID/comm show it (Linux keeps 15 characters)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    if Path("/proc/self/stat").exists():
        return watchdog.process_state(pid) not in (None, "Z", "X")
    try:  # no /proc: a signal 0 finds the process (a zombie too)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphaned ranks)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _rank_main(fn, rank, world_size, port, backend, threads, pg_timeout, args, writer, board, stack_file, parent):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; a terminal's Ctrl-C reaches it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)
    watchdog.install(board, rank, stack_file)
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps((True, value))
        except Exception as error:  # report it as this rank's failure, not a silent exit
            raise TypeError(f"fn returned a value that cannot be pickled ({type(value).__name__}): {error}") from None
        dist.destroy_process_group()
    except BaseException:  # report every failure, then exit non-zero
        writer.send_bytes(pickle.dumps((False, traceback.format_exc())))
        writer.close()
        os._exit(1)
    writer.send_bytes(payload)
    writer.close()
    os._exit(0)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == 0:
        return "exited with code 0 without returning a result"
    return f"exited with code {code} without reporting an error"


_COLLATERAL = ("Connection reset", "Connection closed", "connection closed", "Broken pipe", "DistBackendError",
               "gloo", "NCCL", "peer")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Job:
    """The parent's view of the ranks: processes, result pipes, the progress board."""

    def __init__(self, fn, world_size, args, backend, threads, pg_timeout):
        self.ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
        self.world_size = world_size
        self.board = watchdog.ProgressBoard(self.ctx, world_size)
        self.stack_files, self._stack_fds, self._stack_dir = _stack_files(world_size)
        port = free_port()
        self.readers, self.procs = [], []
        for rank in range(world_size):
            reader, writer = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, port, backend, threads, pg_timeout, args, writer, self.board,
                      self.stack_files[rank], os.getpid()),
                daemon=True,
            )
            self.readers.append(reader)
            self.procs.append((proc, writer))
        # Fork from a fresh thread: the child's only thread is then one that never ran an OpenMP
        # parallel region, so its first multi-threaded torch op builds a new thread team instead
        # of waiting forever on the parent's (libgomp is not fork-safe).  The thread lives until
        # the job stops: Linux sends PR_SET_PDEATHSIG when the forking *thread* exits.
        started, self.release = threading.Event(), threading.Event()

        errors = []

        def fork_and_wait():
            try:
                for proc, writer in self.procs:
                    self._start(proc, writer)
            except BaseException as error:  # e.g. fn cannot be pickled for a spawned (NCCL) rank
                errors.append(error)
            started.set()
            self.release.wait()

        threading.Thread(target=fork_and_wait, daemon=True, name="ringmoe-ranks").start()
        started.wait()
        self.procs = [p for p, _ in self.procs]
        self.values: dict[int, Any] = {}
        self.failures: list[tuple[int, str, str]] = []  # (rank, one-line reason, details) in arrival order
        if errors:
            self.stop(graceful=False)
            raise errors[0]

    @staticmethod
    def _start(proc, writer):
        proc.start()
        writer.close()  # the child holds the only writing end
        return proc

    @property
    def pending(self) -> list[int]:
        failed = {r for r, _, _ in self.failures}
        return [r for r in range(self.world_size) if r not in self.values and r not in failed]

    def _receive(self, rank: int) -> bool:
        """Read rank's report if one is there; False if none."""
        reader = self.readers[rank]
        try:
            if not reader.poll():
                return False
            ok, value = pickle.loads(reader.recv_bytes())
        except (EOFError, OSError):
            return False
        if ok:
            self.values[rank] = value
        else:
            self.failures.append((rank, _last_line(value), value))
        return True

    def poll(self, seconds: float) -> None:
        """Wait up to ``seconds`` for reports and exits; record them."""
        pending = self.pending
        handles = {self.readers[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
        for handle in wait(list(handles), timeout=seconds):
            rank = handles[handle]
            if rank not in self.pending:
                continue
            if self._receive(rank):
                continue
            proc = self.procs[rank]
            if handle == proc.sentinel or not proc.is_alive():
                proc.join(timeout=1)
                if not self._receive(rank):  # a report may land just before the exit is seen
                    reason = f"rank {rank} {_exit_reason(proc.exitcode)}"
                    self.failures.append((rank, reason, reason))

    def failure_report(self, grace: float = 0.5) -> RankFailed:
        """The first failing rank named first; other ranks' failures within ``grace`` seconds after it."""
        deadline = time.monotonic() + grace
        while self.pending and time.monotonic() < deadline:
            self.poll(max(0.0, deadline - time.monotonic()))
        # a rank failing on a broken connection is usually collateral damage of another rank's failure
        cause = next((f for f in self.failures if not any(c in f[2] for c in _COLLATERAL)), self.failures[0])
        rank, reason, details = cause
        headline = reason if reason.startswith(f"rank {rank} ") else f"rank {rank} failed: {reason}"
        lines = [headline]
        if details != reason:
            lines.append(details.rstrip())
        others = [f for f in self.failures if f is not cause]
        if others:
            lines.append("then: " + "; ".join(f"rank {r}: {_shorten(why)}" for r, why, _ in others))
        if self.pending:
            lines.append(f"stopped the other ranks: {self.pending}")
        return RankFailed("\n".join(lines), rank, headline)

    def stuck_report(self, why: str) -> RankFailed:
        pending = self.pending
        culprits, found = watchdog.diagnose({r: self.procs[r].pid for r in pending}, self.board, self.stack_files)
        first = [d for d in found if d.rank in culprits]
        rest = [d for d in found if d.rank not in culprits]
        headline = f"{why}: " + "; ".join(d.describe() for d in first)
        lines = [headline] + [f"  waiting: {d.describe()}" for d in rest]
        if self.values:
            lines.append(f"  finished: ranks {sorted(self.values)}")
        return RankFailed("\n".join(lines), culprits[0] if culprits else None, headline)

    def stop(self, graceful: bool) -> None:
        for proc in self.procs:
            if proc.pid is None:  # never started
                continue
            if graceful:
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()  # SIGKILL also ends a stopped process
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=5)
        for reader in self.readers:
            reader.close()
        self.release.set()
        for fd in self._stack_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)


@contextlib.contextmanager
def _signals_raise(forward_to=None):
    """In the main thread: SIGTERM raises JobInterrupted (SIGINT already raises KeyboardInterrupt).

    forward_to: a callable that, on the first SIGTERM, passes the signal on (a server rank that drains
    and then ends the job) instead; a second SIGTERM raises.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    forwarded = []

    def handler(signum, frame):
        if forward_to is not None and not forwarded:
            forwarded.append(signum)
            forward_to(signum)
            return
        raise JobInterrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    timeout: float | None = 300.0,
    stall_timeout: float | None = None,
    on_poll: Callable[[], None] | None = None,
    forward_sigterm_to: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return their results in rank order.

    fn (and, under NCCL, its arguments) must be picklable; results are pickled by value (tensors included).
    timeout: seconds for the whole run (None: no limit).  stall_timeout: seconds without a progress beat
    from any rank (None: off; ranks beat through ``ringmoe.parallel.watchdog.activity``).
    on_poll: called about every 0.1 s while the ranks run (e.g. to refresh a progress bar).
    forward_sigterm_to: a rank that handles SIGTERM itself (a server that drains): the first SIGTERM
    is sent on to it and the job may end normally; a second one stops every rank.
    Raises RankFailed naming the first failing or stuck rank, JobInterrupted on SIGTERM; every rank is
    stopped before spawn returns or raises.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    for name, value in (("timeout", timeout), ("stall_timeout", stall_timeout)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    pg_timeout = max(timeout or 0.0, 1800.0)
    start = time.monotonic()
    job = None

    def forward(signum):
        if job is not None and job.procs[forward_sigterm_to].pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.procs[forward_sigterm_to].pid, signum)

    with _signals_raise(forward if forward_sigterm_to is not None else None):
        try:
            job = _Job(fn, world_size, args, backend, threads_per_rank, pg_timeout)
            while job.pending:
                job.poll(0.1)
                if job.failures:
                    raise job.failure_report()
                if on_poll is not None:
                    on_poll()
                now = time.monotonic()
                if timeout is not None and now - start > timeout:
                    raise job.stuck_report(f"the job did not finish in {timeout:g} s")
                if stall_timeout is not None and now - job.board.last_beat() > stall_timeout:
                    raise job.stuck_report(f"no rank made progress for {stall_timeout:g} s")
        finally:
            if job is not None:
                job.stop(graceful=not job.failures and not job.pending)
    return [job.values[r] for r in range(world_size)]


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    backend None: NCCL when CUDA is available, else gloo.  Returns (rank, world_size).
    Raises ValueError when the variables are missing (not started by torchrun).
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"--launcher torchrun needs torchrun's environment; missing {', '.join(missing)} "
                         f"(start with: torchrun --nproc-per-node N -m ringmoe.cli ...)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def join_torchrun(cp: int, ep: int, ulysses: int = 1) -> tuple[int, int]:
    """``init_from_env`` for a cp x ep job: (rank, world size); ValueError unless torchrun started cp * ep processes.

    Across nodes (torchrun --nnodes N: LOCAL_WORLD_SIZE ranks per node, node-major) a Ulysses group, ulysses x ep
    consecutive ranks, must lie inside one node (its all-to-alls need the fast links; the ring crosses nodes):
    ValueError otherwise, before the process group is joined."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    span = ulysses * ep
    if ulysses > 1 and local and (span > local or local % span):
        raise ValueError(f"a Ulysses group (ulysses {ulysses} x ep {ep} = {span} consecutive ranks) must lie inside "
                         f"one node of {local} ranks: lower the Ulysses degree or start more ranks per node")
    rank, size = init_from_env()
    if size != cp * ep:
        raise ValueError(f"torchrun started {size} processes; --cp x --ep is {cp * ep}")
    return rank, size
