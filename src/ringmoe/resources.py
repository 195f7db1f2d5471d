"""Will a job fit?  Available memory, and a refusal that says what was needed and what there is.

Jobs estimate their memory (weights, KV cache, activations) before starting any
process and call ``require_memory``; a job that cannot fit is refused in one
line instead of dying late in the allocator.
"""

from __future__ import annotations

import os

__all__ = ["available_memory_bytes", "require_memory", "gib", "PROCESS_OVERHEAD_BYTES"]

# resident memory of a Python process with torch imported, before any tensor (measured: ~0.3 GiB)
PROCESS_OVERHEAD_BYTES = 350 * 2**20


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 / 10 else f"{nbytes / 2**20:,.0f} MiB"


def available_memory_bytes(device_type: str = "cpu") -> int:
    """Memory a new job can use now: MemAvailable on CPU (Linux), free device memory on CUDA."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def require_memory(what: str, parts: dict[str, float], available: int | None = None, headroom: float = 0.9,
                   advice: str = "") -> float:
    """Raise ValueError unless sum(parts) bytes fit in ``headroom`` of the available memory; return the sum.

    parts: named byte counts (e.g. weights, KV cache, activations), listed in the message.
    """
    need = float(sum(parts.values()))
    if available is None:
        available = available_memory_bytes()
    if need > headroom * available:
        detail = ", ".join(f"{name} {gib(value)}" for name, value in parts.items() if value)
        raise ValueError(f"{what} needs about {gib(need)} ({detail}) but {gib(available)} is available"
                         + (f"; {advice}" if advice else ""))
    return need
