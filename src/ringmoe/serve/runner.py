"""One model step on one rank: a packed batch of work items, K/V in paged buffers.

The runner owns, per layer, K and V buffers of shape (num_blocks, block_size, kv_heads, head_dim).
A step packs the new tokens of every item of this rank's ep group into one (1, tokens) row, each
with its own positions, and runs the model once; the MoE layers see all of them together (and,
under expert parallelism, meet the other ep groups' tokens in the all-to-all: a rank with no item
still runs the step with an empty batch, so no exchange waits for it).

Attention per item kind:

- ``paged`` (cp = 1): prefill chunks and decodes; the new K/V are written into their slots
  (block_id * block_size + offset) and each item's queries attend to its cached context
  (``attention.paged``, causal bottom-right).
- ``ring`` (cp > 1): a whole sequence prefilled by ring attention over the cp group, sharded by the
  layout (padded to its unit; padding sits at the end, so no real token sees it); each rank keeps
  the K/V of its real positions (``placement``).
- ``decode`` (cp > 1): one token, computed on every rank of the cp group; the rank that keeps its
  position writes its K/V, every rank attends to the part of the cache it holds, and the partial
  (out, lse) merge across the group: exact attention over all cached keys.

``step`` returns the final hidden state (hidden,) of the last token of every item marked ``report``
that this rank holds (the driver turns them into logits and samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention import decode_attention, merge_attention
from ..attention.paged import paged_attention
from ..attention.sinks import add_sinks
from ..model.transformer import MoETransformer
from ..parallel.layout import positions as layout_positions, shard
from ..parallel.ring import RingStats, ring_flash_attn_func
from .placement import local_count, owned_prefill_positions, padded_length

__all__ = ["ModelRunner", "WorkItem"]


@dataclass
class WorkItem:
    """Tokens ``token_ids`` at positions start .. start + len - 1 of request ``request_id``.

    kind: "paged" | "ring" | "decode".  tables: the request's block table on each cp rank.
    ring_len: tokens prefilled by the ring in the request's current residency (cp > 1).
    report: the driver needs the last token's hidden state (a new token is due).
    generated: every token of the item is a generated one, computed alone as a decode (in
    deterministic mode such items may use the fast kernel: a decode at position p always has the
    same shapes; prompt positions, whose chunking varies, use the fixed-tile kernel).
    """

    request_id: str
    token_ids: list[int]
    start: int
    tables: list[list[int]]
    kind: str = "paged"
    ring_len: int = 0
    report: bool = True
    generated: bool = False


class ModelRunner:
    def __init__(self, model: MoETransformer, num_blocks: int, block_size: int, backend: str = "auto",
                 deterministic: bool = False):
        config = model.config
        param = model.embed_tokens.weight
        self.model, self.block_size, self.backend = model.eval(), block_size, backend
        self.deterministic = deterministic
        self.mesh, self.layout = model.mesh, model.layout
        self.latent = config.mla  # MLA: the cache holds each token's latent and RoPE key, once (K = V)
        if self.latent:
            shape = (num_blocks, block_size, 1, config.kv_lora_rank + config.qk_rope_head_dim)
        else:
            shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(config.num_layers)]
        self.v_cache = self.k_cache if self.latent else [torch.zeros(shape, dtype=param.dtype, device=param.device)
                                                          for _ in range(config.num_layers)]
        self.ring_stats = RingStats()
        self.history: list[dict] = []  # per step, when the engine records them

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def bytes_per_token(self) -> int:
        first = self.k_cache[0]
        copies = 1 if self.latent else 2
        return copies * len(self.k_cache) * first[0, 0].numel() * first.element_size()

    def _slots(self, table: list[int], local: range) -> list[int]:
        return [table[i // self.block_size] * self.block_size + i % self.block_size for i in local]

    def _write(self, index: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        if not slots:
            return
        at = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.k_cache[index].view(-1, *k.shape[1:]).index_copy_(0, at, k)
        self.v_cache[index].view(-1, *v.shape[1:]).index_copy_(0, at, v)

    def _gather(self, index: int, table: list[int], count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's first ``count`` cached tokens of a request: K, V (count, kv_heads, head_dim)."""
        blocks = torch.tensor(table[: -(-count // self.block_size)], dtype=torch.long, device=self.device)
        blocks = blocks.clamp(min=0)  # entries given back under a sliding window: outside it, never attended
        k = self.k_cache[index].index_select(0, blocks).flatten(0, 1)[:count]
        v = self.v_cache[index].index_select(0, blocks).flatten(0, 1)[:count]
        return k, v

    @torch.no_grad()
    def step(self, items: list[WorkItem]) -> dict[str, torch.Tensor]:
        """Run this rank's items (possibly none); {request_id: hidden (hidden_size,)} for reported items held here."""
        cp, cp_rank = self.mesh.cp, self.mesh.cp_rank
        ids, positions, spans = [], [], []  # spans: (item, offset, local length)
        for item in items:
            if item.kind == "ring":
                padded = padded_length(item.ring_len, cp, self.layout)
                full = torch.tensor(item.token_ids + [0] * (padded - item.ring_len))
                local = shard(full, cp, cp_rank, self.layout, dim=0).tolist()
                where = layout_positions(padded, cp, cp_rank, self.layout).tolist()
            else:
                local, where = item.token_ids, list(range(item.start, item.start + len(item.token_ids)))
            spans.append((item, len(ids), len(local)))
            ids += local
            positions += where
        paged = [(i, o, n) for i, o, n in spans if i.kind == "paged"]
        decodes = [(i, o, n) for i, o, n in spans if i.kind == "decode"]
        rings = [(i, o, n) for i, o, n in spans if i.kind == "ring"]
        cu = [0]
        for _, _, n in paged:
            cu.append(cu[-1] + n)
        paged_slots = [s for i, _, n in paged for s in self._slots(i.tables[0], range(i.start, i.start + n))]

        def attend(index, q, k, v):
            q, k, v = q[0], k[0], v[0]
            out = torch.empty_like(q)
            options = self.model.attention_options(index)  # the layer's window_size and sinks
            window_left, sinks = options["window_size"][0], options["sinks"]
            if paged:
                rows = torch.cat([torch.arange(o, o + n) for _, o, n in paged])
                self._write(index, paged_slots, k[rows], v[rows])
                out[rows] = paged_attention(q[rows], self.k_cache[index], self.v_cache[index], cu,
                                            [i.start + n for i, _, n in paged], [i.tables[0] for i, _, _ in paged],
                                            self.backend,
                                            [self.deterministic and not i.generated for i, _, _ in paged],
                                            batch_decodes=not self.deterministic, **options)
            if decodes:
                out_parts, lse_parts = [], []
                for item, offset, _ in decodes:
                    position, table = item.start, item.tables[cp_rank]
                    if position % cp == cp_rank:  # this rank keeps the new token's K/V
                        mine = local_count(item.ring_len, position, cp, cp_rank, self.layout)
                        self._write(index, self._slots(table, range(mine, mine + 1)), k[offset:offset + 1],
                                    v[offset:offset + 1])
                    held = local_count(item.ring_len, position + 1, cp, cp_rank, self.layout)
                    keys, values = self._gather(index, table, held)
                    if window_left >= 0:  # this rank's keys are in position order: the window is a suffix
                        skip = local_count(item.ring_len, max(0, position - window_left), cp, cp_rank, self.layout)
                        keys, values = keys[skip:], values[skip:]
                    o, lse = decode_attention(q[None, offset:offset + 1], keys[None], values[None])
                    out_parts.append(o[0, 0])
                    lse_parts.append(lse[0, :, 0])
                merged, merged_lse = _merge_over_group(self.mesh.cp_group, torch.stack(out_parts),
                                                       torch.stack(lse_parts))
                if sinks is not None:  # once, after the ranks' parts are merged
                    merged = add_sinks(merged[None], merged_lse.T[None], sinks)[0][0]
                out[[o for _, o, _ in decodes]] = merged.to(q.dtype)
            for item, offset, n in rings:
                rows = slice(offset, offset + n)
                out[rows] = ring_flash_attn_func(q[None, rows], k[None, rows], v[None, rows],
                                                 group=self.mesh.cp_group, causal=True, layout=self.layout,
                                                 backend=self.backend, stats=self.ring_stats, **options)[0]
                real = len(owned_prefill_positions(item.ring_len, cp, cp_rank, self.layout))
                self._write(index, self._slots(item.tables[cp_rank], range(real)), k[offset:offset + real],
                            v[offset:offset + real])
            return out[None]

        attend.absorbed = self.latent  # MLA attends in the latent space: the cache is never expanded
        device = self.device
        hidden = self.model.hidden_states(torch.tensor([ids], dtype=torch.long, device=device),
                                          torch.tensor(positions, dtype=torch.long, device=device), attend)[0]
        reports = {}
        for item, offset, n in spans:
            if not item.report:
                continue
            if item.kind == "ring":
                last = item.ring_len - 1
                held = owned_prefill_positions(item.ring_len, cp, cp_rank, self.layout)
                if held and held[-1] == last:  # the rank holding the last real position reports it
                    reports[item.request_id] = hidden[offset + len(held) - 1]
            elif item.kind == "paged" or cp_rank == 0:  # decode rows are the same on every cp rank
                reports[item.request_id] = hidden[offset + n - 1]
        return reports


def _merge_over_group(group, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention (out (n, heads, D), lse (n, heads)) over every rank's keys from each rank's partial result."""
    if group is None:
        return out, lse
    world = dist.get_world_size(group)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    merged, merged_lse = outs[0], lses[0]
    for o, s in zip(outs[1:], lses[1:]):  # the same order on every rank: identical results
        merged, merged_lse = merge_attention(merged[None], merged_lse.T[None], o[None], s.T[None])
        merged, merged_lse = merged[0], merged_lse[0].T
    return merged, merged_lse
