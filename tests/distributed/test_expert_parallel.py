"""Expert parallelism on gloo ranks equals the single-rank MoELayer with the same weights and tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from ringmoe.moe import MoELayer, plan_replicas
from ringmoe.parallel.launch import RankFailed, spawn

E, H, F, K, T_LOCAL = 12, 16, 24, 2, 13
ROUTERS = [dict(router="softmax_topk"), dict(router="sigmoid_bias", n_group=3, topk_group=2, shared_ffn_size=8)]


def _layers(world, rank, router, capacity_factor, skew, chunks=1, sync=False):
    gen = torch.Generator().manual_seed(1234)
    full = MoELayer(H, F, E, K, capacity_factor=capacity_factor, **router).double()
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.4)
        if skew:  # most tokens want expert 0
            full.router.weight[0] = full.router.weight[0].abs() * 3
    ep = MoELayer(H, F, E, K, capacity_factor=capacity_factor, group=dist.group.WORLD, overlap_chunks=chunks,
                  **router).double()
    ep.sync_exchanges = sync
    lo, hi = ep.expert_offset, ep.expert_offset + ep.local_experts
    with torch.no_grad():
        ep.router.weight.copy_(full.router.weight)
        ep.experts.gate_up.copy_(full.experts.gate_up[lo:hi])
        ep.experts.down.copy_(full.experts.down[lo:hi])
        if full.shared is not None:
            ep.shared.load_state_dict(full.shared.state_dict())
    return full, ep


def _check(rank, world):
    gen = torch.Generator().manual_seed(99)
    x_all = torch.randn(world * T_LOCAL, H, generator=gen, dtype=torch.float64)
    g_all = torch.randn(world * T_LOCAL, H, generator=gen, dtype=torch.float64)
    rows = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    checked = 0
    for router in ROUTERS:
        for capacity_factor in (None, 0.75):
            for skew, chunks, sync in ((False, 1, False), (True, 1, False), (False, 3, False), (True, 3, False),
                                       (True, 3, True)):
                full, ep = _layers(world, rank, router, capacity_factor, skew, chunks, sync)
                x_full = x_all.clone().requires_grad_()
                y_full = full(x_full)
                (y_full * g_all).sum().backward()
                x_local = x_all[rows].clone().requires_grad_()
                y_local = ep(x_local)
                (y_local * g_all[rows]).sum().backward()
                label = f"{router['router']} c={capacity_factor} skew={skew} chunks={chunks} sync={sync}"
                assert torch.allclose(y_local, y_full[rows], atol=1e-12), label
                assert torch.allclose(x_local.grad, x_full.grad[rows], atol=1e-12), label
                lo, hi = ep.expert_offset, ep.expert_offset + ep.local_experts
                assert torch.allclose(ep.experts.gate_up.grad, full.experts.gate_up.grad[lo:hi], atol=1e-12), label
                assert torch.allclose(ep.experts.down.grad, full.experts.down.grad[lo:hi], atol=1e-12), label
                router_grad = ep.router.weight.grad.clone()
                dist.all_reduce(router_grad)  # data-parallel router: gradients add up over ranks
                assert torch.allclose(router_grad, full.router.weight.grad, atol=1e-12), label
                stats, ref = ep.last_stats, full.last_stats
                if world > 1:
                    assert torch.equal(stats.routed_per_expert, ref.routed_per_expert), label
                    assert torch.equal(stats.tokens_per_expert, ref.tokens_per_expert), label
                    assert int(stats.tokens_per_rank.sum()) == int(ref.tokens_per_expert.sum()), label
                    dropped = torch.tensor([stats.dropped_assignments, stats.dropped_tokens])
                    dist.all_reduce(dropped)
                    assert dropped.tolist() == [ref.dropped_assignments, ref.dropped_tokens], label
                    assert set(stats.timings) == {"route_s", "dispatch_s", "experts_s", "combine_s", "wait_s",
                                                  "dispatch_bytes", "experts_s_per_rank", "straggler_s"}
                    phases = sum(stats.timings[p] for p in ("route_s", "dispatch_s", "experts_s", "combine_s"))
                    assert 0 < stats.timings["wait_s"] <= phases, label
                    per_rank = stats.timings["experts_s_per_rank"]
                    assert len(per_rank) == world and per_rank[rank] == stats.timings["experts_s"], label
                    assert stats.timings["straggler_s"] == max(per_rank) - per_rank[rank] >= 0, label
                if capacity_factor is None:
                    assert ref.dropped_assignments == 0 and int(ref.tokens_per_expert.sum()) == world * T_LOCAL * K
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_expert_parallel_equals_single_rank(world_size):
    assert spawn(_check, world_size, timeout=240) == [20] * world_size


def _indivisible(rank, world):
    with pytest.raises(ValueError, match="divisible by the expert-parallel group size"):
        MoELayer(H, F, 5, K, group=dist.group.WORLD)
    return True


def test_experts_not_divisible_by_ranks():
    assert spawn(_indivisible, 2, timeout=60) == [True, True]


def test_a_failing_rank_does_not_hang_the_exchange():
    with pytest.raises(RankFailed):
        spawn(_fail_on_rank_one, 2, timeout=60)


def _fail_on_rank_one(rank, world):
    layer = MoELayer(H, F, 4, K, group=dist.group.WORLD)
    x = torch.randn(5, H if rank == 0 else H + 1)
    layer(x)  # rank 1 raises a ValueError before any exchange; rank 0 then fails on the broken group


def _replicas(rank, world):
    """Skewed routing: replicas keep the output and gradients exact and flatten the per-rank load."""
    gen = torch.Generator().manual_seed(7)
    x_all = torch.randn(world * 40, H, generator=gen, dtype=torch.float64) + 1.0  # aligned with the skew
    g_all = torch.randn(world * 40, H, generator=gen, dtype=torch.float64)
    rows = slice(rank * 40, (rank + 1) * 40)
    full, plain = _layers(world, rank, ROUTERS[0], None, skew=True)
    with torch.no_grad():  # experts 0 and 1 (both on rank 0) take most tokens
        for layer in (full, plain):
            layer.router.weight[1] = layer.router.weight[0] * 0.9 + 0.05
    y_full = full(x_all.clone().requires_grad_())
    (y_full * g_all).sum().backward()
    plain(x_all[rows])
    load = full.last_stats.routed_per_expert
    plan = plan_replicas(load, world, E // world + 2)
    ep = MoELayer(H, F, E, K, group=dist.group.WORLD, replicas=plan).double()
    with torch.no_grad():
        ep.router.weight.copy_(full.router.weight)
    ep.load_expert_weights(full.experts.gate_up, full.experts.down)
    x_local = x_all[rows].clone().requires_grad_()
    y = ep(x_local)
    (y * g_all[rows]).sum().backward()
    ep.sync_replica_grads()
    assert torch.allclose(y, y_full[rows], atol=1e-12)
    index = torch.tensor(ep.slot_experts)
    assert torch.allclose(ep.experts.gate_up.grad, full.experts.gate_up.grad[index], atol=1e-12)
    assert torch.allclose(ep.experts.down.grad, full.experts.down.grad[index], atol=1e-12)
    return plain.last_stats.rank_imbalance, ep.last_stats.rank_imbalance


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_replicas_exact_and_balanced(world_size):
    results = spawn(_replicas, world_size, timeout=120)
    before, after = results[0]
    assert all(r == results[0] for r in results)  # every rank reports the same global figures
    assert before > 1.3 and after < before


def _bfloat16(rank, world):
    """bf16 rows travel in one exchange and their float32 router weights in a second; flash-attn's rule:
    the error vs the float64 layer is at most twice the one-rank bf16 layer's."""
    exact, _ = _layers(world, rank, ROUTERS[0], None, skew=False)
    full = copy.deepcopy(exact).to(torch.bfloat16)
    ep = MoELayer(H, F, E, K, group=dist.group.WORLD, overlap_chunks=2).to(torch.bfloat16)
    with torch.no_grad():
        ep.router.weight.copy_(full.router.weight)
    ep.load_expert_weights(full.experts.gate_up, full.experts.down)
    gen = torch.Generator().manual_seed(5)
    x_all = torch.randn(world * T_LOCAL, H, generator=gen).to(torch.bfloat16)
    rows = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    # the float64 reference gets the bf16-rounded router, so it routes like the bf16 layers
    exact.router.load_state_dict({name: t.double() for name, t in full.router.state_dict().items()})
    reference = exact(x_all.double())[rows]
    y = ep(x_all[rows])
    assert y.dtype == torch.bfloat16
    return float((y.double() - reference).abs().max()), float((full(x_all)[rows].double() - reference).abs().max())


@pytest.mark.parametrize("world_size", [2, 3])
def test_bfloat16_rows_and_float32_weights(world_size):
    for ep_error, one_rank_error in spawn(_bfloat16, world_size, timeout=60):
        assert 0 < ep_error <= 2 * one_rank_error
