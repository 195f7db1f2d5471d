"""Block manager invariants under random admit / grow / register / release sequences, and prefix caching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringmoe.serve.kv_cache import BlockManager, NoFreeBlocks


def test_prefix_hits_compare_tokens_and_skip_the_last_token():
    blocks = BlockManager(8, block_size=4)
    prompt = list(range(10))
    assert blocks.admit("a", prompt) == 0
    blocks.grow("a", 10)
    blocks.register_full_blocks("a", prompt, 10)  # blocks 0-3 and 4-7 are full
    assert blocks.admit("b", prompt) == 8  # two full blocks shared
    assert blocks.block_table("b")[:2] == blocks.block_table("a")[:2]
    assert blocks.admit("c", list(range(8))) == 4  # 8 tokens: the last one must be computed, so one block
    assert blocks.admit("d", [0, 1, 2, 99, 4, 5, 6, 7, 8]) == 0  # first block differs
    blocks.check_integrity()
    for rid in "abcd":
        blocks.release(rid)
    blocks.check_integrity()
    assert blocks.num_free == 8 and len(blocks.cached) == 2  # unreferenced but still cached
    assert blocks.admit("e", prompt) == 8  # reused after release
    blocks.check_integrity()


def test_eviction_forgets_hashes_and_grow_raises_when_full():
    blocks = BlockManager(3, block_size=2)
    blocks.admit("a", [1, 2, 3, 4, 5])
    blocks.grow("a", 5)
    blocks.register_full_blocks("a", [1, 2, 3, 4, 5], 5)
    blocks.release("a")
    blocks.admit("b", [7, 8, 9, 10, 11])
    blocks.grow("b", 6)  # takes all three blocks: both cached ones are evicted
    assert blocks.cached == {}
    with pytest.raises(NoFreeBlocks):
        blocks.grow("b", 7)
    blocks.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "release"]), st.integers(0, 5), st.integers(1, 30),
                          st.integers(0, 3)), min_size=1, max_size=60))
def test_invariants_hold_under_random_operations(operations):
    blocks = BlockManager(12, block_size=4)
    known: dict[str, list[int]] = {}
    for op, who, length, family in operations:
        rid = f"r{who}"
        if op == "admit" and rid not in blocks.owned:
            tokens = [family] * 3 + list(range(length))  # families share prefixes
            known[rid] = tokens
            cached = blocks.admit(rid, tokens)
            assert cached % 4 == 0 and cached < len(tokens)
        elif op == "grow" and rid in blocks.owned:
            target = min(len(known[rid]), length)
            try:
                blocks.grow(rid, target)
            except NoFreeBlocks:
                pass
            else:  # the engine registers only where hashes_due says a block is newly full: never a block missed
                computed = min(target, len(blocks.owned[rid].blocks) * 4)
                due, before = blocks.hashes_due(rid, computed), list(blocks.owned[rid].hashes)
                blocks.register_full_blocks(rid, known[rid], computed)
                assert due or blocks.owned[rid].hashes == before
        elif op == "release":
            blocks.release(rid)
        blocks.check_integrity()
    for rid in list(blocks.owned):
        blocks.release(rid)
    blocks.check_integrity()
    assert blocks.num_free == 12
