"""The cost model: closed forms against brute force, conservation, monotonicity, overlap threshold, calibration."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ringmoe.model import ModelConfig, preset
from ringmoe.sim import PROFILES, Hardware, Scenario, simulate
from ringmoe.sim.calibrate import profile_from_measurements, synthetic_measurements
from ringmoe.sim.costs import kv_block_bytes, min_tokens_for_overlap, ring_step_pairs, rows_to_rank, visible_pairs

SMALL = ModelConfig(vocab_size=64, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32,
                    ffn_size=512, num_experts=8, top_k=2)
# a slow network, so communication matters at small sizes; no fixed costs, so the closed forms are exact
SLOW = Hardware(name="slow", matmul_flops=1e12, attention_flops=1e12, memory_bandwidth=1e15, intra_bandwidth=1e9,
                intra_latency=2e-5, inter_bandwidth=1e9, inter_latency=2e-5, devices_per_node=64, kernel_overhead=0.0)


def test_visible_pairs_match_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        nq, nk = rng.randint(0, 40), rng.randint(0, 40)
        offset = rng.choice([None, rng.randint(-50, 50)])
        want = sum(1 for i in range(nq) for j in range(nk) if offset is None or j <= i + offset)
        assert visible_pairs(nq, nk, offset) == want, (nq, nk, offset)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_ring_pairs_cover_the_causal_triangle_exactly_once(layout, cp):
    seqlen = 2 * cp * 7
    causal = sum(sum(ring_step_pairs(seqlen, cp, r, s, layout)[:2]) for r in range(cp) for s in range(cp))
    assert causal == seqlen * (seqlen + 1) // 2
    full = sum(sum(ring_step_pairs(seqlen, cp, r, s, layout, causal=False)[:2]) for r in range(cp) for s in range(cp))
    assert full == seqlen * seqlen


def test_attention_flops_and_ring_bytes_are_conserved():
    hw = dataclasses.replace(SLOW, causal_efficiency=1.0)
    s = Scenario(SMALL, hw, seqlen=4096, cp=4, ep=1, batch=1, element_bytes=2, parts=("attention",))
    p = simulate(s)
    busy = sum(sum(steps) for steps in p.attention_step_s)
    merges = 3 * 3 * 1024 * SMALL.num_heads * SMALL.head_dim * 4 / hw.memory_bandwidth * 4  # 3 merges x 4 ranks
    flops = 4 * SMALL.head_dim * SMALL.num_heads * 4096 * 4097 / 2
    assert busy == pytest.approx(flops / hw.attention_flops + merges, rel=1e-9)
    sent = sum(t.nbytes for t in p.timeline.tasks if t.name.startswith("kv"))
    assert sent == 4 * 3 * kv_block_bytes(SMALL, 1, 1024, 2)  # every rank passes cp - 1 blocks
    assert p.kv_bytes_per_step == kv_block_bytes(SMALL, 1, 1024, 2)


def test_dispatch_bytes_are_one_row_per_token_and_remote_rank():
    s = Scenario(SMALL, SLOW, seqlen=1000, cp=1, ep=4, element_bytes=2, parts=("moe",))
    p = simulate(s)
    per_destination = rows_to_rank(1000, 8, 2, 0.25)
    assert per_destination == pytest.approx(1000 * (1 - (6 * 5) / (8 * 7)))  # 1 - C(6,2)/C(8,2)
    assert p.dispatch_bytes == pytest.approx([3 * per_destination * 256 * 2] * 4)
    assert p.combine_bytes == pytest.approx(p.dispatch_bytes)


@pytest.mark.parametrize("field", ["intra_bandwidth", "inter_bandwidth", "matmul_flops", "attention_flops",
                                   "memory_bandwidth"])
def test_more_of_any_resource_is_never_slower(field):
    base = dataclasses.replace(PROFILES["h100"], devices_per_node=4)
    for cp, ep, seqlen, skew, chunks in ((4, 2, 8192, 1.0, 1), (2, 4, 2048, 2.5, 3), (8, 1, 4096, 1.0, 1)):
        times = []
        for scale in (1, 2, 8):
            hw = dataclasses.replace(base, **{field: getattr(base, field) * scale})
            times.append(simulate(Scenario(SMALL, hw, seqlen, cp, ep, skew=skew, chunks=chunks)).prefill_s)
        assert times[0] >= times[1] >= times[2], (field, cp, ep, times)


def test_overlap_threshold_formula_matches_the_event_schedule():
    cp = 4
    threshold = min_tokens_for_overlap(SMALL, SLOW, batch=1, element_bytes=2, same_node=True)
    for factor, hidden in ((0.4, False), (1.3, True), (4.0, True)):
        unit = 2 * cp
        seqlen = int(threshold * factor * cp / unit) * unit
        p = simulate(Scenario(SMALL, SLOW, seqlen, cp=cp, batch=1, parts=("attention",)))
        assert p.min_tokens_for_overlap == pytest.approx(threshold)
        assert (p.ring_exposed_fraction < 1e-9) == hidden, (factor, p.ring_exposed_fraction)


def test_layouts_balance_causal_work_and_skew_makes_stragglers():
    imbalance = {layout: simulate(Scenario(SMALL, SLOW, 8192, cp=4, batch=1, layout=layout,
                                           parts=("attention",))).attention_imbalance
                 for layout in ("contiguous", "zigzag", "striped")}
    assert imbalance["zigzag"] < 1.01 and imbalance["striped"] < 1.01 and imbalance["contiguous"] > 1.5
    stragglers = [simulate(Scenario(SMALL, SLOW, 2048, cp=1, ep=4, skew=skew, parts=("moe",))).straggler_s
                  for skew in (1.0, 2.0, 4.0)]
    assert stragglers[0] < stragglers[1] < stragglers[2]


def test_calibration_recovers_a_synthetic_profile():
    truth = Hardware(name="this-machine", matmul_flops=1.3e11, attention_flops=9e10, memory_bandwidth=1.2e10,
                     intra_bandwidth=2.5e9, intra_latency=8e-5, inter_bandwidth=2.5e9, inter_latency=8e-5,
                     devices_per_node=1 << 20, memory_bytes=0.0, kernel_overhead=2e-5, causal_efficiency=0.8,
                     alltoall_efficiency=0.7)
    fitted = profile_from_measurements(synthetic_measurements(truth))
    assert fitted.name == truth.name
    for field in dataclasses.fields(Hardware)[1:]:
        want, got = getattr(truth, field.name), getattr(fitted, field.name)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12), field.name


def test_memory_per_rank_shrinks_with_the_mesh():
    config = preset("mixtral-8x7b")
    one = simulate(Scenario(config, PROFILES["h100"], 32768, cp=1, ep=1)).memory
    mesh = simulate(Scenario(config, PROFILES["h100"], 32768, cp=4, ep=8, batch=8)).memory
    assert mesh["weights"] < one["weights"] and mesh["kv_cache"] < one["kv_cache"]
    # experts dominate Mixtral's weights: 1/8 of them per rank
    assert one["weights"] == pytest.approx(config.num_params * 2, rel=1e-3)


def test_bad_scenarios_are_named():
    with pytest.raises(ValueError, match="skew"):
        simulate(Scenario(SMALL, SLOW, 1024, ep=2, skew=3.0))
    with pytest.raises(ValueError, match="divide num_experts"):
        simulate(Scenario(SMALL, SLOW, 1024, ep=3))
    with pytest.raises(ValueError, match="seqlen"):
        simulate(Scenario(SMALL, SLOW, 1001, cp=2))
    with pytest.raises(ValueError, match="hw must be one of"):
        from ringmoe.sim import hardware_profile

        hardware_profile("tpu-v9")
