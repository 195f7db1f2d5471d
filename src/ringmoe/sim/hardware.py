"""Hardware profiles: what one device computes and how fast its links move bytes.

Rates are *achieved* rates (what kernels and collectives reach), not datasheet
peaks; each built-in profile says where its numbers come from.  A link moves
``bytes`` in ``latency + bytes / bandwidth`` seconds; devices of one node talk
over the intra-node link (NVLink), others over the inter-node one (InfiniBand).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..jsonio import read_json

__all__ = ["Hardware", "PROFILES", "hardware_profile"]


@dataclass(frozen=True)
class Hardware:
    """One device and its links.  Units: FLOP/s, bytes/s, seconds, bytes."""

    name: str
    matmul_flops: float        # dense GEMM rate (projections, experts)
    attention_flops: float     # attention kernel rate, counting 4 * head_dim FLOPs per visible (query, key) pair
    memory_bandwidth: float    # device memory, for memory-bound steps (merges)
    intra_bandwidth: float     # per device and direction, inside a node
    intra_latency: float
    inter_bandwidth: float     # per device and direction, between nodes
    inter_latency: float
    devices_per_node: int = 8
    memory_bytes: float = 80e9
    kernel_overhead: float = 5e-6  # fixed cost of one kernel call
    causal_efficiency: float = 1.0  # per-pair rate of masked (diagonal) blocks / attention_flops
    alltoall_efficiency: float = 1.0  # bytes/s a device reaches in an all-to-all / its link's point-to-point rate

    def link(self, same_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) between two devices."""
        return (self.intra_bandwidth, self.intra_latency) if same_node else (self.inter_bandwidth, self.inter_latency)

    def transfer_time(self, nbytes: float, same_node: bool) -> float:
        if nbytes <= 0:
            return 0.0
        bandwidth, latency = self.link(same_node)
        return latency + nbytes / bandwidth

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Hardware":
        """A profile from JSON; ValueError naming the file and the fields when it is not one."""
        data = read_json(Path(path))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        unknown = [n for n in data if n not in fields]
        if missing or unknown:
            raise ValueError(f"{str(path)!r} is not a hardware profile (write one with ringmoe simulate --calibrate): "
                             + "; ".join(p for p in (f"missing {missing}" if missing else "",
                                                     f"unknown {unknown}" if unknown else "") if p))
        bad = [n for n, v in data.items() if n != "name" and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                                or not v >= 0)]
        if bad:
            raise ValueError(f"{str(path)!r}: fields {bad} must be numbers >= 0")
        return cls(**data)


_H100 = dict(
    # bf16: 989 TFLOP/s dense peak; ~70% in large GEMMs, ~55% in causal FlashAttention forward (FA3-class kernels)
    matmul_flops=690e12, attention_flops=550e12, memory_bandwidth=3.35e12 * 0.9,
    # NVLink 4: 450 GB/s per direction, ~80% reached by NCCL; ConnectX-7 400 Gb/s = 50 GB/s per GPU, ~90% reached
    intra_bandwidth=360e9, intra_latency=5e-6, inter_bandwidth=45e9, inter_latency=10e-6,
    devices_per_node=8, memory_bytes=80e9,
    causal_efficiency=0.9,  # masked diagonal tiles are partly wasted
)

PROFILES: dict[str, Hardware] = {
    "h100": Hardware(name="h100", **_H100),
    # same compute as H100, HBM3e 4.8 TB/s and 141 GB
    "h200": Hardware(name="h200", **{**_H100, "memory_bandwidth": 4.8e12 * 0.9, "memory_bytes": 141e9}),
    # H800: NVLink cut to ~160 GB/s (DeepEP's stated maximum), CX7 400 Gb/s RDMA ~50 GB/s
    "h800": Hardware(name="h800", **{**_H100, "intra_bandwidth": 160e9, "inter_bandwidth": 50e9}),
}


def hardware_profile(name_or_path: str) -> Hardware:
    """A built-in profile by name, or a JSON file written by ``ringmoe simulate --calibrate``."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.is_file():
        return Hardware.load(path)
    raise ValueError(f"hw must be one of {sorted(PROFILES)} or a profile JSON file, got {name_or_path!r}")
