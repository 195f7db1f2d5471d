"""How to split a sequence over a cp group: the ring, Ulysses, or the U x R hybrid, by their costs.

One attention layer's forward on one rank, for P = U x R ranks, N tokens per sequence, batch B, H query heads
and Hkv K/V heads (repeated to U when fewer; K/V heads a rank holds after the exchange: Kr = max(Hkv, U) / U),
qk width Dq and v width Dv, e bytes per element:

* compute: the sequence's visible causal pairs N (N + 1) / 2 x B x H x (2 Dq + 2 Dv) FLOPs, split evenly over
  the P ranks (balanced layouts: zigzag, striped), at the attention kernel's rate;
* Ulysses (U > 1): two all-to-alls in its group, q, k, v in (U - 1)/U x B (N/P) (H Dq + U Kr (Dq + Dv)) x e
  bytes sent per rank, the output back in (U - 1)/U x B (N/P) H Dv x e: (U - 1) latencies + bytes / (bandwidth x
  the profile's all-to-all efficiency, which ``ringmoe simulate --calibrate`` measures);
* the ring (R > 1): R steps, each sends one K/V block of B (N/R) Kr (Dq + Dv) x e bytes while the block in
  hand is computed, so a step costs max(compute / R, transfer) (the first one only its compute).

Links: ranks are numbered cp-major with ep innermost, and a Ulysses group is U x ep consecutive ranks, so it
stays inside a node when U x ep <= devices per node (its all-to-all runs over NVLink); the ring's neighbours
are U x ep ranks apart, so the ring crosses nodes (InfiniBand) once the cp group (P x ep ranks) outgrows one.
Ulysses sends a volume that does not grow with U; the ring's transfer hides behind compute only when blocks
are large enough.  So: Ulysses as wide as the heads and the node allow, the ring across nodes when blocks
are long enough to hide the slower link, which ``choose_sequence_parallel`` weighs for each shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.config import ModelConfig
from .hardware import Hardware

__all__ = ["SPCost", "sp_cost", "valid_ulysses_degrees", "choose_sequence_parallel", "auto_cp_mode"]


@dataclass(frozen=True)
class SPCost:
    """One factorization's forward attention on one rank: seconds and bytes sent."""

    ulysses: int
    ring: int
    compute_s: float
    all_to_all_s: float
    ring_s: float
    bytes_sent: float
    ulysses_in_node: bool
    ring_in_node: bool

    @property
    def seconds(self) -> float:
        return self.all_to_all_s + self.ring_s

    @property
    def mode(self) -> str:
        return "ring" if self.ulysses == 1 else ("ulysses" if self.ring == 1 else "usp")

    def as_dict(self) -> dict:
        return {"mode": self.mode, "ulysses": self.ulysses, "ring": self.ring, "seconds": self.seconds,
                "compute_s": self.compute_s, "all_to_all_s": self.all_to_all_s, "ring_s": self.ring_s,
                "bytes_sent": self.bytes_sent, "ulysses_in_node": self.ulysses_in_node,
                "ring_in_node": self.ring_in_node}


def valid_ulysses_degrees(cp: int, heads: int, kv_heads: int, node_ranks: int | None = None) -> list[int]:
    """Divisors U of cp that split the query heads, with K/V heads that split or repeat to U, and (node_ranks:
    a node's devices / ep) whose Ulysses group fits inside one node."""
    return [u for u in range(1, cp + 1) if cp % u == 0 and heads % u == 0 and (kv_heads % u == 0 or u % kv_heads == 0)
            and (node_ranks is None or u == 1 or node_ranks % u == 0)]


def _widths(config: ModelConfig) -> tuple[int, int]:
    return config.head_dim, (config.v_head_dim if config.mla else config.head_dim)


def sp_cost(config: ModelConfig, hw: Hardware, seqlen: int, cp: int, ulysses: int, batch: int = 1, ep: int = 1,
            element_bytes: int = 2) -> SPCost:
    """The forward cost of one attention layer on one rank under ulysses x (cp / ulysses)."""
    if cp % ulysses:
        raise ValueError(f"ulysses ({ulysses}) must divide cp ({cp})")
    ring = cp // ulysses
    heads, kv_heads = config.num_heads, config.num_kv_heads
    dq, dv = _widths(config)
    kr = max(kv_heads, ulysses) / ulysses  # K/V heads a rank holds after the exchange
    pairs = seqlen * (seqlen + 1) / 2
    compute = batch * heads * pairs * (2 * dq + 2 * dv) / cp / hw.attention_flops
    local = seqlen / cp
    ulysses_in_node = ulysses * ep <= hw.devices_per_node
    ring_in_node = cp * ep <= hw.devices_per_node
    sent, all_to_all = 0.0, 0.0
    if ulysses > 1:
        share = (ulysses - 1) / ulysses
        bandwidth, latency = hw.link(ulysses_in_node)
        bandwidth *= hw.alltoall_efficiency  # calibrated: what an all-to-all reaches over the link
        for volume in (heads * dq + ulysses * kr * (dq + dv), heads * dv):  # q, k, v in; out back
            nbytes = share * batch * local * volume * element_bytes
            sent += nbytes
            all_to_all += (ulysses - 1) * latency + nbytes / bandwidth
    if ring > 1:
        block = batch * (seqlen / ring) * kr * (dq + dv) * element_bytes
        transfer = hw.transfer_time(block, ring_in_node)
        step = compute / ring
        ring_time = step + (ring - 1) * max(step, transfer)
        sent += (ring - 1) * block
    else:
        ring_time = compute
    return SPCost(ulysses, ring, compute, all_to_all, ring_time, sent, ulysses_in_node, ring_in_node)


def choose_sequence_parallel(config: ModelConfig, hw: Hardware, seqlen: int, cp: int, batch: int = 1, ep: int = 1,
                             element_bytes: int = 2) -> tuple[SPCost, list[SPCost], str]:
    """(the fastest factorization, every valid one, a sentence saying why).  Ulysses groups stay inside a node
    (their all-to-alls need its links; ``join_torchrun`` refuses groups that span nodes): the ring crosses them."""
    node_ranks = max(1, hw.devices_per_node // ep)
    degrees = valid_ulysses_degrees(cp, config.num_heads, config.num_kv_heads, node_ranks)
    costs = [sp_cost(config, hw, seqlen, cp, u, batch, ep, element_bytes) for u in degrees]
    best = min(costs, key=lambda c: (c.seconds, c.ulysses))
    others = ", ".join(f"{c.ulysses}x{c.ring} {c.seconds * 1e3:.3g} ms" for c in costs if c is not best)
    links = []
    if best.ulysses > 1:
        links.append(f"Ulysses over {'the node' if best.ulysses_in_node else 'nodes'} "
                     f"({best.all_to_all_s * 1e3:.3g} ms of all-to-all)")
    if best.ring > 1:
        exposed = best.ring_s - best.compute_s
        links.append(f"the ring {'inside the node' if best.ring_in_node else 'across nodes'} "
                     f"({exposed * 1e3:.3g} ms of transfer not hidden)")
    by_heads = max(valid_ulysses_degrees(cp, config.num_heads, config.num_kv_heads))
    capped = ("" if cp in degrees else f"; Ulysses is capped at {max(degrees)} by "
              + (f"{config.num_heads} heads" if by_heads <= max(degrees) else f"the node ({node_ranks} ranks)"))
    reason = (f"ulysses {best.ulysses} x ring {best.ring} ({best.mode}): {best.seconds * 1e3:.3g} ms per layer forward "
              f"on {hw.name}, {', '.join(links) or 'no communication'}{capped}"
              + (f"; others: {others}" if others else ""))
    return best, costs, reason


def auto_cp_mode(config: ModelConfig, hw: Hardware, seqlen: int, cp: int, batch: int = 1,
                 ep: int = 1) -> tuple[str, int | None, str]:
    """``--cp-mode auto``: (cp mode, --ulysses-degree or None, why) of the fastest factorization."""
    best, _, reason = choose_sequence_parallel(config, hw, seqlen, cp, batch, ep)
    return best.mode, (best.ulysses if best.mode == "usp" else None), reason
