"""Progress of local ranks, and what a stuck rank was doing.

A rank marks what it is doing with ``activity(label)``: a context manager whose
labels nest ("decode step 3 > layer 2 > moe dispatch").  Entering or leaving one
is a *beat*: it bumps the rank's counter, stamps the time and writes the label
stack into a ``ProgressBoard``, a few bytes of shared memory the launcher made
before forking.  Outside a launcher (one process, torchrun) no board is
installed and ``activity`` costs one attribute check.

The launcher reads the board: when no rank has beaten for ``stall_timeout``
seconds the job is stuck, and ``diagnose`` names the rank that holds it up:

1. a rank whose process is stopped (SIGSTOP, a debugger) or gone;
2. else a rank that is *not* blocked in a collective while others are (it never
   reached the collective they wait in: a deadlock or an endless loop);
3. else the ranks with the fewest beats (they are behind).

Where each rank is blocked comes from its Python stack, which ``faulthandler``
writes to a file when the launcher sends SIGUSR1 (a stopped process cannot
answer; its state in /proc says so instead).
"""

from __future__ import annotations

import contextlib
import faulthandler
import linecache
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProgressBoard", "activity", "install", "diagnose", "RankDiagnosis"]

LABEL_BYTES = 160


class ProgressBoard:
    """Per-rank beat counters, beat times and label stacks in shared memory (made by the parent)."""

    def __init__(self, ctx, world_size: int):
        self.world_size = world_size
        self.counts = ctx.Array("q", world_size, lock=False)
        self.times = ctx.Array("d", world_size, lock=False)
        self.labels = ctx.Array("c", world_size * LABEL_BYTES, lock=False)
        now = time.monotonic()
        for rank in range(world_size):
            self.times[rank] = now

    def beat(self, rank: int, label: str) -> None:
        data = label.encode("utf-8", "replace")[: LABEL_BYTES - 1].ljust(LABEL_BYTES, b"\0")
        self.labels[rank * LABEL_BYTES:(rank + 1) * LABEL_BYTES] = data
        self.counts[rank] += 1
        self.times[rank] = time.monotonic()

    def label(self, rank: int) -> str:
        raw = bytes(self.labels[rank * LABEL_BYTES:(rank + 1) * LABEL_BYTES])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def last_beat(self) -> float:
        """monotonic time of the most recent beat of any rank (the start if none)."""
        return max(self.times[:])


class _Local:
    board: ProgressBoard | None = None
    rank: int = 0
    stack: list[str] = []


def install(board: ProgressBoard, rank: int, stack_file: str | None = None) -> None:
    """In a rank process: report beats to ``board``; dump the Python stack to ``stack_file`` on SIGUSR1."""
    _Local.board, _Local.rank, _Local.stack = board, rank, []
    board.beat(rank, "started")
    if stack_file is not None:
        handle = open(stack_file, "w")  # kept open for the process's life: faulthandler writes to its fd
        faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True, chain=False)


@contextlib.contextmanager
def activity(label: str):
    """Mark what this rank does inside the block (nested labels join with ' > ')."""
    board = _Local.board
    if board is None:
        yield
        return
    _Local.stack.append(label)
    board.beat(_Local.rank, " > ".join(_Local.stack))
    try:
        yield
    finally:
        _Local.stack.pop()
        board.beat(_Local.rank, " > ".join(_Local.stack) + " (done)" if _Local.stack else f"{label} (done)")


# -- diagnosis (in the parent) ----------------------------------------------------------

_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a tracer", "Z": "exited (zombie)",
           "X": "exited", "D": "in uninterruptible I/O"}


def process_state(pid: int) -> str | None:
    """One letter of /proc/PID/stat (R running, S sleeping, T stopped, Z zombie...), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass
class RankDiagnosis:
    rank: int
    pid: int
    state: str | None
    label: str
    beats: int
    frames: list[tuple[str, int, str]]  # (file, line, function), innermost first

    @property
    def stopped(self) -> bool:
        return self.state in (None, "T", "t", "Z", "X")

    @property
    def in_collective(self) -> bool:
        """Blocked in torch.distributed (a collective, a send/recv or waiting on one)."""
        for file, line, _ in self.frames[:3]:
            if "torch/distributed" in file or ".wait(" in linecache.getline(file, line):
                return True
        return False

    def where(self) -> str:
        if self.stopped:
            return _STATES.get(self.state or "X", f"state {self.state}")
        if not self.frames:
            return "no stack (the process did not answer SIGUSR1)"
        parts = []
        collectives = [f[2] for f in self.frames if "torch/distributed" in f[0] and f[2] != "wrapper"]
        if collectives:
            parts.append(f"in {collectives[0]}")
        own = next((f for f in self.frames if "/torch/" not in f[0] and "/multiprocessing/" not in f[0]), None)
        if own is not None:
            file, line, func = own
            code = linecache.getline(file, line).strip()
            parts.append(f"at {Path(file).name}:{line} in {func}" + (f" ({code})" if code else ""))
        return ", ".join(parts)

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) {self.where()}; last activity: {self.label or 'none'!r}"


def _read_frames(stack_file: Path) -> list[tuple[str, int, str]]:
    try:
        text = stack_file.read_text()
    except OSError:
        return []
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text) if b.strip()]
    if not blocks:
        return []
    last = blocks[-1]  # the newest dump
    return [(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(last)]


def diagnose(ranks: dict[int, int], board: ProgressBoard, stack_files: dict[int, str] | None,
             answer_s: float = 0.5) -> tuple[list[int], list[RankDiagnosis]]:
    """(culprits, every rank's diagnosis) for the unfinished ``ranks`` {rank: pid}; stack_files: the file each
    rank dumps its stack into on SIGUSR1."""
    for pid in ranks.values():
        if process_state(pid) not in (None, "T", "t", "Z", "X") and stack_files is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
    if stack_files is not None:
        time.sleep(answer_s)
    found = []
    for rank, pid in sorted(ranks.items()):
        frames = _read_frames(Path(stack_files[rank])) if stack_files is not None else []
        found.append(RankDiagnosis(rank, pid, process_state(pid), board.label(rank), board.counts[rank], frames))
    culprits = [d.rank for d in found if d.stopped]
    if not culprits:
        waiting = [d for d in found if d.in_collective]
        if waiting:
            culprits = [d.rank for d in found if not d.in_collective]
    if not culprits and found:
        fewest = min(d.beats for d in found)
        culprits = [d.rank for d in found if d.beats == fewest]
    return culprits, found
