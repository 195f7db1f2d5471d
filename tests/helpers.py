"""Shared test helpers: seeded random inputs and the float64 oracle with its gradients."""

from __future__ import annotations

import torch

from ringmoe.attention import AttentionSpec, attention_reference


def random_qkv(seed, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=torch.float32, scale=1.0):
    """Seeded normal q (B, Sq, H, D), k, v (B, Sk, Hkv, D) and an upstream gradient dout; never zeros."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, seqlen_q, heads, head_dim, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def reference_with_grads(q, k, v, dout, spec: AttentionSpec, dtype=torch.float64):
    """Oracle (out, lse, dq, dk, dv), computed in ``dtype`` from the given inputs."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = attention_reference(*leaves, spec, compute_dtype=dtype)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), *(x.grad for x in leaves)


def oracle_with_sinks(q, k, v, sinks, dout, spec: AttentionSpec):
    """Float64 oracle of ``sum(out * dout) + lse.sum() / 4``: (out, lse, dq, dk, dv, dsinks or None)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    s = sinks.detach().double().requires_grad_() if sinks is not None else None
    out, lse = attention_reference(*leaves, spec, sinks=s)
    (torch.sum(out * dout) + 0.25 * lse.sum()).backward()
    return out.detach(), lse.detach(), *(x.grad for x in leaves), (s.grad if s is not None else None)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| in float64, over finite entries of b; 0 for empty tensors."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    finite = torch.isfinite(b)
    return (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0


def assert_generation_matches(hf, ours, ids: torch.Tensor, new: int, logits_tol: float, steps_tol: float) -> None:
    """ringmoe's ``ours`` against transformers' ``hf`` (float64, eos off): the logits of ``ids``, the greedy
    tokens of ``new`` steps, and every decoding step's logits against the whole sequence recomputed."""
    from ringmoe.serve import generate

    seqlen = ids.shape[1]
    with torch.no_grad():
        want = hf(ids).logits
    got = ours(ids)
    assert (got - want).abs().max() < logits_tol, (got - want).abs().max()
    hf_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                            pad_token_id=0)[:, seqlen:]
    run = generate(ours, ids, new, return_logits=True)
    assert torch.equal(run.tokens, hf_tokens)
    with torch.no_grad():  # every decoding step (paged cache, windows, sinks, latents) vs the full recompute
        teacher = hf(torch.cat([ids, run.tokens], dim=1)).logits[:, seqlen - 1:-1]
    assert (run.logits - teacher).abs().max() < steps_tol, (run.logits - teacher).abs().max()


MESH_ROWS, MESH_SEQ, MESH_VOCAB = 2, 28, 96


def mesh_ids(ep: int) -> torch.Tensor:
    return torch.randint(0, MESH_VOCAB, (MESH_ROWS * ep, MESH_SEQ), generator=torch.Generator().manual_seed(3))


def mesh_rank_run(rank, world, path, cp, ep, new, mla_ring="auto"):
    """One rank of a checkpoint on a cp x ep mesh: its logits of ``mesh_ids``, its rows, and generation."""
    from ringmoe.model import load_checkpoint
    from ringmoe.serve import generate
    from ringmoe.parallel import make_mesh, shard

    mesh = make_mesh(cp, ep)
    model = load_checkpoint(path, mesh, dtype=torch.float64)
    model.mla_ring = mla_ring
    ids = mesh_ids(ep)
    rows = ids[mesh.batch_rows(ids.shape[0])]
    local = shard(rows, cp, mesh.cp_rank, "zigzag", dim=1) if cp > 1 else rows
    run = generate(model, ids, new, return_logits=True)
    return model(local).tolist(), rows.tolist(), run.tokens.tolist(), run.logits.tolist()


def assert_mesh_matches(hf, results, cp, ep, new, logits_tol: float, steps_tol: float = 1e-5) -> None:
    """Every rank's results from ``mesh_rank_run`` against transformers: logits of its shard, greedy tokens,
    each decoding step's logits."""
    from ringmoe.parallel import shard

    ids = mesh_ids(ep)
    want_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)[:, MESH_SEQ:]
    for rank, (logits, rows, tokens, steps) in enumerate(results):
        with torch.no_grad():
            want = hf(torch.tensor(rows)).logits
            teacher = hf(torch.cat([ids, torch.tensor(tokens)], dim=1)).logits[:, MESH_SEQ - 1:-1]
        want = shard(want, cp, rank // ep, "zigzag", dim=1) if cp > 1 else want
        assert (torch.tensor(logits, dtype=torch.float64) - want).abs().max() < logits_tol, f"rank {rank}"
        assert torch.equal(torch.tensor(tokens), want_tokens), f"rank {rank}"
        assert (torch.tensor(steps, dtype=torch.float64) - teacher).abs().max() < steps_tol, f"rank {rank}: decode"


def assert_group_still_works(world: int) -> bool:
    """After bad input was refused: one all-reduce succeeds, so no rank had sent anything half-way."""
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    return True


def save_tiny_mixtral(path, seed: int = 0):
    """A tiny random Mixtral (vocab 64, 2 layers, 4 experts top-2) written by transformers' save_pretrained."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=40)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return path
