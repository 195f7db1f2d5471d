"""The MoE transformer on cp x ep gloo meshes equals the single-device model: logits, gradients, generation."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import MoETransformer, preset
from ringmoe.serve import generate
from ringmoe.parallel import make_mesh, shard
from ringmoe.parallel.launch import RankFailed, spawn

CONFIG = preset("tiny")
SEQLEN = 24  # divisible by 2 * cp for cp in {1, 2, 3}: every layout shards it


def _models(cp, ep, layout, seed, chunks=1):
    mesh = make_mesh(cp, ep)
    model = MoETransformer(CONFIG.replace(overlap_chunks=chunks), mesh, layout).double()
    model.init_weights(seed, std=0.1)
    single = MoETransformer(CONFIG).double()
    single.init_weights(seed, std=0.1)
    return mesh, model, single


def _local(mesh, x, layout):
    rows = x[mesh.batch_rows(x.shape[0])]
    return shard(rows, mesh.cp, mesh.cp_rank, layout, dim=1) if mesh.cp > 1 else rows


def _train_step_rank(rank, world, cp, ep, layout, chunks):
    mesh, model, single = _models(cp, ep, layout, seed=5, chunks=chunks)
    gen = torch.Generator().manual_seed(17)
    batch = 2 * ep
    ids = torch.randint(0, CONFIG.vocab_size, (batch, SEQLEN), generator=gen)
    weight = torch.randn(batch, SEQLEN, CONFIG.vocab_size, generator=gen, dtype=torch.float64)
    want = single(ids)
    (want * weight).sum().backward()

    got = model(_local(mesh, ids, layout))
    (got * _local(mesh, weight, layout)).sum().backward()
    model.reduce_gradients()

    errors = {"logits": (got - _local(mesh, want, layout)).abs().max().item()}
    reference = dict(single.named_parameters())
    for name, param in model.named_parameters():
        expected = reference[name].grad
        if name in model.expert_parameters():
            slots = torch.tensor(model.layers[int(name.split(".")[1])].mlp.slot_experts)
            expected = expected.index_select(0, slots)
        errors[name] = (param.grad - expected).abs().max().item()
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-10, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"
    return errors


@pytest.mark.parametrize("cp,ep,layout,chunks", [(1, 1, "zigzag", 1), (2, 1, "zigzag", 1), (1, 2, "zigzag", 1),
                                                 (1, 2, "zigzag", 3), (2, 2, "zigzag", 1), (2, 2, "striped", 2),
                                                 (3, 1, "zigzag", 1), (3, 1, "contiguous", 1)])
def test_logits_and_gradients_match_single_device(cp, ep, layout, chunks):
    results = spawn(_train_step_rank, cp * ep, cp, ep, layout, chunks, timeout=120)
    assert all(r["logits"] < 1e-10 for r in results)


def _generate_rank(rank, world, cp, ep, layout, chunks):
    mesh, model, single = _models(cp, ep, layout, seed=8, chunks=chunks)
    gen = torch.Generator().manual_seed(23)
    prompt = torch.randint(0, CONFIG.vocab_size, (2 * ep, SEQLEN), generator=gen)
    want = generate(single, prompt, 6, return_logits=True)
    got = generate(model, prompt, 6, return_logits=True)
    assert torch.equal(got.tokens, want.tokens), f"rank {rank}: {got.tokens.tolist()} != {want.tokens.tolist()}"
    err = (got.logits - want.logits).abs().max().item()
    assert err < 1e-5, f"rank {rank}: logits differ by {err:.2e}"  # logits are returned in float32
    return got.tokens.tolist()  # plain lists: tensors would travel as shared memory of a dying process


@pytest.mark.parametrize("cp,ep,layout,chunks", [(2, 1, "zigzag", 1), (1, 2, "zigzag", 1), (2, 2, "zigzag", 3),
                                                 (3, 1, "striped", 1)])
def test_generate_matches_single_device_greedy(cp, ep, layout, chunks):
    """chunks=3 at ep=2: each decoding step has two tokens per rank, so one of the three chunks is empty."""
    tokens = spawn(_generate_rank, cp * ep, cp, ep, layout, chunks, timeout=120)
    assert all(t == tokens[0] for t in tokens)  # every rank returns every sequence
    assert torch.tensor(tokens[0]).shape == (2 * ep, 6)


def _bad_batch_rank(rank, world):
    mesh, model, _ = _models(1, 2, "zigzag", seed=1)
    generate(model, torch.zeros(3, SEQLEN, dtype=torch.int64), 2)


def test_batch_not_divisible_by_ep_fails_on_every_rank_before_communicating():
    with pytest.raises(RankFailed, match=r"batch \(3\) must be divisible by the expert-parallel degree"):
        spawn(_bad_batch_rank, 2, timeout=60)


def _mesh_mismatch_rank(rank, world):
    make_mesh(2, 2)


def test_mesh_must_cover_the_world():
    with pytest.raises(RankFailed, match=r"world size 2 must equal cp \* ep"):
        spawn(_mesh_mismatch_rank, 2, timeout=60)


def _dtype_rank(rank, world, cp, ep, dtype):
    """Prefill logits of 4 sequences on the mesh in ``dtype`` (float64 weights rounded to it)."""
    mesh = make_mesh(cp, ep)
    model = MoETransformer(CONFIG, mesh).double()
    model.init_weights(7, std=0.1)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 48), generator=torch.Generator().manual_seed(3))
    return generate(model.to(dtype), ids, 1, return_logits=True).logits.double()


def test_bfloat16_mesh_is_within_twice_the_one_process_bfloat16_error():
    """bf16 is not bitwise across meshes (the sum order differs): its error vs float64 obeys flash-attn's rule."""
    oracle = spawn(_dtype_rank, 1, 1, 1, torch.float64, timeout=60)[0]
    single = spawn(_dtype_rank, 1, 1, 1, torch.bfloat16, timeout=60)[0]
    mesh = spawn(_dtype_rank, 4, 2, 2, torch.bfloat16, timeout=120)[0]
    single_err = (single - oracle).abs().max().item()
    mesh_err = (mesh - oracle).abs().max().item()
    assert 0 < mesh_err <= 2 * single_err, (mesh_err, single_err)
