"""plan_replicas: EPLB-style replication of hot experts and packing onto ranks."""

from __future__ import annotations

import pytest
import torch

from ringmoe.moe import plan_replicas


@pytest.mark.parametrize("num_ranks, slots", [(2, 5), (3, 4), (4, 3)])
def test_every_slot_filled_every_expert_placed(num_ranks, slots):
    load = torch.tensor([100.0, 5, 7, 3, 9, 4, 6, 2])
    plan = plan_replicas(load, num_ranks, slots)
    assert all(len(rank) == slots for rank in plan.slots)
    assert all(len(r) >= 1 for r in plan.replicas)
    assert sum(len(r) for r in plan.replicas) == num_ranks * slots
    for e, ids in enumerate(plan.replicas):
        for pid in ids:
            assert plan.slots[pid // slots][pid % slots] == e
    assert len(plan.replicas[0]) == max(len(r) for r in plan.replicas)  # the hot expert is copied most


def test_replicas_bring_a_skewed_load_under_1_2():
    gen = torch.Generator().manual_seed(0)
    load = torch.rand(16, generator=gen) * 10
    load[3] = 400.0  # one very hot expert
    before = load.view(4, 4).sum(1)  # 4 experts per rank, no replicas
    plan = plan_replicas(load, 4, 6)
    after = plan.expected_load(load)
    assert before.max() / before.mean() > 2.0
    assert after.max() / after.mean() < 1.2
    assert torch.isclose(after.sum(), load.double().sum())


def test_bad_arguments():
    with pytest.raises(ValueError, match="must be >= num_experts"):
        plan_replicas(torch.ones(8), 2, 3)
    with pytest.raises(ValueError, match="non-negative"):
        plan_replicas(torch.tensor([1.0, -1.0]), 1, 2)
