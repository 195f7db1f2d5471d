"""How fast a local job ends after a rank fails: raise, exit, SIGKILL, SIGSTOP/hang (stall watchdog).

Each rank records when it injects its fault; the figure is the time from that moment to spawn's
exception in the parent (for stalls: minus the stall timeout).  Writes benchmarks/results/faults.json.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from common import write_results
from ringmoe.parallel.launch import RankFailed, spawn
from ringmoe.parallel.watchdog import activity

WORLD, STALL = 4, 2.0


def faulty(rank, world, folder, fault):
    dist.barrier()
    if rank == world - 1:
        with open(os.path.join(folder, "t"), "w") as f:
            f.write(repr(time.time()))
        with activity(fault):
            if fault == "raise":
                raise RuntimeError("injected")
            if fault == "exit":
                os._exit(1)
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault == "hang":
                time.sleep(600)
    with activity("all_reduce"):
        dist.all_reduce(torch.ones(1))


def measure(fault: str) -> float:
    folder = tempfile.mkdtemp()
    try:
        spawn(faulty, WORLD, folder, fault, timeout=120, stall_timeout=STALL)
    except RankFailed:
        ended = time.time()
    with open(os.path.join(folder, "t")) as f:
        injected = float(f.read())
    return ended - injected - (STALL if fault in ("stop", "hang") else 0.0)


def main():
    rows = {}
    for fault in ("raise", "exit", "kill", "stop", "hang"):
        times = [measure(fault) for _ in range(5)]
        rows[fault] = {"median_s": statistics.median(times), "max_s": max(times)}
        print(fault, rows[fault])
    write_results("faults", {"world_size": WORLD, "stall_timeout_s": STALL, "note": "stop/hang: seconds after the "
                             "stall timeout; others: seconds from the fault to spawn raising", "faults": rows})


if __name__ == "__main__":
    main()
