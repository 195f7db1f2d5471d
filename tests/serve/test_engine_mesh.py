"""The engine on cp x ep gloo meshes: greedy tokens equal transformers' for every request of a mixed batch.

ep groups hold different requests (data parallel for attention) and meet in the MoE all-to-all every
step; under cp > 1 prompts are prefilled by ring attention and decoding merges the ranks' partials.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ringmoe.model import load_checkpoint
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn
from ringmoe.serve import Engine, SamplingParams

from .test_engine import NEW, _hf_greedy, _prompts, _save

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral-mesh")
    hf = _save("mixtral", path)
    return path, [_hf_greedy(hf, p, n) for p, n in zip(_prompts(), NEW)]


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-mesh")
    hf = _save("qwen3", path)
    return path, [_hf_greedy(hf, p, n) for p, n in zip(_prompts(), NEW)]


def _serve_rank(rank, world, path, cp, ep, layout, settings, abort_after, ulysses=1):
    mesh = make_mesh(cp, ep, ulysses=ulysses)
    engine = Engine(load_checkpoint(path, mesh, layout, dtype=torch.float64), **settings)
    if rank != 0:
        engine.run_worker()
        return None
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(_prompts(), NEW)]
    finals, steps, stats = {}, 0, []
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.output_ids
        stats.append(engine.last_stats)
        steps += 1
        if steps == abort_after:
            engine.abort(ids[3])
    engine.shutdown()
    for group in engine.groups:
        group.blocks.check_integrity()
        assert group.blocks.usage == 0
    preempted = sum(s.preempted for s in stats)
    expert_rows = sum(sum(s.tokens_per_expert) for s in stats)
    exchanges = sum(s["step"] == "all_to_all" for h in engine.runner.history for s in h["ring"].forward)
    return [finals.get(i) for i in ids], preempted, expert_rows, max(s.ring_exposed_comm for s in stats), exchanges


@pytest.mark.parametrize("cp, ep, layout, settings", [
    (1, 2, "zigzag", dict()),
    (1, 2, "zigzag", dict(max_num_batched_tokens=7, block_size=4)),
    (2, 1, "zigzag", dict(block_size=4)),
    (2, 2, "zigzag", dict(block_size=4)),
    (3, 1, "striped", dict(block_size=8)),
    (2, 1, "zigzag", dict(kv_cache_tokens=40, block_size=4)),   # preemption: recompute by ring prefill
])
def test_greedy_tokens_on_meshes_equal_transformers(checkpoint, cp, ep, layout, settings):
    path, want = checkpoint
    tokens, preempted, expert_rows, *_ = spawn(_serve_rank, cp * ep, str(path), cp, ep, layout, settings, -1,
                                              timeout=240, stall_timeout=60)[0]
    assert tokens == want
    assert expert_rows > 0
    if "kv_cache_tokens" in settings:
        assert preempted > 0


@pytest.mark.parametrize("cp, ep", [(2, 1), (1, 2), (2, 2)])
def test_qwen3_on_meshes_equals_transformers(qwen3_checkpoint, cp, ep):
    path, want = qwen3_checkpoint
    tokens, *_ = spawn(_serve_rank, cp * ep, str(path), cp, ep, "zigzag", dict(block_size=8), -1, timeout=240,
                       stall_timeout=60)[0]
    assert tokens == want


@pytest.mark.parametrize("cp, ep, ulysses, layout", [(2, 1, 2, "zigzag"), (4, 1, 2, "striped"), (2, 2, 2, "zigzag")])
def test_prompts_prefilled_by_ulysses_and_the_hybrid_equal_transformers(checkpoint, cp, ep, ulysses, layout):
    """The same layout shards and cache as the ring: only the prefill's attention changes (preemption included:
    a preempted request is prefilled again the same way)."""
    path, want = checkpoint
    tokens, preempted, *_, exchanges = spawn(_serve_rank, cp * ep, str(path), cp, ep, layout,
                                             dict(block_size=4, kv_cache_tokens=40, record_steps=True), -1, ulysses,
                                             timeout=240, stall_timeout=60)[0]
    assert tokens == want
    assert exchanges > 0  # the prompts went through Ulysses's all-to-alls
    if cp == 2:
        assert preempted > 0  # 40 cache tokens per rank: some requests were preempted and prefilled again


def test_abort_on_a_mesh(checkpoint):
    path, want = checkpoint
    tokens, *_ = spawn(_serve_rank, 4, str(path), 2, 2, "zigzag", dict(block_size=4), 2, timeout=240,
                       stall_timeout=60)[0]
    assert tokens[3] is None
    assert [t for i, t in enumerate(tokens) if i != 3] == [w for i, w in enumerate(want) if i != 3]


def test_serve_refuses_a_ulysses_degree_that_does_not_fit(checkpoint, capsys):
    from ringmoe.cli import main

    assert main(["serve", "--model", str(checkpoint[0]), "--cp", "2", "--ulysses-degree", "3"]) == 2
    assert "--ulysses-degree (3) must divide --cp (2)" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoint[0]), "--cp", "8", "--ulysses-degree", "8"]) == 2
    assert "--ulysses-degree: q heads" in capsys.readouterr().err


def test_fp8_kv_cache_on_a_mesh_equals_one_process(checkpoint):
    """FP8 KV cache on a 2x2 mesh: the ring prefill attends to K/V as the cache holds them (their e4m3 round trip),
    each cp rank caches codes of the positions it keeps and decodes merge the ranks' partials over them: the
    greedy tokens of the one-process fp8 engine."""
    path, _ = checkpoint
    settings = dict(block_size=4, kv_cache_dtype="fp8")
    tokens, *_ = spawn(_serve_rank, 4, str(path), 2, 2, "zigzag", settings, -1, timeout=240, stall_timeout=60)[0]
    engine = Engine(load_checkpoint(path, dtype=torch.float64), **settings)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(_prompts(), NEW)]
    finals = {}
    while engine.has_unfinished:
        finals.update({out.request_id: out.output_ids for out in engine.step() if out.finished})
    assert engine.runner.k_cache[0].dtype == torch.uint8
    assert tokens == [finals[i] for i in ids]
