"""Prompt chunks in the decode graph (``Engine(prefill_graph=True)``, ``DecodeGraph.prefill``): the same greedy
tokens and logits as the eager step for every family (windows and sinks, MLA, shared experts, dense layers), with
chunked prefill, prefix-cache hits, chunks cut into several calls, steps that mix them with decodes, an FP8 cache,
and compiled; the chunks the graph does not take run eagerly."""

from __future__ import annotations

import pytest
import torch

from ringmoe.serve import Engine, SamplingParams

from .test_decode_graph import FAMILIES, _assert_same, _model


def _prompts(seed: int, vocab: int = 128) -> list[list[int]]:
    """Prompts of 33-110 tokens (past the float64 models' sorted-experts edge: 32 rows), one a short one the graph
    leaves to the eager step, and one sharing the first 48 tokens of another (a prefix-cache hit of 3 blocks): in
    chunks of up to 64 tokens, the 110-token prompt's second chunk and the hit's rest run after cached keys."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [33, 110, 57, 5, 71]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    return prompts + [prompts[1][:48] + torch.randint(0, vocab, (40,), generator=gen).tolist()]


def _run(model, mode: str, prompts, prefill_rows: int | None = None, new: int = 6, **options):
    """(output ids, logits per request, the engine); the engine's ``chunks``: (start, tokens) of each prompt chunk
    its graph ran."""
    engine = Engine(model, decode_graph=mode, return_logits=True, max_num_batched_tokens=64, max_num_seqs=3,
                    **options)
    graph = engine.runner.decode_graph
    if prefill_rows is not None:
        graph.prefill_rows = prefill_rows
    engine.chunks = []
    if graph is not None:
        prefill = graph.prefill

        def recorded(items):
            engine.chunks += [(item.start, len(item.token_ids)) for item in items]
            return prefill(items)

        graph.prefill = recorded
    logits, finals = {}, {}
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    while engine.has_unfinished:
        for out in engine.step():
            logits.setdefault(out.request_id, []).append(out.logits)
            if out.finished:
                finals[out.request_id] = out
    engine.blocks.check_integrity()
    order = sorted(finals, key=lambda rid: int(rid.split("-")[-1]))
    return [finals[r].output_ids for r in order], [torch.stack(logits[r]) for r in order], engine


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_chunks_in_the_graph_equal_eager_for_every_family(family):
    """float64: the logits (float32 on the way out) equal the eager engine's, tokens equal; chunks of up to 64
    tokens (the 110-token prompt in two), a prefix-cache hit, prompts admitted beside running decodes."""
    model = _model(family)
    prompts = _prompts(seed=1)
    eager = _run(model, "off", prompts)
    graph = _run(model, "static", prompts, prefill_graph=True)
    runner = graph[2].runner
    starts = [start for start, _ in graph[2].chunks]
    assert len(starts) >= 5 and any(starts) and runner.split_steps > 0  # chunks after cached keys among them
    assert all(n >= 32 for _, n in graph[2].chunks)  # (shorter ones: eager)
    assert graph[2].blocks.hit_tokens >= 48
    _assert_same(eager, graph, atol=1e-6)


def test_prompt_chunks_in_the_graph_beside_requests_verifying_drafts():
    """n-gram drafts on repetitive prompts: the steps that admit a prompt run its chunk in the prompt graph beside
    the others' token-and-drafts rows in the decode graph; the same tokens and logits as the eager engine's
    speculating steps."""
    model = _model("olmoe-tiny")
    gen = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(0, 128, (9,), generator=gen).tolist() * 6)[:n] for n in (40, 53, 36, 47)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    eager = _run(model, "off", prompts, new=12, speculative_config=spec)
    graph = _run(model, "static", prompts, new=12, speculative_config=spec, prefill_graph=True)
    engine = graph[2]
    assert engine.chunks and engine.runner.decode_graph.drafts_verified > 0 and engine.runner.split_steps > 0
    _assert_same(eager, graph, atol=1e-6)


def test_a_chunk_past_the_graphs_rows_runs_as_several_calls():
    """A chunk longer than ``prefill_rows`` is cut into near-equal parts, each reading what the one before wrote."""
    model = _model("qwen2-moe-tiny")
    prompts = _prompts(seed=2)
    eager = _run(model, "off", prompts)
    graph = _run(model, "static", prompts, prefill_rows=40, prefill_graph=True)
    assert graph[2].runner.decode_graph.prefill_calls > _run(model, "static", prompts, prefill_graph=True)[2] \
        .runner.decode_graph.prefill_calls
    _assert_same(eager, graph, atol=1e-6)


def test_prompt_chunks_in_the_graph_with_an_fp8_cache():
    """The chunk's rows see their own K/V as the cache returns them (the e4m3 round trip), as the eager step does."""
    model = _model("tiny")
    prompts = _prompts(seed=3)
    eager = _run(model, "off", prompts, kv_cache_dtype="fp8")
    graph = _run(model, "static", prompts, prefill_graph=True, kv_cache_dtype="fp8")
    assert graph[2].runner.decode_graph.prefill_calls > 0
    _assert_same(eager, graph, atol=1e-6)


@pytest.mark.slow  # (~15 s with inductor's cache warm, ~50 s cold: ``make test-all``; the compiled attention of the
# chunk's rows runs in make test: tests/attention/test_paged_causal.py)
def test_compiled_prompt_chunks_equal_eager():
    """float32, compiled (torch's CPU flash kernel for the chunk's own keys, the C kernels for the cache and the
    experts): the eager engine's greedy tokens, logits within float32 rounding; the prompt graph compiled at start-up
    (no step compiles: called directly after its first call)."""
    model = _model("tiny", torch.float32)
    prompts = _prompts(seed=4)
    eager = _run(model, "off", prompts)
    graph = _run(model, "compiled", prompts, prefill_graph=True)
    decode_graph = graph[2].runner.decode_graph
    assert decode_graph.prefill_calls > 0 and decode_graph.dispatch.direct_calls > 0
    _assert_same(eager, graph, atol=2e-4)


def test_prefill_graph_needs_a_decode_graph():
    with pytest.raises(ValueError, match="prefill_graph"):
        Engine(_model("tiny"), prefill_graph=True)
    with pytest.raises(TypeError, match="prefill_graph"):
        Engine(_model("tiny"), decode_graph="static", prefill_graph=1)
