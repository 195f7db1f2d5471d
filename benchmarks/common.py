"""Shared benchmark plumbing: median timing, peak-memory sampling, results I/O."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from ringmoe.sim.calibrate import median_seconds as median_time  # noqa: F401  (re-exported for the benchmarks)

RESULTS = Path(__file__).resolve().parent / "results"
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of resident memory (Linux: 5 > /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """Resident high-water mark since the last reset (VmHWM in /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def measure_in_subprocess(module: str, *args: str) -> dict:
    """Run ``python benchmarks/<module>.py --probe args...`` in a fresh process; parse its JSON line.

    A fresh process is the only reliable way to read a peak of CPU memory:
    ru_maxrss never decreases, and freed blocks are reused without new pages.
    """
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / f"{module}.py"
    result = subprocess.run(
        [sys.executable, str(script), "--probe", *args], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def environment() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_results(name: str, payload: dict, plot=None, plot_data=None) -> Path:
    """results/<name>.json (with the environment), and results/<name>.png drawn by plot(plot_data, path)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if plot is not None:
        plot(plot_data, RESULTS / f"{name}.png")
    print(f"wrote {path}")
    return path


def pyplot():
    """matplotlib.pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
