"""One engine step's attention (``StepAttention``, an ``AttentionBackend``): each item of the step by its kind.

The runner packs the new tokens of every item into one row; a layer hands the backend that row's q, k, v
and gets back the output of every item, each computed the way its kind needs:

- ``paged`` (cp = 1): prompt chunks and decodes; their new K/V are written into their cache slots, then
  each item's queries attend to its cached context (``attention.paged``: chunks one by one, decodes of
  similar context lengths batched into one call);
- ``decode`` (cp > 1): a token (with speculative drafts: a token and its drafts) on every rank of the cp group;
  the rank that keeps each position writes its K/V, then every rank attends to the part of the cache it holds
  (each row to the positions up to its own: drafts see the rows before them) and the partial (out, lse) merge over
  the group (the cp-decode merge): exact attention over all cached keys;
- ``ring`` (cp > 1): a whole prompt prefilled by ring attention over the cp group (or Ulysses, and the ring
  across, when the mesh factors cp as ulysses x ring); each rank keeps the K/V of the real positions it holds.
  With an FP8 cache the ring attends to the K/V as the cache will hold them (their e4m3 round trip), so a
  prompt sees the same keys whether its prefill ran paged (cp = 1) or by the ring.

With MLA the cache holds latents (``absorbed``): the layer attends in the latent space and the same three
paths run with one "K/V head".
"""

from __future__ import annotations

import torch

from ..attention import decode_attention
from ..attention.paged import paged_attention
from ..attention.sinks import add_sinks
from ..parallel.graph_collectives import merge_over_group
from ..parallel.ring import ring_flash_attn_func
from ..parallel.ulysses import usp_attn_func
from .placement import local_count, owned_prefill_positions

__all__ = ["StepAttention"]


class StepAttention:
    """spans: (WorkItem, offset in the packed row, local length) of each kind, as the runner packed them."""

    latent_ring = False

    def __init__(self, runner, paged: list, decodes: list, rings: list):
        self.runner, self.paged, self.decodes, self.rings = runner, paged, decodes, rings
        self.absorbed = runner.latent  # MLA: the cache holds latents; the layer attends in the latent space
        self.cu = [0]
        for _, _, n in paged:
            self.cu.append(self.cu[-1] + n)
        self.paged_slots = torch.tensor([s for i, _, n in paged for s in runner.slots(i.tables[0], range(
            i.start, i.start + n))], dtype=torch.long, device=runner.device)
        # the paged items' rows of the packed row: built once per step, used by every layer
        self.paged_rows = torch.cat([torch.arange(o, o + n) for _, o, n in paged]) if paged else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q[0], k[0], v[0]
        out = torch.empty_like(q)
        options = self.runner.model.attention_options(layer)  # the layer's window_size and sinks
        if self.paged:
            self._paged(layer, q, k, v, out, options)
        if self.decodes:
            self._sharded_decodes(layer, q, k, v, out, options)
        for item, offset, n in self.rings:
            self._ring_prefill(layer, item, offset, n, q, k, v, out, options)
        return out[None]

    def _paged(self, layer, q, k, v, out, options) -> None:
        runner, rows = self.runner, self.paged_rows
        runner.write(layer, self.paged_slots, k[rows], v[rows])
        out[rows] = paged_attention(q[rows], runner.k_cache[layer], runner.v_cache[layer], self.cu,
                                    [i.start + n for i, _, n in self.paged], [i.tables[0] for i, _, _ in self.paged],
                                    runner.backend, [runner.deterministic and not i.generated for i, _, _ in self.paged],
                                    batch_decodes=not runner.deterministic, kv_scales=runner.kv_scale(layer), **options)

    def _sharded_decodes(self, layer, q, k, v, out, options) -> None:
        runner = self.runner
        cp, cp_rank, layout = runner.mesh.cp, runner.mesh.cp_rank, runner.layout
        window_left = options["window_size"][0]
        out_parts, lse_parts, rows = [], [], []
        for item, offset, n in self.decodes:
            table = item.tables[cp_rank]
            for row in range(n):  # every row's K/V first: a draft attends to the rows before it
                position = item.start + row
                if position % cp == cp_rank:  # this rank keeps this position's K/V
                    mine = local_count(item.ring_len, position, cp, cp_rank, layout)
                    runner.write(layer, runner.slots(table, range(mine, mine + 1)), k[offset + row:offset + row + 1],
                                 v[offset + row:offset + row + 1])
            last = item.start + n - 1
            keys, values = runner.gather(layer, table, local_count(item.ring_len, last + 1, cp, cp_rank, layout))
            for row in range(n):
                position = item.start + row
                held = local_count(item.ring_len, position + 1, cp, cp_rank, layout)
                # this rank's keys are in position order: a window is a suffix of them
                skip = 0 if window_left < 0 else local_count(item.ring_len, max(0, position - window_left), cp,
                                                             cp_rank, layout)
                o, lse = decode_attention(q[None, offset + row:offset + row + 1], keys[None, skip:held],
                                          values[None, skip:held])
                out_parts.append(o[0, 0])
                lse_parts.append(lse[0, :, 0])
                rows.append(offset + row)
        merged, merged_lse = merge_over_group(runner.mesh.cp_group, torch.stack(out_parts), torch.stack(lse_parts))
        if options["sinks"] is not None:  # once, after the ranks' parts are merged
            merged = add_sinks(merged[None], merged_lse.T[None], options["sinks"])[0][0]
        out[rows] = merged.to(q.dtype)

    def _ring_prefill(self, layer, item, offset, n, q, k, v, out, options) -> None:
        runner = self.runner
        rows, mesh = slice(offset, offset + n), runner.mesh
        shards = (q[None, rows], *runner.as_cached(layer, k[None, rows], v[None, rows]))
        if mesh.ulysses > 1:  # the same layout shards: only how the ranks reach each other's keys differs
            out[rows] = usp_attn_func(*shards, mesh.ulysses_group, mesh.ring_group, causal=True, layout=runner.layout,
                                      backend=runner.backend, stats=runner.ring_stats, **options)[0]
        else:
            out[rows] = ring_flash_attn_func(*shards, group=mesh.cp_group, causal=True, layout=runner.layout,
                                             backend=runner.backend, stats=runner.ring_stats, **options)[0]
        real = len(owned_prefill_positions(item.ring_len, runner.mesh.cp, runner.mesh.cp_rank, runner.layout))
        runner.write(layer, runner.slots(item.tables[runner.mesh.cp_rank], range(real)), k[offset:offset + real],
                     v[offset:offset + real])
