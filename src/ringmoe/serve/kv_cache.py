"""The paged KV cache's bookkeeping: fixed-size blocks, block tables, ref counts, prefix caching.

Plain Python, no tensors: the runner owns the (num_blocks, block_size, kv_heads, head_dim)
buffers per layer; this class decides which block holds which tokens.

Prefix caching.  A *full* block is named by a chained hash of its tokens,
``h_i = hash((h_{i-1}, tokens of block i))``, so equal hashes mean equal prefixes up to that
block (the tokens are compared as well on a hit, so a hash collision can never serve wrong K/V).
Blocks that no request references stay in the cache, in a least-recently-freed queue, and are
reused on a later hit or evicted (their hash forgotten) when a fresh block is needed.

Forks.  Parallel samples of one prompt (``n > 1``) share its blocks: ``fork`` gives the child the
parent's block table and raises each block's reference count.  A block is written only by a request
that owns it alone: before a request writes into a shared (partially filled) block,
``copy_on_write`` hands it a fresh block and returns the (source, destination) copy the runner must
make first.  Full blocks are never written again, so only the last prompt block is ever copied.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["BlockManager", "Block", "NoFreeBlocks"]


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks right now (the scheduler preempts or waits)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    tokens: tuple[int, ...] = ()


DROPPED = -1  # a block-table entry given back because no layer's window reaches it any more


@dataclass
class _Owned:
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks registered so far
    dropped: int = 0  # leading entries of ``blocks`` given back (DROPPED)


class BlockManager:
    """Blocks of ``block_size`` token slots; each request owns an ordered list of them (its block table)."""

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.owned: dict[str, _Owned] = {}
        self.hit_tokens = 0
        self.queried_tokens = 0

    # -- queries ----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return list(self.owned[request_id].blocks)

    def slot(self, request_id: str, position: int) -> int:
        """Flat slot index (block_id * block_size + offset) of token ``position`` of a request."""
        blocks = self.owned[request_id].blocks
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    @staticmethod
    def chain(previous: int | None, tokens) -> int:
        return hash((previous, tuple(tokens)))

    # -- prefix cache -------------------------------------------------------------------
    def longest_cached_prefix(self, tokens: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``tokens`` in full blocks.

        At most len(tokens) - 1 tokens are matched: the last token is always computed, since its
        logits are needed.
        """
        if not self.prefix_caching:
            return []
        found, previous = [], None
        for index in range((len(tokens) - 1) // self.block_size):
            chunk = tokens[index * self.block_size:(index + 1) * self.block_size]
            previous = self.chain(previous, chunk)
            block_id = self.cached.get(previous)
            if block_id is None or self.blocks[block_id].tokens != tuple(chunk):
                break
            found.append(block_id)
        return found

    # -- allocation ---------------------------------------------------------------------
    def admit(self, request_id: str, tokens: list[int], use_cache: bool = True) -> int:
        """Start a request: take its longest cached prefix (none when ``use_cache`` is False: a request that
        asked for prompt logprobs must compute every position); returns the number of cached tokens."""
        if request_id in self.owned:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hits = self.longest_cached_prefix(tokens) if use_cache else []
        owned = self.owned[request_id] = _Owned()
        for block_id in hits:
            self._reference(block_id)
            owned.blocks.append(block_id)
            owned.hashes.append(self.blocks[block_id].hash)
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Make the request's blocks hold ``num_tokens`` tokens in all; NoFreeBlocks if they are not there."""
        owned = self.owned[request_id]
        needed = self.blocks_for(num_tokens) - len(owned.blocks)
        if needed > self.num_free:
            raise NoFreeBlocks(f"need {needed} blocks, {self.num_free} free")
        for _ in range(needed):
            owned.blocks.append(self._take_free())

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's block table: every block shared (one more reference each)."""
        if child_id in self.owned:
            raise ValueError(f"request {child_id!r} already holds blocks")
        parent = self.owned[parent_id]
        for block_id in parent.blocks[parent.dropped:]:
            self.blocks[block_id].ref_count += 1
        self.owned[child_id] = _Owned(list(parent.blocks), list(parent.hashes), parent.dropped)

    def copy_on_write(self, request_id: str, position: int) -> list[tuple[int, int]]:
        """Before the request writes token ``position``: if that block is shared, give the request a fresh
        block of its own; the (source, destination) block copy to make before the write ([] if none).
        NoFreeBlocks when no block is free (nothing changes then)."""
        owned = self.owned[request_id]
        index = position // self.block_size
        if index >= len(owned.blocks) or owned.blocks[index] == DROPPED:
            return []
        source = self.blocks[owned.blocks[index]]
        if source.ref_count == 1:
            return []
        if not self.free:
            raise NoFreeBlocks("need 1 block for a copy on write, 0 free")
        destination = self._take_free()
        source.ref_count -= 1
        owned.blocks[index] = destination
        return [(source.block_id, destination)]

    def hashes_due(self, request_id: str, num_computed: int) -> bool:
        """Whether ``register_full_blocks`` has a block to enter (a caller then makes the request's token list:
        a copy of its whole context, which every decode step would otherwise pay for every request)."""
        return self.prefix_caching and num_computed // self.block_size > len(self.owned[request_id].hashes)

    def register_full_blocks(self, request_id: str, tokens: list[int], num_computed: int) -> None:
        """Enter into the prefix cache every block whose ``block_size`` tokens are all computed now."""
        if not self.prefix_caching:
            return
        owned = self.owned[request_id]
        full = min(num_computed, len(tokens)) // self.block_size
        while len(owned.hashes) < full:
            index = len(owned.hashes)
            chunk = tuple(tokens[index * self.block_size:(index + 1) * self.block_size])
            digest = self.chain(owned.hashes[-1] if owned.hashes else None, chunk)
            owned.hashes.append(digest)
            block = self.blocks[owned.blocks[index]]
            if block.hash is None and digest not in self.cached:
                block.hash, block.tokens = digest, chunk
                self.cached[digest] = block.block_id

    def drop_before(self, request_id: str, count: int) -> None:
        """Give back the request's first ``count`` blocks: sliding-window attention never reads them again.

        Their table entries become DROPPED (readers substitute any valid block: those keys are masked);
        blocks in the prefix cache stay reusable by other requests until evicted.
        """
        owned = self.owned[request_id]
        count = min(count, len(owned.blocks))
        for index in range(owned.dropped, count):
            block = self.blocks[owned.blocks[index]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None
            owned.blocks[index] = DROPPED
        owned.dropped = max(owned.dropped, count)

    def live_blocks(self, request_id: str) -> int:
        return len(self.owned[request_id].blocks) - self.owned[request_id].dropped

    def release(self, request_id: str) -> None:
        """Drop a request's references (finished, aborted or preempted); cached blocks stay reusable."""
        owned = self.owned.pop(request_id, None)
        if owned is None:
            return
        for block_id in reversed(owned.blocks[owned.dropped:]):  # the tail is freed first, so it is evicted first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    # -- internals ----------------------------------------------------------------------
    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)  # evict: its old contents are about to be overwritten
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
        block.hash, block.tokens = None, ()

    def check_integrity(self) -> None:
        """Assert the invariants (tests call this after every operation)."""
        refs = [0] * self.num_blocks
        for owned in self.owned.values():
            live = owned.blocks[owned.dropped:]
            assert all(b == DROPPED for b in owned.blocks[:owned.dropped]) and DROPPED not in live
            assert len(set(live)) == len(live), "a request holds a block twice"
            for block_id in live:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}"
            assert (block.block_id in self.free) == (block.ref_count == 0), f"block {block.block_id} free-list mismatch"
            if block.hash is not None:
                assert self.cached.get(block.hash) == block.block_id, f"block {block.block_id} hash not indexed"
                assert len(block.tokens) == self.block_size
        for digest, block_id in self.cached.items():
            assert self.blocks[block_id].hash == digest
