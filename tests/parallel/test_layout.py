"""shard / unshard / positions: round trips, balance, and errors."""

from __future__ import annotations

import pytest
import torch

from ringmoe.parallel import LAYOUTS, positions, shard, unshard
from ringmoe.parallel.layout import segments


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_round_trip_and_partition(layout, world_size):
    seqlen = 2 * world_size * 5
    x = torch.randn(2, seqlen, 3, generator=torch.Generator().manual_seed(world_size))
    parts = [shard(x, world_size, r, layout) for r in range(world_size)]
    assert torch.equal(unshard(parts, layout), x)
    held = torch.cat([positions(seqlen, world_size, r, layout) for r in range(world_size)])
    assert torch.equal(held.sort().values, torch.arange(seqlen))  # every token exactly once
    for r, part in enumerate(parts):
        assert torch.equal(part, x[:, positions(seqlen, world_size, r, layout)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_segments_describe_positions(layout):
    world_size, local = 3, 8
    for rank in range(world_size):
        pos = positions(world_size * local, world_size, rank, layout)
        for seg in segments(local, world_size, rank, layout):
            expect = torch.arange(seg.start, seg.start + seg.stride * seg.length, seg.stride)
            assert torch.equal(pos[seg.local_start : seg.local_stop], expect)


def test_zigzag_and_striped_balance_causal_work():
    seqlen, world_size = 64, 4

    def work(layout, r):  # number of visible (query, key) pairs: sum over held queries of position + 1
        return int((positions(seqlen, world_size, r, layout) + 1).sum())

    for layout in ("zigzag", "striped"):
        loads = [work(layout, r) for r in range(world_size)]
        assert max(loads) / (sum(loads) / world_size) < 1.05, (layout, loads)
    loads = [work("contiguous", r) for r in range(world_size)]
    assert max(loads) / (sum(loads) / world_size) > 1.5


@pytest.mark.parametrize(
    "seqlen, world_size, layout, match",
    [(10, 3, "contiguous", "divisible by 3"), (12, 4, "zigzag", "divisible by 8"), (8, 2, "ring", "layout")],
)
def test_bad_layout_arguments(seqlen, world_size, layout, match):
    with pytest.raises(ValueError, match=match):
        positions(seqlen, world_size, 0, layout)
    with pytest.raises(ValueError, match=match):
        shard(torch.zeros(1, seqlen), world_size, 0, layout)
