"""Where each token's K/V lives when a cp group shares a request (context parallelism).

A request's first ``ring_len`` tokens are prefilled by ring attention: the sequence is padded to
the layout's unit and sharded by the layout, so rank c keeps the K/V of the real positions in its
shard.  Every later token (decoding) is kept by rank ``position % cp`` (round-robin).  Each rank
stores its positions in increasing order in its own paged cache: local index = how many of its
positions come before.  No rank holds the whole cache; a decoding query attends to each rank's
part and the partial results merge exactly (online-softmax rule).

``ShardedBlocks`` gives the scheduler one block manager per cp rank behind the interface of a
single one (prefix caching is off under cp > 1: ring prefill computes whole sequences).
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache

from ..parallel.layout import positions as layout_positions
from .kv_cache import BlockManager, NoFreeBlocks

__all__ = ["padded_length", "owned_prefill_positions", "local_count", "ShardedBlocks"]

_UNIT = {"zigzag": 2, "striped": 1, "contiguous": 1}


def padded_length(length: int, cp: int, layout: str) -> int:
    unit = _UNIT[layout] * cp
    return -(-length // unit) * unit


@lru_cache(maxsize=4096)
def owned_prefill_positions(ring_len: int, cp: int, cp_rank: int, layout: str) -> tuple[int, ...]:
    """Rank cp_rank's real positions (< ring_len) of the padded layout shard, increasing."""
    shard = layout_positions(padded_length(ring_len, cp, layout), cp, cp_rank, layout).tolist()
    return tuple(p for p in shard if p < ring_len)


def local_count(ring_len: int, upto: int, cp: int, cp_rank: int, layout: str) -> int:
    """How many of positions [0, upto) rank cp_rank keeps."""
    prefill = owned_prefill_positions(ring_len, cp, cp_rank, layout)
    count = bisect_left(prefill, upto)  # (increasing: a search, where a count would walk the prompt per call)
    if upto > ring_len:  # round-robin positions ring_len .. upto - 1
        count += (upto - 1 - cp_rank) // cp - (ring_len - 1 - cp_rank) // cp
    return count


class ShardedBlocks:
    """cp block managers (one per cp rank) behind one BlockManager-like interface."""

    def __init__(self, num_blocks: int, block_size: int, cp: int, layout: str):
        self.cp, self.layout, self.block_size, self.num_blocks = cp, layout, block_size, num_blocks
        self.ranks = [BlockManager(num_blocks, block_size, prefix_caching=False) for _ in range(cp)]
        self.ring_len: dict[str, int] = {}
        self.hit_tokens = self.queried_tokens = 0
        self.prefix_caching = False

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cp ranks hold together (the layout spreads a sequence evenly)."""
        return self.cp * self.num_blocks * self.block_size

    @property
    def owned(self):
        return self.ranks[0].owned

    @property
    def num_free(self) -> int:
        return min(r.num_free for r in self.ranks)

    @property
    def usage(self) -> float:
        return max(r.usage for r in self.ranks)

    def admit(self, request_id: str, tokens: list[int], use_cache: bool = True) -> int:
        """The whole known sequence will be prefilled by the ring: no cached prefix."""
        for manager in self.ranks:
            manager.admit(request_id, [])
        self.ring_len[request_id] = len(tokens)
        return 0

    def grow(self, request_id: str, num_tokens: int) -> None:
        ring_len = self.ring_len[request_id]
        wanted = [local_count(ring_len, num_tokens, self.cp, c, self.layout) for c in range(self.cp)]
        if any(m.blocks_for(w) - len(m.owned[request_id].blocks) > m.num_free for m, w in zip(self.ranks, wanted)):
            raise NoFreeBlocks(f"a cp rank has no room for request {request_id!r}")
        for manager, count in zip(self.ranks, wanted):
            manager.grow(request_id, count)

    def hashes_due(self, request_id: str, num_computed: int) -> bool:
        return False  # (no prefix cache over a ring-sharded cache)

    def register_full_blocks(self, request_id: str, tokens: list[int], num_computed: int) -> None:
        return

    def drop_before(self, request_id: str, count: int) -> None:
        """Give back, on every cp rank, the blocks that hold only positions before ``count * block_size``
        (positions the sliding window no longer reaches; each rank keeps its positions in order)."""
        ring_len, upto = self.ring_len[request_id], count * self.block_size
        for rank, manager in enumerate(self.ranks):
            held = local_count(ring_len, upto, self.cp, rank, self.layout)
            manager.drop_before(request_id, held // self.block_size)

    def live_blocks(self, request_id: str) -> int:
        return max(m.live_blocks(request_id) for m in self.ranks)

    def release(self, request_id: str) -> None:
        for manager in self.ranks:
            manager.release(request_id)
        self.ring_len.pop(request_id, None)

    def block_table(self, request_id: str) -> list[list[int]]:
        return [m.block_table(request_id) for m in self.ranks]

    def check_integrity(self) -> None:
        for manager in self.ranks:
            manager.check_integrity()
