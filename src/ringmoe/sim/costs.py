"""Closed forms: FLOPs, bytes and memory of one transformer layer on a cp x ep mesh.

Attention work is counted in visible (query, key) pairs, taken from the same
ring planner the implementation runs (``parallel.ring.plan_block``), so each
layout's causal imbalance is exact.  Forward attention costs 4 * head_dim
FLOPs per pair and head (Q K^T and P V, a multiply-add each).
"""

from __future__ import annotations

import math

from ..model.config import ModelConfig
from ..parallel.layout import segments
from ..parallel.ring import plan_block

__all__ = ["visible_pairs", "ring_step_pairs", "kv_block_bytes", "rank_shares", "rows_to_rank",
           "expert_flops_per_assignment", "projection_flops_per_token", "min_tokens_for_overlap", "memory_per_rank"]


def visible_pairs(nq: int, nk: int, offset: int | None) -> int:
    """Pairs (i, j), i < nq, j < nk, with j <= i + offset (all of them when offset is None)."""
    if offset is None:
        return nq * nk
    # row i sees clamp(i + offset + 1, 0, nk) keys: zero, then a ramp, then nk
    ramp_start = max(0, -offset)
    ramp_stop = min(nq, max(ramp_start, nk - offset - 1))
    ramp = sum_range(ramp_start + offset + 1, ramp_stop + offset + 1)
    full = max(0, nq - ramp_stop) * nk if ramp_stop >= ramp_start else 0
    return ramp + full


def sum_range(a: int, b: int) -> int:
    """a + (a + 1) + ... + (b - 1)."""
    return (b - a) * (a + b - 1) // 2 if b > a else 0


def ring_step_pairs(seqlen: int, cp: int, rank: int, step: int, layout: str, causal: bool = True) -> tuple[int, int, int]:
    """(visible pairs in unmasked calls, visible pairs in masked calls, kernel calls) of ``rank`` at
    ring step ``step`` (the block of rank - step), per sequence and head."""
    local = seqlen // cp
    tasks = plan_block(segments(local, cp, rank, layout), segments(local, cp, (rank - step) % cp, layout), causal)
    full = sum(visible_pairs(t.q1 - t.q0, t.k1 - t.k0, None) for t in tasks if not t.masked)
    masked = sum(visible_pairs(t.q1 - t.q0, t.k1 - t.k0, t.hi) for t in tasks if t.masked)  # causal: right edge hi
    return full, masked, len(tasks)


def kv_block_bytes(config: ModelConfig, batch: int, local_tokens: int, element_bytes: int) -> int:
    """One rank's K and V for one layer: what travels per ring step (MLA: each token's latent and RoPE key)."""
    if config.mla:
        return batch * local_tokens * (config.kv_lora_rank + config.qk_rope_head_dim) * element_bytes
    return 2 * batch * local_tokens * config.num_kv_heads * config.head_dim * element_bytes


def projection_flops_per_token(config: ModelConfig) -> int:
    """Q, K, V and O projections of one token (2 FLOPs per multiply-add)."""
    return 2 * config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)


def expert_flops_per_assignment(config: ModelConfig) -> int:
    """One (token, expert) pair through a SwiGLU expert: gate, up and down matmuls."""
    return 2 * 3 * config.hidden_size * config.ffn_size


def rank_shares(ep: int, skew: float) -> list[float]:
    """Fraction of all routing assignments that land on each ep rank.

    skew = max/mean load: the first rank takes skew / ep, the others split the rest evenly.
    """
    if not 1.0 <= skew <= ep:
        raise ValueError(f"skew (max/mean rank load) must be in [1, ep={ep}], got {skew}")
    if ep == 1:
        return [1.0]
    hot = skew / ep
    return [hot] + [(1.0 - hot) / (ep - 1)] * (ep - 1)


def _log_choose(n: float, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def rows_to_rank(tokens: float, num_experts: int, top_k: int, share: float) -> float:
    """Expected tokens that pick at least one expert on a rank holding ``share`` of the routing mass.

    A token's top_k experts drawn without replacement from num_experts, the rank
    holding share * num_experts of them: 1 - C(E - share E, k) / C(E, k) of the
    tokens travel there (one row per token and destination rank).
    """
    others = num_experts * (1.0 - share)
    if others < top_k:
        return float(tokens)
    miss = math.exp(_log_choose(others, top_k) - _log_choose(num_experts, top_k))
    return tokens * (1.0 - miss)


def min_tokens_for_overlap(config: ModelConfig, hw, batch: int, element_bytes: int, same_node: bool,
                           visible_fraction: float = 0.5) -> float:
    """Smallest tokens per rank n at which a ring step's compute covers its K/V transfer.

    compute(n) = overhead + f * n^2 * 4 D H_q B / R_attn   (f: visible fraction of a block; 1/2 for zigzag causal)
    transfer(n) = latency + 2 B n H_kv D bytes / bandwidth
    compute >= transfer  <=>  a n^2 - b n - c >= 0 with the constants below; n = (b + sqrt(b^2 + 4ac)) / 2a.
    """
    bandwidth, latency = hw.link(same_node)
    a = visible_fraction * 4 * config.head_dim * config.num_heads * batch / hw.attention_flops
    b = 2 * batch * config.num_kv_heads * config.head_dim * element_bytes / bandwidth
    c = latency - hw.kernel_overhead
    return (b + math.sqrt(b * b + 4 * a * max(c, 0.0))) / (2 * a)


def memory_per_rank(config: ModelConfig, cp: int, ep: int, batch_local: int, local_tokens: int, element_bytes: int,
                    recv_rows: float, chunks: int = 1) -> dict:
    """Bytes one rank holds during prefill.

    weights: replicated attention, norms, routers, shared experts, dense MLPs, embeddings; num_experts / ep
    experts; quantized parts at their real bytes (``ModelConfig.weight_bytes``).
    kv_cache: every layer's K/V of the rank's own tokens (kept for decoding).
    kv_in_flight: the two extra K/V blocks of the ring's double buffer.
    activations: one layer's working set: residual, normed input, q, fp32 output accumulator and lse,
    plus the MoE buffers of one micro-batch (received rows, their 2F-wide SwiGLU hidden).
    """
    tokens = batch_local * local_tokens
    q_width = config.num_heads * config.head_dim
    kv_cache = config.num_layers * kv_block_bytes(config, batch_local, local_tokens, element_bytes)
    activations = tokens * (3 * config.hidden_size * element_bytes + q_width * (element_bytes + 4) + config.num_heads * 4)
    activations += recv_rows / chunks * (config.hidden_size + 2 * config.ffn_size) * element_bytes
    out = {
        "weights": config.weight_bytes(config.num_experts // ep, element_bytes),
        "kv_cache": kv_cache,
        "kv_in_flight": 2 * kv_block_bytes(config, batch_local, local_tokens, element_bytes) if cp > 1 else 0,
        "activations": activations,
    }
    out["total"] = sum(out.values())
    return out
