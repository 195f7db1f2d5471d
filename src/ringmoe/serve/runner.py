"""One model step over a packed batch, with the K/V in paged buffers.

The runner owns, per layer, K and V buffers of shape (num_blocks, block_size, kv_heads, head_dim).
A step packs every scheduled sequence's new tokens into one (1, total_tokens) row: prefill chunks
and decodes together, each with its own positions.  Every layer writes the new tokens' K/V into
their slots (block_id * block_size + offset) and attends each sequence's queries to its cached
context (``attention.paged``); the MoE layers see all tokens of the step at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.paged import paged_attention
from ..model.transformer import MoETransformer

__all__ = ["ModelRunner", "SequenceChunk"]


@dataclass
class SequenceChunk:
    """Tokens ``token_ids`` at positions start .. start + len - 1 of a sequence with this block table."""

    token_ids: list[int]
    start: int
    block_table: list[int]


class ModelRunner:
    def __init__(self, model: MoETransformer, num_blocks: int, block_size: int, backend: str = "auto"):
        config = model.config
        param = model.embed_tokens.weight
        self.model, self.block_size, self.backend = model.eval(), block_size, backend
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(config.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(config.num_layers)]

    @property
    def bytes_per_token(self) -> int:
        first = self.k_cache[0]
        return 2 * len(self.k_cache) * first[0, 0].numel() * first.element_size()

    @torch.no_grad()
    def step(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Run the chunks through the model; logits (len(chunks), vocab) float32 at each chunk's last token."""
        device = self.model.embed_tokens.weight.device
        ids, positions, slots, cu, context = [], [], [], [0], []
        for chunk in chunks:
            count = len(chunk.token_ids)
            ids += chunk.token_ids
            span = range(chunk.start, chunk.start + count)
            positions += span
            slots += [chunk.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in span]
            cu.append(cu[-1] + count)
            context.append(chunk.start + count)
        tables = [c.block_table for c in chunks]
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)

        def attend(index, q, k, v):
            k_flat = self.k_cache[index].view(-1, *k.shape[2:])
            v_flat = self.v_cache[index].view(-1, *v.shape[2:])
            k_flat.index_copy_(0, slot_index, k[0])
            v_flat.index_copy_(0, slot_index, v[0])
            out = paged_attention(q[0], self.k_cache[index], self.v_cache[index], cu, context, tables, self.backend)
            return out[None]

        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        hidden = self.model.hidden_states(input_ids, torch.tensor(positions, device=device), attend)
        last = torch.tensor([c - 1 for c in cu[1:]], dtype=torch.long, device=device)
        return self.model.lm_head(hidden[0].index_select(0, last)).float()
