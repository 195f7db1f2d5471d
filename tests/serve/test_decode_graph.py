"""The decode graph (padded buckets, fixed-shape layer stack, torch.compile) computes what the eager step computes:
the same greedy tokens and the same logits, at every bucket boundary, for every family, with windows, sinks,
shared experts and dense layers, under preemption and prefix hits; and steps it cannot run fall back.

``make test`` runs the compiled graph in the bucket-boundary test (and the graph tests of other files); the compiled
twins of tests whose static variant checks the same steps, and the long-table test of the tensor-ops attention
form (the C kernel's is kept), are marked slow (``make test-all``): the suite stays within its time."""

from __future__ import annotations

import pytest
import torch

from ringmoe.model import MoETransformer, preset
from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.decode_graph import bucket

FAMILIES = ["tiny", "gpt-oss-tiny", "qwen2-moe-tiny", "olmoe-tiny", "qwen3-moe-dense-tiny", "deepseek-v3-tiny"]


def _model(name: str, dtype=torch.float64, seed: int = 0) -> MoETransformer:
    model = MoETransformer(preset(name))
    model.init_weights(seed, std=0.2)  # large enough that the logits disagree wherever the computation does
    return model.to(dtype)


def _prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=gen).tolist()
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


def _run(model, mode: str, prompts, new: int = 12, pads: bool | None = None, **engine_options):
    engine = Engine(model, decode_graph=mode, return_logits=True, **engine_options)
    if pads is not None:  # batches padded to buckets, as on a GPU (a CPU runs each step's own row count)
        engine.runner.decode_graph.pads = pads
    logits: dict[str, list] = {}
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            logits.setdefault(out.request_id, []).append(out.logits)
            if out.finished:
                finals[out.request_id] = out
    order = sorted(finals, key=lambda rid: int(rid.split("-")[-1]) if rid.split("-")[-1].isdigit() else rid)
    graph = engine.runner.decode_graph
    engine.blocks.check_integrity()
    if mode == "compiled" and not graph.pads and graph.steps > 2 * len(prompts):  # steps of shapes met before
        assert graph.dispatch.direct_calls > 0  # ran their graphs directly (the guards checked: ``conftest``)
    return ([finals[r].output_ids for r in order], [torch.stack(logits[r]) for r in order],
            graph.steps if graph is not None else 0, engine)


def _assert_same(eager, graph, atol):
    assert graph[0] == eager[0]  # greedy tokens
    for a, b in zip(eager[1], graph[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=atol)


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


@pytest.mark.parametrize("family", FAMILIES)
def test_static_step_equals_eager_for_every_family(family):
    """The fixed-shape step (eager): float64 logits equal the eager step's to 1e-10 (they are float32 on the
    way out: the comparison is as tight as float32 allows), tokens equal; 1..5 requests (a CPU runs each row
    count as it is: the padded buckets and the other expert forms have their own tests below)."""
    model = _model(family)
    for count in (1, 2, 3, 4, 5):
        prompts = _prompts(count, seed=count)
        eager = _run(model, "off", prompts)
        static = _run(model, "static", prompts)
        assert static[2] > 0 and eager[2] == 0
        _assert_same(eager, static, atol=1e-6)


def test_padded_buckets_equal_eager():
    """Batches padded to buckets (what a GPU runs: 3 rows as 4, 5 as 8; the padding rows write the scratch block
    only) compute the eager step's tokens and logits; so does the CPU's unpadded step (the default)."""
    model = _model("tiny")
    prompts = _prompts(5, seed=13)
    eager = _run(model, "off", prompts)
    _assert_same(eager, _run(model, "static", prompts, pads=True), atol=1e-6)
    _assert_same(eager, _run(model, "static", prompts, pads=False), atol=1e-6)


def test_warm_up_covers_each_side_of_every_expert_form():
    """Without padding the warm-up also runs the sizes where the experts' form switches."""
    model = _model("tiny", torch.float32)
    engine = Engine(model, decode_graph="static")
    graph = engine.runner.decode_graph
    block = graph.moe_blocks[0]
    edges = {-(-block.gathered_below // block.top_k), block.dense_below}
    assert set(block.static_form_edges()) == edges
    sizes = graph.warm_up_sizes(64)
    assert all({edge - 1, edge} <= set(sizes) for edge in edges) and {1, 2, 4, 8, 16, 32, 64} <= set(sizes)
    graph.pads = True
    assert graph.warm_up_sizes(64) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("form", ["dense", "grouped"])
def test_every_expert_form_equals_eager(form):
    """The experts' three forms of ``forward_static`` (the gathered one is the default at these sizes): every
    expert on every token (from ``gathered_below`` assignments), and from ``dense_below`` tokens the sorted
    GEMMs outside the graph."""
    model = _model("qwen2-moe-tiny")
    for _, layer in model.moe_layers():
        layer.mlp.gathered_below = 1
        if form == "grouped":
            layer.mlp.dense_below = 2
    prompts = _prompts(5, seed=11)
    _assert_same(_run(model, "off", prompts), _run(model, "static", prompts), atol=1e-6)


def test_the_lm_head_is_stored_input_major_on_cpus():
    """The runner keeps the LM head's weight transposed in memory: same parameter, values and shape, strides
    (1, vocab) (the equality tests above run with it)."""
    model = _model("tiny")
    before = model.lm_head.weight.detach().clone()
    prompts = _prompts(2, seed=12)
    _run(model, "static", prompts)
    weight = model.lm_head.weight
    assert weight.stride() == (1, weight.shape[0]) and torch.equal(weight, before)


@pytest.mark.parametrize("family", ["tiny", pytest.param("deepseek-v3-tiny", marks=pytest.mark.slow),
                                    pytest.param("gpt-oss-tiny", marks=pytest.mark.slow)])
def test_compiled_step_equals_eager_at_bucket_boundaries(family):
    """torch.compile's graph (inductor): float32 greedy tokens equal, logits within float32 rounding; batch
    sizes 1, 2, 3, 4 (a bucket's max) and 5 (max + 1), as they are and padded to buckets (a GPU's form);
    sliding windows and sinks (gpt-oss); MLA's latent cache, attended in the latent space (DeepSeek-V3)."""
    torch.manual_seed(0)
    model = _model(family, torch.float32)
    mla = family == "deepseek-v3-tiny"  # (its graphs compile slowest: a batch of one, and three rows padded or not)
    for count in (1, 3) if mla else (1, 2, 3, 4, 5):
        prompts = _prompts(count, seed=20 + count)
        eager = _run(model, "off", prompts, new=10)
        for pads in (False, True) if count in (3, 5) else (False,):
            compiled = _run(model, "compiled", prompts, new=10, pads=pads, max_num_seqs=4 if mla else 8)
            assert compiled[2] > 0
            _assert_same(eager, compiled, atol=2e-4)


@pytest.mark.slow  # `make test-all`
def test_compiled_step_under_preemption_and_prefix_hits():
    model = _model("tiny", torch.float32)
    prompts = _prompts(6, seed=5)
    tight = dict(kv_cache_tokens=96, block_size=8)
    eager = _run(model, "off", prompts, new=16, **tight)
    compiled = _run(model, "compiled", prompts, new=16, **tight)
    assert compiled[3].num_preemptions > 0 and compiled[2] > 0
    _assert_same(eager, compiled, atol=2e-4)
    shared = [prompts[0] * 3 + p for p in prompts[1:4]]
    engine = Engine(model, decode_graph="compiled", block_size=4)
    first = engine.generate(shared, SamplingParams(temperature=0, max_tokens=8))
    again = engine.generate(shared, SamplingParams(temperature=0, max_tokens=8))
    assert engine.blocks.hit_tokens > 0
    assert [o.output_ids for o in again] == [o.output_ids for o in first]
    assert [o.output_ids for o in first] == [o.output_ids for o in Engine(model).generate(
        shared, SamplingParams(temperature=0, max_tokens=8))]


def test_steps_the_graph_cannot_run_take_the_eager_path():
    """The deterministic mode, sampled and penalised requests mixed in: the same tokens as the eager engine; only
    plain decode-only steps go through the graph."""
    prompts = _prompts(3, seed=2)
    deterministic = Engine(_model("tiny"), decode_graph="static", deterministic=True)
    deterministic.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    assert deterministic.runner.decode_graph.steps == 0
    model = _model("tiny")
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=9, top_p=0.9),
              SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=9, min_tokens=3)]
    eager = Engine(model).generate(prompts, params)
    engine = Engine(model, decode_graph="static")
    static = engine.generate(prompts, params)
    assert engine.runner.decode_graph.steps > 0
    assert [o.output_ids for o in static] == [o.output_ids for o in eager]
    assert [[c.token for c in o.logprobs] for o in static] == [[c.token for c in o.logprobs] for o in eager]


@pytest.mark.parametrize("mode", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
def test_the_graphs_greedy_choices_are_plain_batchs(mode):
    """Graph steps choose as eager steps do: the tokens are the eager engine's, the chosen tokens'
    log-probabilities (``logprobs=0``) agree to float32 rounding, and sampled rows next to greedy ones draw as
    the eager engine draws them."""
    model = _model("tiny", torch.float32)
    prompts = _prompts(4, seed=31)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True, logprobs=0)

    def choices(engine, params):  # every request's choices, step by step
        ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        seen = {i: [] for i in ids}
        while engine.has_unfinished:
            for out in engine.step():
                seen[out.request_id] += out.logprobs
        return [seen[i] for i in ids]

    for params in ([greedy] * 4, [greedy, sampled, greedy, sampled]):
        eager = choices(Engine(model), params)
        engine = Engine(model, decode_graph=mode, max_num_seqs=4)  # (compiles the batch sizes up to 4 only)
        graph = choices(engine, params)
        assert engine.runner.decode_graph.steps > 0
        for a, b in zip(eager, graph):
            assert [c.token for c in b] == [c.token for c in a] and len(a) == 8
            torch.testing.assert_close(torch.tensor([c.logprob for c in b]), torch.tensor([c.logprob for c in a]),
                                       rtol=0, atol=1e-5)
            assert all(c.logprob < 0 for c in b)


@pytest.mark.parametrize("mode", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
def test_graph_steps_take_the_graphs_head_and_greedy_choice(mode):
    """Every graph step, of one row or more, applies the LM head and the greedy choice inside the graph
    (``HeadOutput`` reported): a greedy request's tokens and log-probabilities are the eager engine's (to float32
    rounding), alone or beside another, a seeded sampled one draws the eager engine's tokens from the graph's
    logits, and a request whose row turns NaN there ends alone with an error."""
    from ringmoe.serve.decode_graph import LOGITS, DecodeGraph

    model = _model("tiny", torch.float32)
    prompts = _prompts(2, seed=53)
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=7, ignore_eos=True, logprobs=0)
    heads = []  # per graph step: its rows, whether it reported the head's output
    run = DecodeGraph.run

    def spy(self, items, plan=None):
        reports = run(self, items, plan)
        heads.append((len(items), LOGITS in reports))
        return reports

    for params in (greedy, sampled):
        eager = Engine(model).generate(prompts[:1], params)[0]
        engine = Engine(model, decode_graph=mode, max_num_seqs=2)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DecodeGraph, "run", spy)
            alone = engine.generate(prompts[:1], params)[0]
            both = engine.generate(prompts, params)
        assert alone.output_ids == eager.output_ids and len(alone.output_ids) == 7
        for out, want in zip([alone, *both], [eager, *Engine(model).generate(prompts, params)]):
            assert out.output_ids == want.output_ids
            torch.testing.assert_close(torch.tensor([c.logprob for c in out.logprobs]),
                                       torch.tensor([c.logprob for c in want.logprobs]), rtol=0, atol=1e-5)
    assert (1, True) in heads and (2, True) in heads and all(reported for _, reported in heads)
    poisoned = _model("tiny", torch.float32)
    clean = Engine(model).generate(prompts[:1], greedy)[0].output_ids
    with torch.no_grad():
        poisoned.embed_tokens.weight[clean[1]] = float("nan")  # the second generated token's embedding
    engine = Engine(poisoned, decode_graph=mode, max_num_seqs=2)
    out = engine.generate(prompts[:1], greedy)[0]
    assert engine.runner.decode_graph.steps > 0
    assert out.finish_reason == "error" and "NaN" in out.error and out.output_ids == clean[:2]


@pytest.mark.parametrize("mode", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
def test_nan_logits_in_a_graph_step_end_only_their_request(mode):
    """A request whose decode reads a NaN (its first generated token's embedding) ends with an error in a graph
    step; the other requests of that step go on with the eager engine's tokens."""
    model = _model("tiny", torch.float32)
    prompts = _prompts(3, seed=41)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    clean = [o.output_ids for o in Engine(model).generate(prompts, params)]
    poison = clean[0][0]
    others = prompts[1:] + clean[1:]
    assert all(poison not in ids for ids in others)  # the seed's prompts and tokens leave request 0 alone
    poisoned = _model("tiny", torch.float32)
    with torch.no_grad():
        poisoned.embed_tokens.weight[poison] = float("nan")
    engine = Engine(poisoned, decode_graph=mode, max_num_seqs=4)
    out = engine.generate(prompts, params)
    assert engine.runner.decode_graph.steps > 0
    assert out[0].finish_reason == "error" and "NaN" in out[0].error and out[0].output_ids == clean[0][:1]
    assert [o.output_ids for o in out[1:]] == clean[1:]
    assert engine.requests == {}


@pytest.mark.parametrize("pads", [True, False])
def test_moe_statistics_count_the_real_rows_only(pads):
    """The graph's expert counts are the eager step's, and padding rows never reach them: three decodes (padded
    to 4 when the batch pads), then two (after the shortest request ends)."""
    model = _model("tiny")
    counts = {}
    for mode in ("off", "static"):
        engine = Engine(model, decode_graph=mode)
        if mode == "static":
            engine.runner.decode_graph.pads = pads
        for i, prompt in enumerate(_prompts(3, seed=9)):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True))
        counts[mode] = []
        while engine.has_unfinished:
            engine.step()
            stats = engine.last_stats
            if stats.batch_tokens == stats.num_sequences:  # a decode-only step
                assert sum(stats.tokens_per_expert) == stats.num_sequences * model.config.top_k * len(
                    model.moe_layers())
                counts[mode].append(stats.tokens_per_expert)
        if mode == "static":
            assert engine.runner.decode_graph.steps == len(counts[mode]) > 0
    assert counts["static"] == counts["off"]


@pytest.mark.parametrize("drafts", [False, True])
def test_a_step_admitting_a_prompt_runs_its_decode_rows_in_the_graph(drafts):
    """Two requests at a time, four of them of different lengths: each admission's step runs the running requests'
    rows (and their n-gram drafts) through the graph and the new prompt eagerly; every step's tokens, float64
    logits (1e-10) and expert counts are the eager engine's, step by step."""
    model = _model("tiny")
    pattern = [5, 9, 17, 33, 2, 7, 40]
    prompts = [pattern * 3, list(range(60, 75)) * 2, [3, 4] * 9 + [8], [11, 12, 13] * 4]
    spec = {"method": "ngram", "num_speculative_tokens": 3} if drafts else None
    runs = {}
    for mode in ("off", "static"):
        engine = Engine(model, decode_graph=mode, return_logits=True, max_num_seqs=2, speculative_config=spec)
        for prompt, new in zip(prompts, (7, 15, 11, 9)):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
        tokens, logits, counts = {}, {}, []
        while engine.has_unfinished:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logits.setdefault(out.request_id, []).append(out.logits)
            stats = engine.last_stats
            assert sum(stats.tokens_per_expert) == stats.batch_tokens * model.config.top_k * len(model.moe_layers())
            counts.append(stats.tokens_per_expert)
        engine.blocks.check_integrity()
        runs[mode] = (tokens, logits, counts, engine)
    (tokens, logits, counts, eager), (graph_tokens, graph_logits, graph_counts, engine) = runs["off"], runs["static"]
    assert engine.runner.split_steps >= 2 and eager.runner.split_steps == 0
    assert graph_tokens == tokens and graph_counts == counts
    for request_id, rows in logits.items():
        for a, b in zip(rows, graph_logits[request_id]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
    if drafts:
        assert engine.spec_stats.num_draft_tokens == eager.spec_stats.num_draft_tokens > 0


def test_bad_decode_graph_mode_is_refused():
    with pytest.raises(ValueError, match="decode_graph"):
        Engine(_model("tiny"), decode_graph="fast")


@pytest.mark.slow  # `make test-all`
@pytest.mark.parametrize("cp, ep", [(1, 1), (2, 1), (1, 2)])
def test_a_server_compiles_its_decode_step_and_answers_as_the_eager_one(served_checkpoint, cp, ep):
    """`ringmoe serve` compiles by default (the test servers pass --enforce-eager), on one rank or a mesh: greedy
    answers, streamed and whole, batched by concurrent clients, are the eager server's."""
    from concurrent.futures import ThreadPoolExecutor

    from ..served import MODEL, Server

    prompts = ["def add(a, b):", "The quick brown", "naïve café", "print('hello"]
    answers = []
    for compiled in (False, True):
        server = Server(served_checkpoint, cp, ep, compiled=compiled)
        try:
            assert ("decode step compiled" in server.stderr()) == compiled
            def ask(prompt, server=server):
                return server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                        extra_body={"ignore_eos": True}).choices[0].text
            with ThreadPoolExecutor(4) as pool:
                texts = list(pool.map(ask, prompts))
            streamed = "".join(c.choices[0].text for c in server.client.completions.create(
                model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0, stream=True,
                extra_body={"ignore_eos": True}))
            answers.append((texts, streamed))
        finally:
            server.stop()
    assert answers[1] == answers[0]
    assert answers[0][1] == answers[0][0][0]


@pytest.mark.parametrize("kernel", [pytest.param(False, marks=pytest.mark.slow), True])
def test_contexts_past_the_long_threshold_meet_a_graph_compiled_at_start_up(kernel, monkeypatch):
    """Inductor guards a compiled float32 sum on its length being <= LONG_SUM (past it the sum takes another form):
    the attention sums within blocks first, so a table of up to LONG_SUM blocks (65,536 keys here) runs the graph
    compiled on a short one; with a cache of more blocks the warm-up compiles wider tables too, so no serving step
    compiles; with a cache of fewer, a wider table (never met in serving) would compile.  Where the cached keys are
    read by ``paged_cpu``'s C kernel (``kernel``) the graph holds no sum over the keys: no width compiles again."""
    import types

    from torch._dynamo.utils import counters

    from ringmoe import panel_gemm
    from ringmoe.attention import paged_cpu
    from ringmoe.serve.decode_graph import LONG_SUM

    if kernel and not panel_gemm.available():
        pytest.skip("the C kernel does not run on this machine")
    if not kernel:  # the graphs traced here take the tensor-ops attention
        monkeypatch.setattr(paged_cpu, "panel_gemm", types.SimpleNamespace(_library=lambda: None))
    model = _model("tiny", torch.float32)
    rows = 2 if kernel else 1  # (a single row takes the kernel only where it is registered from C: ``paged_decode``)
    torch._dynamo.reset()  # no graph of an earlier test (the compiled code is kept per function, not per engine)
    for blocks, compiles in ((LONG_SUM // 2, not kernel), (LONG_SUM + 64, False)):
        engine = Engine(model, decode_graph="compiled", max_num_seqs=rows, kv_cache_tokens=blocks * 16,
                        block_size=16)
        graph = engine.runner.decode_graph
        before = counters["stats"]["unique_graphs"]
        with torch.no_grad():  # as the engine's steps run
            graph._run_scratch(rows, 5, 1)
            graph._run_scratch(rows, 300, 1)  # 4,800 keys: one sum over every key would be past LONG_SUM
            graph._run_scratch(rows, LONG_SUM + 40, 1)
        assert (counters["stats"]["unique_graphs"] > before) == compiles, blocks
    torch._dynamo.reset()  # no graph of this test's attention form left for a later test


def test_two_models_of_the_same_shapes_each_run_their_own_graph():
    """The graphs are compiled per model (``compiled_step``): a second model of the same shapes in the process
    never runs the first one's graph, whose constants (its experts' operator keys among them) are the first
    model's: steps in the sorted-GEMM form (from one row here), each model's tokens and logits those of its own
    eager step.  A model that is freed leaves the table of compiled steps."""
    import gc

    from ringmoe.serve import decode_graph

    prompts = _prompts(1, seed=7)
    for seed in (1, 2):
        model = _model("tiny", torch.float32, seed=seed)
        for _, layer in model.moe_layers():
            layer.mlp.gathered_below = layer.mlp.dense_below = 1  # the operator's form from one row
        eager = _run(model, "off", prompts, new=6)
        compiled = _run(model, "compiled", prompts, new=6, max_num_seqs=1)
        assert compiled[2] > 0
        _assert_same(eager, compiled, atol=2e-4)
    assert decode_graph._COMPILED.get(model)[False] is compiled[3].runner.decode_graph.fn
    # models of earlier tests (and the first one here) that reference cycles hold go first: counted after, they
    # would stand in for this one
    gc.collect()
    before = len(decode_graph._COMPILED)
    del model, compiled, eager  # (the eager engine holds the model too)
    gc.collect()
    assert len(decode_graph._COMPILED) == before - 1
