"""Ring attention on gloo ranks against the float64 single-device reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringmoe.attention import AttentionSpec
from ringmoe.parallel import LAYOUTS, RingStats, ring_flash_attn_func, shard
from ringmoe.parallel.launch import RankFailed, spawn
from tests.helpers import max_err, random_qkv, reference_with_grads

# (heads, kv_heads, head_dim)
HEADS = [(4, 4, 16), (4, 2, 8)]


def _check_all(rank, world_size, chunk, backends):
    """Every layout x causal x dtype x head config; returns the worst errors seen."""
    seqlen = 2 * world_size * chunk
    worst = {}
    for layout in LAYOUTS:
        for causal in (True, False):
            for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 3e-5)):
                for heads, kv_heads, head_dim in HEADS:
                    for backend in backends:
                        seed = hash((world_size, layout, causal, str(dtype), heads, backend)) % 2**31
                        q, k, v, dout = random_qkv(seed, 2, seqlen, seqlen, heads, kv_heads, head_dim, dtype)
                        spec = AttentionSpec(head_dim**-0.5, causal)
                        want = reference_with_grads(q, k, v, dout, spec)
                        local = [shard(x, world_size, rank, layout).requires_grad_() for x in (q, k, v)]
                        stats = RingStats()
                        out, lse = ring_flash_attn_func(
                            *local, causal=causal, layout=layout, return_lse=True, backend=backend, stats=stats
                        )
                        out.backward(shard(dout, world_size, rank, layout))
                        got = (out, lse, *(x.grad for x in local))
                        names = ("out", "lse", "dq", "dk", "dv")
                        dims = (1, 2, 1, 1, 1)
                        for name, g, w, dim in zip(names, got, want, dims):
                            err = max_err(g, shard(w, world_size, rank, layout, dim=dim))
                            key = f"{layout}/{'causal' if causal else 'full'}/{dtype}/{heads}-{kv_heads}/{backend}/{name}"
                            assert err <= tol, f"rank {rank}: {key} error {err:.3g}"
                            worst[key] = err
                        assert len(stats.forward) == world_size and len(stats.backward) == world_size
                        sent = sum(s["bytes_sent"] for s in stats.forward)
                        kv_bytes = 2 * local[1].numel() * local[1].element_size()
                        assert sent == (world_size - 1) * kv_bytes
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_matches_reference(world_size):
    results = spawn(_check_all, world_size, 3, ("blockwise", "native"), timeout=240)
    assert len(results) == world_size and all(len(r) > 0 for r in results)


def _odd_chunk(rank, world_size):
    """Chunks of 5 tokens with the default backend: exercises the native kernel's slicing."""
    return _check_all(rank, world_size, 5, ("auto",))


def test_ring_auto_backend_odd_chunks():
    spawn(_odd_chunk, 3, timeout=240)


def _bad_input(rank, world_size):
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="multiple of 2"):
        ring_flash_attn_func(q[:, :5], q[:, :5], q[:, :5], layout="zigzag")
    with pytest.raises(ValueError, match="layout"):
        ring_flash_attn_func(q, q, q, layout="spiral")
    with pytest.raises(ValueError, match="same tokens"):
        ring_flash_attn_func(q, q[:, :4], q[:, :4])
    # the group is still usable: nothing was sent
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
    return True


def test_bad_input_raises_before_communication():
    assert spawn(_bad_input, 2, timeout=60) == [True, True]


def _one_rank_fails(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 is broken")
    dist.barrier()  # would hang forever without the launcher's failure handling


def test_failing_rank_fails_fast():
    import time

    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 is broken"):
        spawn(_one_rank_fails, 2, timeout=60)
    assert time.monotonic() - start < 30
