"""Calibration: fit a Hardware profile to timings measured on this machine.

Each resource is a line, time = fixed cost + amount / rate, fitted by least
squares over a few sizes: GEMMs (FLOPs), the attention kernel (FLOPs over
visible pairs), a memory copy (bytes), a ping-pong between two local gloo
ranks (bytes one way = round trip / 2), and an all-to-all between them (bytes each
rank sends its peer: its rate over the ping-pong's is the all-to-all efficiency).  ``synthetic_measurements`` produces
the timings a given profile implies, so fitting them must give the profile back.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..attention import flash_attn_func
from ..parallel.launch import spawn
from .hardware import Hardware

__all__ = ["median_seconds", "Measurements", "fit_line", "profile_from_measurements", "synthetic_measurements", "measure",
           "calibrate_this_machine"]


@dataclass
class Measurements:
    """(amount, seconds) pairs: FLOPs for matmul/attention, bytes for copy and link (one way)."""

    matmul: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    copy: list = field(default_factory=list)
    link: list = field(default_factory=list)
    causal: list = field(default_factory=list)  # (visible-pair FLOPs, seconds) of causal attention
    all_to_all: list = field(default_factory=list)  # (bytes each rank sends its peers, seconds)
    call: float = 0.0  # seconds of a 16 x 16 matmul: the fixed cost of one kernel call


def fit_line(points) -> tuple[float, float]:
    """Least-squares (slope, intercept) of seconds against amount."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        raise ValueError("calibration needs at least two different sizes")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return slope, my - slope * mx


def profile_from_measurements(m: Measurements, name: str = "this-machine") -> Hardware:
    """One machine: every 'device' (rank) shares the node, so intra- and inter-node links are the same."""
    mm_slope, _ = fit_line(m.matmul)
    at_slope, _ = fit_line(m.attention)
    causal_slope, _ = fit_line(m.causal)
    copy_slope, _ = fit_line(m.copy)
    link_slope, link_fixed = fit_line(m.link)
    all_to_all_efficiency = link_slope / fit_line(m.all_to_all)[0] if m.all_to_all else 1.0
    return Hardware(
        name=name, matmul_flops=1 / mm_slope, attention_flops=1 / at_slope, memory_bandwidth=1 / copy_slope,
        intra_bandwidth=1 / link_slope, intra_latency=max(link_fixed, 0.0),
        inter_bandwidth=1 / link_slope, inter_latency=max(link_fixed, 0.0),
        devices_per_node=1 << 20, memory_bytes=0.0, kernel_overhead=max(m.call - 2 * 16**3 * mm_slope, 0.0),
        causal_efficiency=at_slope / causal_slope, alltoall_efficiency=all_to_all_efficiency,
    )


# the GEMM shapes of projections and experts (rows x inner x outer): wide and narrow ones, so the one fitted
# rate averages over both (a narrow inner dimension runs slower on CPUs)
MATMUL_SHAPES = ((1024, 512, 2048), (2048, 512, 2048), (4096, 512, 2048), (1024, 1024, 512), (2048, 256, 1024))


def synthetic_measurements(hw: Hardware) -> Measurements:
    """The timings ``hw`` predicts for the sizes ``measure`` uses."""
    m = Measurements(call=hw.kernel_overhead + 2 * 16**3 / hw.matmul_flops)
    for rows, inner, outer in MATMUL_SHAPES:
        flops = 2 * rows * inner * outer
        m.matmul.append((flops, hw.kernel_overhead + flops / hw.matmul_flops))
    for n in (1024, 2048, 4096):
        flops = 4 * 64 * 8 * n * n
        m.attention.append((flops, hw.kernel_overhead + flops / hw.attention_flops))
        visible = 4 * 64 * 8 * n * (n + 1) // 2
        m.causal.append((visible, hw.kernel_overhead + visible / (hw.attention_flops * hw.causal_efficiency)))
    for mib in (64, 128, 256):
        nbytes = 2 * mib * 2**20
        m.copy.append((nbytes, nbytes / hw.memory_bandwidth))
    for nbytes in (2**16, 2**20, 2**22, 2**24):
        m.link.append((nbytes, hw.intra_latency + nbytes / hw.intra_bandwidth))
        m.all_to_all.append((nbytes, hw.intra_latency + nbytes / (hw.intra_bandwidth * hw.alltoall_efficiency)))
    return m


def median_seconds(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ping_pong(rank: int, world: int, sizes: list[int], repeats: int) -> list:
    """Round trips of each size between ranks 0 and 1; one-way seconds = round trip / 2."""
    results = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        samples = []
        for _ in range(repeats + 1):
            dist.barrier()  # ranks beyond 0 and 1 only keep the barrier
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            samples.append((time.perf_counter() - start) / 2)
        results.append((nbytes, statistics.median(samples[1:])))
    return results


def _all_to_all(world: int, sizes: list[int], repeats: int) -> list:
    """All-to-alls over every rank in which each sends ``nbytes`` to each peer (Ulysses's exchange)."""
    results = []
    for nbytes in sizes:
        send = torch.zeros(world * (nbytes // 4))
        recv = torch.empty_like(send)
        samples = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(recv, send)
            samples.append(time.perf_counter() - start)
        results.append((nbytes * (world - 1), statistics.median(samples[1:])))
    return results


def _measure_rank(rank: int, world: int, repeats: int) -> Measurements:
    """Every rank times the same kernels at once (as in a parallel run, where ranks share the machine)."""

    def timed(fn):
        dist.barrier()
        return median_seconds(fn, repeats)

    m = Measurements()
    small = torch.randn(16, 16)
    m.call = timed(lambda: small @ small)
    for rows, inner, outer in MATMUL_SHAPES:
        a, b = torch.randn(rows, inner), torch.randn(inner, outer)
        m.matmul.append((2 * rows * inner * outer, timed(lambda: a @ b)))
    for n in (1024, 2048, 4096):
        q, k, v = (torch.randn(1, n, 8, 64) for _ in range(3))
        m.attention.append((4 * 64 * 8 * n * n, timed(lambda: flash_attn_func(q, k, v))))
        m.causal.append((4 * 64 * 8 * n * (n + 1) // 2, timed(lambda: flash_attn_func(q, k, v, causal=True))))
    for mib in (64, 128, 256):
        src = torch.ones(mib * 2**18)
        dst = torch.empty_like(src)
        m.copy.append((2 * mib * 2**20, timed(lambda: dst.copy_(src))))
    m.link = _ping_pong(rank, world, [2**16, 2**20, 2**22, 2**24], repeats)
    m.all_to_all = _all_to_all(world, [2**16, 2**20, 2**22, 2**24], repeats)
    return m


def measure(ranks: int = 2, threads: int = 1, repeats: int = 5) -> Measurements:
    """Time this machine as ``ranks`` local gloo ranks with ``threads`` intra-op threads each
    (the benchmarks' setting: 2 ranks x 1 thread on 2 cores); rank 0's timings."""

    return spawn(_measure_rank, ranks, repeats, threads_per_rank=threads, timeout=600)[0]


def calibrate_this_machine(ranks: int = 2, threads: int = 1, repeats: int = 5) -> Hardware:
    return profile_from_measurements(measure(ranks, threads, repeats))
