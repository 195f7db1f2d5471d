"""Signals to a running `ringmoe check` (a mesh job): every rank stops with it, quickly, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = [sys.executable, "-m", "ringmoe.cli", "check", "--preset", "small", "--seqlen", "32768", "--new-tokens", "64",
        "--no-check"]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found += [int(c) for c in text.split()]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def _start_demo_with_ranks(world: int = 4) -> tuple[subprocess.Popen, list[int]]:
    # SIGINT at its default, as a terminal starts a job: a child inherits an ignored SIGINT (Python then never
    # turns it into KeyboardInterrupt), and this test process may have been left ignoring it
    demo = subprocess.Popen(DEMO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = _children(demo.pid)
        if len(ranks) >= world:
            time.sleep(5.0)  # let the ranks get into their work (importing torch takes 5-8 s on a busy 2-core machine)
            return demo, _children(demo.pid)
        if demo.poll() is not None:
            break
        time.sleep(0.1)
    demo.kill()
    pytest.fail(f"the demo did not start {world} ranks: {demo.communicate()[1]}")


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_demo_stops_every_rank_within_seconds(signum, code):
    demo, ranks = _start_demo_with_ranks()
    try:
        sent = time.monotonic()
        demo.send_signal(signum)
        _, err = demo.communicate(timeout=15)
        elapsed = time.monotonic() - sent
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == code, err
    last = err.strip().splitlines()[-1]
    assert last == f"ringmoe check: interrupted by {signal.Signals(signum).name}; every rank was stopped", err
    assert "Traceback" not in err
    assert _wait_gone(ranks, 5) == [], "ranks left running"
    assert elapsed < 10, f"took {elapsed:.1f} s"


def test_ranks_die_with_a_killed_parent():
    demo, ranks = _start_demo_with_ranks()
    demo.kill()  # SIGKILL: no handler runs in the parent
    demo.wait(timeout=10)
    assert _wait_gone(ranks, 5) == [], "ranks outlived their parent"
