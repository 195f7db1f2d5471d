"""The decode graph on cp x ep gloo meshes (``DecodeGraph`` with the cp merge and the experts' exchanges as
operators of the graph): every rank runs the decode steps through it, and each such step's reported states equal
the eager step's run on the same items and cache right after it (float64, to 1e-10); the greedy tokens equal the
one-process model's, and the expert figures the eager engine's on the same mesh."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import MoETransformer, preset
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn
from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.compiled_dispatch import CompiledDispatch
from ringmoe.serve.decode_graph import LOGITS, DecodeGraph

from .test_window_cache import _greedy_reference

NEW = 7
# gpt-oss's attention: a sliding window on every other layer and a learned sink per head
WINDOWED = dict(attention_sinks=True, sliding_window=6, layer_types=("sliding_attention", "full_attention"))
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _model(settings: dict, mesh=None, layout: str = "zigzag") -> MoETransformer:
    settings = dict(settings)
    family = settings.pop("family", "tiny")
    model = MoETransformer(preset(family).replace(**settings), mesh, layout).double()
    model.init_weights(3, std=0.3)
    return model


def _prompts() -> list[list[int]]:
    """Odd lengths, one shorter than the cp degree (some ranks keep none of its prompt), and one holding every
    token of the vocabulary (whatever a request generates, the n-gram drafter finds it earlier and proposes)."""
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 13, 2)]
    return prompts + [torch.randperm(128, generator=gen).tolist()]


def _checked(runner) -> list[float]:
    """Wrap ``runner.step``: after each step the decode graph ran, the eager step runs the same items (on every
    rank: it joins the same collectives) on the cache as the graph left it (writing the same K/V again); kept per
    such step: the largest difference between the two steps' reported states."""
    step, diffs = runner.step, []

    def checked(items, plan=None):
        graphed = runner.decode_graph is not None and DecodeGraph.accepts(runner, items, plan)
        reports = step(items, plan)
        if graphed:
            graph, runner.decode_graph = runner.decode_graph, None
            try:
                eager = step(items, plan)
            finally:
                runner.decode_graph = graph
            assert reports.keys() - {LOGITS} == eager.keys()  # (one process: the graph's head output too)
            diffs.append(max(((reports[key] - eager[key]).abs().max().item() for key in eager), default=0.0))
        return reports

    runner.step = checked
    return diffs


def _rank(rank, world, cp, ep, layout, mode, settings, speculate, forms, max_num_seqs):
    CompiledDispatch.verify = True  # (as ``tests/conftest.py`` sets it in the test process)
    model = _model(settings, make_mesh(cp, ep), layout)
    for _, layer in model.moe_layers():  # the experts' form from these token counts on (``forward_static``)
        layer.mlp.gathered_below, layer.mlp.dense_below = forms
    engine = Engine(model, kv_cache_tokens=256, block_size=4, decode_graph=mode, max_num_seqs=max_num_seqs,
                    speculative_config=NGRAM if speculate else None)
    graph = engine.runner.decode_graph
    diffs = _checked(engine.runner)
    if rank != 0:
        engine.run_worker()
        return None, diffs, (graph.steps, graph.drafts_verified) if graph is not None else None, None
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in _prompts()]
    finals, per_expert = {}, []
    while engine.has_unfinished:
        finals.update((out.request_id, out.output_ids) for out in engine.step() if out.finished)
        per_expert.append(engine.last_stats.tokens_per_expert)
    engine.shutdown()
    figures = (graph.steps, graph.drafts_verified) if graph is not None else None
    experts = ([sum(column) for column in zip(*(row for row in per_expert if row))],
               [row["expert_rows"] for row in engine.rank_report])
    return [finals[i] for i in ids], diffs, figures, experts


GATHERED = (10**6, 10**6)  # each assignment its own product (the C kernel's switches aside: ``fit_static_forms``)
DENSE, GROUPED = (1, 10**6), (1, 2)  # every expert on every row; the sorted GEMMs (``grouped_experts``)


def _run(cp, ep, layout, mode, settings, speculate=False, forms=GATHERED, max_num_seqs=3):
    return spawn(_rank, cp * ep, cp, ep, layout, mode, settings, speculate, forms, max_num_seqs, timeout=600,
                 stall_timeout=300)


@pytest.mark.parametrize("cp, ep, layout, settings, speculate, forms", [
    (1, 2, "zigzag", {}, False, GATHERED),
    (1, 2, "zigzag", {}, False, GROUPED),
    (2, 1, "zigzag", WINDOWED, False, GATHERED),
    (3, 1, "striped", WINDOWED, False, GATHERED),
    (2, 2, "zigzag", {}, True, DENSE),
    (2, 2, "zigzag", {"family": "deepseek-v3-tiny"}, False, GATHERED),  # MLA: the latent cache, cp-sharded
])
def test_fixed_shape_decode_steps_on_meshes_equal_the_eager_steps(cp, ep, layout, settings, speculate, forms):
    """The graph's step run eagerly ("static"): every rank's reported states equal the eager step's, the tokens
    the one-process model's, the expert counts (per expert, and the rows each rank's experts computed) the eager
    engine's; each of the experts' three forms under expert parallelism (each rank's experts over every rank's
    rows); with n-gram drafts the graph verified some."""
    results = _run(cp, ep, layout, "static", settings, speculate, forms)
    tokens, _, _, experts = results[0]
    model = _model(settings)
    if not speculate:  # (drafting changes no token: the same reference)
        assert tokens == [_greedy_reference(model, prompt, NEW) for prompt in _prompts()]
    eager = _run(cp, ep, layout, "off", settings, speculate)[0]
    assert tokens == eager[0]
    assert experts == eager[3] and sum(experts[0]) > 0
    for _, diffs, (steps, _), _ in results:
        assert steps > 0 and len(diffs) == steps
        assert max(diffs) < 1e-10
    # (the ep group holding the request that drafts verified its drafts in the graph)
    assert (max(drafts for _, _, (_, drafts), _ in results) > 0) == speculate


def test_compiled_decode_steps_on_a_2x2_mesh_equal_the_eager_steps():
    """Compiled (one graph per rank and step shape, the collectives inside it), on cp = 2 x ep = 2 with windows
    and sinks: the tokens are the one-process model's, and each graph step's reported states the eager step's to
    1e-5 (not 1e-10: the RoPE tables are float32 in every step, as transformers computes them, and inductor's
    vectorised float32 cos / sin differ from the eager ones by an ulp, 6e-8: measured, one process alike).  One
    request at a time per ep group: the batch-1 graph only, compiled on four ranks sharing two cores in about a
    minute (the graph of more rows is the same function: run eagerly above, compiled on one rank in
    ``test_decode_graph.py`` and on meshes by ``bench_mesh_decode.py``)."""
    results = _run(2, 2, "zigzag", "compiled", WINDOWED, max_num_seqs=1)
    model = _model(WINDOWED)
    assert results[0][0] == [_greedy_reference(model, prompt, NEW) for prompt in _prompts()]
    for _, diffs, (steps, _), _ in results:
        assert steps > 0 and len(diffs) == steps
        assert max(diffs) < 1e-5
