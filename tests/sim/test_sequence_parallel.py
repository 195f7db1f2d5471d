"""The sequence-parallel cost model: its bytes are the implementation's, its choice respects heads and nodes."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import ModelConfig, preset
from ringmoe.parallel import RingStats, make_mesh, shard
from ringmoe.parallel.launch import spawn
from ringmoe.parallel.ulysses import usp_attn_func
from ringmoe.sim.hardware import PROFILES
from ringmoe.sim.sequence_parallel import auto_cp_mode, choose_sequence_parallel, sp_cost, valid_ulysses_degrees
from tests.helpers import random_qkv

SHAPE = ModelConfig(num_heads=4, num_kv_heads=1, head_dim=8, hidden_size=32, num_layers=1, num_experts=2, top_k=1,
                    ffn_size=16, vocab_size=32)
GQA = ModelConfig(num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, num_layers=1, num_experts=8, top_k=2,
                  ffn_size=1024, vocab_size=1024)


def _bytes_rank(rank, world, ulysses):
    mesh = make_mesh(cp=world, ulysses=ulysses)
    seqlen = 8 * world
    q, k, v, _ = random_qkv(4, 2, seqlen, seqlen, SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim, torch.float64)
    stats = RingStats()
    usp_attn_func(*(shard(x, world, rank, "zigzag") for x in (q, k, v)), mesh.ulysses_group, mesh.ring_group,
                  causal=True, layout="zigzag", stats=stats)
    return stats.totals("forward")["bytes_sent"]


@pytest.mark.parametrize("world, ulysses", [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_the_models_bytes_are_what_the_implementation_sends(world, ulysses):
    sent = spawn(_bytes_rank, world, ulysses, timeout=120)
    want = sp_cost(SHAPE, PROFILES["h100"], 8 * world, world, ulysses, batch=2, element_bytes=8).bytes_sent
    assert all(s == want for s in sent), (sent, want)


def test_the_choice_is_the_cheapest_valid_one_and_keeps_ulysses_inside_a_node():
    hw = PROFILES["h100"]
    for config in (GQA, preset("deepseek-v3")):
        for gpus in (8, 16, 64):
            for seqlen in (131072, 1048576):
                best, costs, reason = choose_sequence_parallel(config, hw, seqlen, gpus)
                assert best.seconds == min(c.seconds for c in costs)
                assert all(c.ulysses <= hw.devices_per_node for c in costs) and reason.startswith("ulysses")
    # short sequences on many GPUs: the ring's blocks are too short to hide InfiniBand, Ulysses inside each node wins
    best, _, reason = choose_sequence_parallel(GQA, hw, 131072, 64)
    assert best.ulysses > 1 and best.ring > 1 and "across nodes" in reason
    # long sequences: the ring hides its transfers behind compute, and Ulysses's all-to-all would only add time
    best, _, _ = choose_sequence_parallel(GQA, hw, 1048576, 8)
    assert best.mode == "ring"


def test_heads_cap_the_ulysses_degree():
    assert valid_ulysses_degrees(8, 4, 1) == [1, 2, 4]
    assert valid_ulysses_degrees(12, 6, 3) == [1, 3, 6]  # 2 would leave 3 K/V heads split in halves
    assert valid_ulysses_degrees(16, 16, 2, node_ranks=4) == [1, 2, 4]
    _, costs, reason = choose_sequence_parallel(SHAPE, PROFILES["h100"], 65536, 8)
    assert max(c.ulysses for c in costs) == 4 and "capped at 4 by 4 heads" in reason


def test_auto_names_a_mode_the_trainer_takes():
    assert auto_cp_mode(GQA, PROFILES["h100"], 1048576, 8)[:2] == ("ring", None)
    mode, degree, why = auto_cp_mode(GQA, PROFILES["h100"], 131072, 64)
    assert (mode, degree) == ("usp", 4) and why.startswith("ulysses 4 x ring 16")
