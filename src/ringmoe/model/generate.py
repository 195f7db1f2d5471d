"""Greedy generation: context-parallel prefill, then decoding against a sharded KV cache.

Prefill runs the prompt through the model with ring attention (each rank holds
its layout shard of every sequence) and keeps each layer's K/V of its own
tokens: the cache stays sharded, no rank ever holds the whole of it.  A decode
step feeds the new token (the same on every rank of a cp group) through the
model; in each layer the token's key and value are appended on one rank (the
owner of that position, round-robin), every rank attends the query to its
cache shard, giving a partial (out, lse), and the partials are combined with
the online-softmax merge:

    lse = log(sum_r exp(lse_r)),  out = sum_r exp(lse_r - lse) * out_r

which is exact attention over all cached keys.  Ranks of an ep group decode
different sequences and meet only in the MoE all-to-all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..attention import decode_attention, merge_attention
from ..parallel.layout import shard
from ..parallel.ring import RingStats
from ..parallel.watchdog import activity
from .transformer import MoETransformer

__all__ = ["ShardedKVCache", "generate", "Generation"]


class ShardedKVCache:
    """This rank's keys and values for every layer: (batch, capacity, kv_heads, head_dim) buffers plus a length."""

    def __init__(self, num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, capacity, kv_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = [0] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start, stop = self.length[layer], self.length[layer] + k.shape[1]
        if stop > self.k[layer].shape[1]:
            raise RuntimeError(f"KV cache of layer {layer} is full ({self.k[layer].shape[1]} tokens)")
        self.k[layer][:, start:stop] = k
        self.v[layer][:, start:stop] = v
        self.length[layer] = stop

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length[layer]
        return self.k[layer][:, :n], self.v[layer][:, :n]


@dataclass
class Generation:
    """tokens (B, new) int64 and, if asked, logits (B, new, vocab) float32 of every step (all rows, every rank);
    new < max_new_tokens when every row ended early at an end-of-sequence token.

    Timings are this rank's; ring holds the prefill's per-step ring statistics;
    moe the prefill's MoEStats per layer.
    """

    tokens: torch.Tensor
    logits: torch.Tensor | None
    prefill_s: float
    decode_s: float
    ring: RingStats = field(default_factory=RingStats)
    moe: list = field(default_factory=list)


def _merge_across(group, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact attention over the union of every rank's keys, from each rank's partial (out, lse)."""
    world = dist.get_world_size(group)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    merged, merged_lse = outs[0], lses[0]
    for o, s in zip(outs[1:], lses[1:]):  # same order on every rank: identical results
        merged, merged_lse = merge_attention(merged, merged_lse, o, s)
    return merged


def _eos_ids(eos_token_id, vocab_size: int) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"eos_token_id must be a token id (or a list of them) in [0, {vocab_size}), got {eos_token_id!r}")
    return torch.tensor(ids)


def _all_rows_finished(mesh, finished: torch.Tensor) -> bool:
    """True on every rank when every row of the whole batch has finished (one all-reduce over the mesh)."""
    pending = (~finished).sum().reshape(1).to(torch.int64)
    if mesh.size > 1:
        dist.all_reduce(pending)  # the mesh spans the default group
    return int(pending) == 0


def _gather_rows(group, x: torch.Tensor) -> torch.Tensor:
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


@torch.no_grad()
def generate(model: MoETransformer, prompt: torch.Tensor, max_new_tokens: int, return_logits: bool = False,
             progress=None, eos_token_id: int | list[int] | None = None) -> Generation:
    """Greedy decoding of ``max_new_tokens`` tokens after ``prompt``.

    prompt (B, S) int64, the same full tensor on every rank; B divisible by the
    mesh's ep, S >= 1 valid for the model's layout and cp (zigzag: S % (2 cp) == 0).
    Returns the same Generation on every rank, equal to single-device greedy
    decoding.  eos_token_id: a row that produces one of these ids is finished; its later
    positions hold the first id (as padding), and decoding stops early once every row of
    the whole batch has finished.  progress(phase, done, total) is called after each layer
    of the prefill and each decoded token (for progress bars).
    """
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype != torch.int64:
        raise ValueError(f"prompt must be an int64 tensor (batch, seqlen), got {getattr(prompt, 'shape', prompt)!r}")
    if prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must hold at least one token per row, got shape {tuple(prompt.shape)}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    eos = _eos_ids(eos_token_id, model.config.vocab_size)
    mesh, config = model.mesh, model.config
    seqlen = prompt.shape[1]
    rows = prompt[mesh.batch_rows(prompt.shape[0])]
    local = shard(rows, mesh.cp, mesh.cp_rank, model.layout, dim=1) if mesh.cp > 1 else rows
    positions = model.local_positions(local.shape[1]).to(prompt.device)
    dtype = model.embed_tokens.weight.dtype
    capacity = local.shape[1] + -(-max_new_tokens // mesh.cp)
    cache = ShardedKVCache(config.num_layers, local.shape[0], capacity, config.num_kv_heads, config.head_dim,
                           dtype, prompt.device)
    ring_stats = RingStats()
    ring = model.causal_attend(ring_stats)
    report = progress or (lambda phase, done, total: None)

    def prefill_attend(index, q, k, v):
        cache.append(index, k, v)
        out = ring(index, q, k, v)
        report("prefill", index + 1, config.num_layers)
        return out

    start = time.perf_counter()
    with activity("prefill"):
        hidden = model.hidden_states(local, positions, prefill_attend)
    # the last prompt position lives on one rank of the cp group: share its hidden state
    last = (positions == seqlen - 1).nonzero()
    row = hidden[:, last[0, 0]].contiguous() if len(last) else torch.zeros_like(hidden[:, 0])
    if mesh.cp_group is not None:
        dist.all_reduce(row, group=mesh.cp_group)
    logits = [model.lm_head(row).float()]
    prefill_s = time.perf_counter() - start
    moe = model.moe_stats()

    start = time.perf_counter()
    finished = torch.zeros(local.shape[0], dtype=torch.bool, device=prompt.device)
    for step in range(1, max_new_tokens):
        if eos is not None:
            finished |= torch.isin(logits[-1].argmax(-1), eos)
            if _all_rows_finished(mesh, finished):
                break
        position = seqlen + step - 1
        owner = position % mesh.cp

        def decode_attend(index, q, k, v):
            if owner == mesh.cp_rank:
                cache.append(index, k, v)
            out, lse = decode_attention(q, *cache.get(index))
            if mesh.cp_group is not None:
                out = _merge_across(mesh.cp_group, out, lse)
            return out.to(q.dtype)

        token = logits[-1].argmax(-1, keepdim=True)
        with activity(f"decode step {step}"):
            hidden = model.hidden_states(token, torch.tensor([position], device=prompt.device), decode_attend)
        logits.append(model.lm_head(hidden[:, -1]).float())
        report("decode", step, max_new_tokens - 1)
    decode_s = time.perf_counter() - start

    all_logits = torch.stack(logits, dim=1)
    chosen = all_logits.argmax(-1)
    if eos is not None:  # positions after a row's first end-of-sequence token are padding
        hit = torch.isin(chosen, eos).int()
        after = (hit.cumsum(1) - hit) > 0
        chosen = chosen.masked_fill(after, int(eos[0]))
    tokens = _gather_rows(mesh.ep_group, chosen)
    gathered = _gather_rows(mesh.ep_group, all_logits) if return_logits else None
    return Generation(tokens, gathered, prefill_s, decode_s, ring_stats, moe)
