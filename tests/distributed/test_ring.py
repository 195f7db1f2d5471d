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
                        if causal and layout == "contiguous":
                            # a block travels only as far as the last rank that needs it: rank r holds blocks
                            # 0..r, and each goes on unless r is the last rank
                            assert sent == (0 if rank == world_size - 1 else rank + 1) * kv_bytes
                        else:
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


def _low_precision(rank, world_size):
    """bfloat16 shards: error vs float64 within 2x plain bfloat16 attention (flash-attn's rule)."""
    seqlen = 2 * world_size * 8
    for layout in LAYOUTS:
        q, k, v, dout = random_qkv(31, 1, seqlen, seqlen, 4, 2, 16, torch.bfloat16)
        spec = AttentionSpec(0.25, True)
        exact = reference_with_grads(q, k, v, dout, spec)
        plain = reference_with_grads(q, k, v, dout, spec, dtype=torch.bfloat16)
        local = [shard(x, world_size, rank, layout).requires_grad_() for x in (q, k, v)]
        out = ring_flash_attn_func(*local, causal=True, layout=layout, softmax_scale=0.25)
        out.backward(shard(dout, world_size, rank, layout))
        assert out.dtype == torch.bfloat16
        for name, g, p, e in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)),
                                 (plain[0], *plain[2:]), (exact[0], *exact[2:])):
            ours = max_err(g, shard(e, world_size, rank, layout))
            theirs = max_err(shard(p, world_size, rank, layout), shard(e, world_size, rank, layout))
            assert ours <= 2 * theirs + 1e-6, f"{layout} {name}: {ours:.3g} vs plain {theirs:.3g}"
    return True


def test_ring_bfloat16_within_twice_plain_pytorch():
    assert spawn(_low_precision, 2, timeout=120) == [True, True]


def _check_all_layouts_with(rank, world_size, backend):
    """Every layout, causal, fp32, through the given block kernel."""
    seqlen = 2 * world_size * 8
    for layout in LAYOUTS:
        q, k, v, dout = random_qkv(41, 1, seqlen, seqlen, 2, 1, 16)
        spec = AttentionSpec(0.25, True)
        want = reference_with_grads(q, k, v, dout, spec)
        local = [shard(x, world_size, rank, layout).requires_grad_() for x in (q, k, v)]
        out, lse = ring_flash_attn_func(*local, layout=layout, softmax_scale=0.25, return_lse=True, backend=backend)
        out.backward(shard(dout, world_size, rank, layout))
        for name, g, w, dim in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *(x.grad for x in local)),
                                   want, (1, 2, 1, 1, 1)):
            assert max_err(g, shard(w, world_size, rank, layout, dim=dim)) < 3e-5, f"{layout} {name}"
    return True


def test_ring_with_triton_block_kernel():
    pytest.importorskip("triton")
    from ringmoe.attention.triton_flash import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    assert spawn(_check_all_layouts_with, 2, "triton", timeout=240) == [True, True]
