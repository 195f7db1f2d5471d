"""A SIGKILLed mesh server leaves nothing behind: no engine process, rank, front end or template worker, nothing in
the temp directory."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("httpx")

from ..served import Server, alive, children  # noqa: E402


def test_sigkill_of_the_launcher_leaves_no_process_and_no_temp_files(served_checkpoint, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    s = Server(served_checkpoint, 2, 1, env={"TMPDIR": str(temp)})
    try:
        ranks, frontends = s.ranks(), s.frontends()
        workers = [pid for front in frontends for pid in children(front)]  # the front end's chat-template processes
        assert len(ranks) == 2 and len(frontends) == 1 and len(workers) == 2
        ranks += [s.engine_process()] + frontends
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in ranks + workers):
            time.sleep(0.1)
        assert not any(alive(p) for p in ranks + workers)
        assert list(temp.iterdir()) == []
    finally:
        s.stop()
