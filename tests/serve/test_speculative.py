"""Speculative decoding: lossless (greedy tokens and their logprobs equal decoding without it, every family, one
process and 1 x 2; the sampling rule keeps the target distribution), rollback keeps the cache consistent, and bad
configurations are refused naming the key."""

from __future__ import annotations

import math

import pytest
import torch
import hypothesis
from hypothesis import strategies as st

from ringmoe.model import MoETransformer, preset
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn
from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.draft_budget import GoodputBudget
from ringmoe.serve.metrics import ServerMetrics
from ringmoe.serve.request import Request
from ringmoe.serve.speculative import NgramDrafter, SpeculationStats, SpeculativeConfig, verify_drafts

PATTERN = [5, 9, 17, 33, 2, 7]
PROMPTS = [PATTERN * 5, list(range(40, 60)) * 2, [3, 4] * 10 + [8], [11]]
NEW = [24, 17, 20, 9]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _model(family, seed=1, mesh=None):
    model = MoETransformer(preset(family), mesh).double()
    model.init_weights(seed, std=0.3)
    return model


class Oracle:
    """Proposes the known continuation (every draft accepted); ``wrong`` shifts it (every draft rejected)."""

    def __init__(self, prompts, continuations, wrong=False):
        self.sequences, self.wrong = [p + c for p, c in zip(prompts, continuations)], wrong

    def propose(self, tokens, k):
        for full in self.sequences:
            if full[:len(tokens)] == tokens:
                drafts = full[len(tokens):len(tokens) + k]
                return [(t + 1) % 64 for t in drafts] if self.wrong else drafts
        return []


def _decode(engine, prompts=PROMPTS, new=NEW, drafter=None, check_every_step=True, **params):
    """Every request's tokens and chosen-token logprobs over the whole stream, the cache checked at each step."""
    if drafter is not None:
        engine.drafter = drafter
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, logprobs=0, **(params or {"temperature": 0})))
           for p, n in zip(prompts, new)]
    tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [c.logprob for c in out.logprobs]
        if check_every_step:
            for group in engine.groups:
                group.blocks.check_integrity()
    for group in engine.groups:
        assert group.blocks.usage == 0
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


@pytest.mark.parametrize("family", ["tiny", "gpt-oss-tiny", "qwen2-moe-tiny", "olmoe-tiny", "deepseek-v3-tiny"])
def test_greedy_tokens_and_logprobs_equal_decoding_without_speculation(family):
    """Every draft accepted (an oracle drafter), every draft rejected, and n-gram lookup; a small cache that
    preempts, and a token budget that cuts drafts: the same tokens, logprobs equal to 1e-10 (float64)."""
    model = _model(family)
    want, want_logprobs = _decode(Engine(model, block_size=4))
    runs = [(dict(), Oracle(PROMPTS, want)), (dict(), Oracle(PROMPTS, want, wrong=True)), (dict(), None),
            (dict(kv_cache_tokens=72, max_num_batched_tokens=10), Oracle(PROMPTS, want))]
    for settings, drafter in runs:
        engine = Engine(model, block_size=4, speculative_config=NGRAM, **settings)
        got, logprobs = _decode(engine, drafter=drafter)
        assert got == want, (settings, drafter)
        assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y)) < 1e-10
        stats = engine.spec_stats
        if isinstance(drafter, Oracle):
            assert stats.num_draft_tokens > 20
            assert stats.num_accepted_tokens == (0 if drafter.wrong else stats.num_draft_tokens)
        if "kv_cache_tokens" in settings:
            assert engine.num_preemptions > 0


@pytest.mark.parametrize("family, mode", [("tiny", "static"), ("gpt-oss-tiny", "static"),
                                          pytest.param("tiny", "compiled", marks=pytest.mark.slow)])
def test_the_decode_graph_verifies_drafts(family, mode):
    """Drafts verified by the fixed-shape decode step (a token and its drafts as rows that see each other
    causally; windows and sinks with gpt-oss), compiled or not: every draft accepted, every one rejected, n-gram
    lookup and a cache that preempts give the tokens of decoding without speculation, float64 logprobs to 1e-10
    (the fixed-shape step; the compiled one to float32 rounding of the logits).  A step whose requests carry no
    drafts runs the graph of band 1 (each row sees its own new key only), the others the band of 1 + k; compiled,
    both were made at start-up: no step compiles."""
    from torch._dynamo.utils import counters

    model = _model(family)
    want, want_logprobs = _decode(Engine(model, block_size=4))
    tolerance = 1e-10 if mode == "static" else 1e-5
    runs = [(dict(), Oracle(PROMPTS, want)), (dict(), Oracle(PROMPTS, want, wrong=True)), (dict(), None),
            (dict(kv_cache_tokens=72), Oracle(PROMPTS, want))]
    seen = set()  # the bands the graph ran
    for settings, drafter in runs:
        engine = Engine(model, block_size=4, speculative_config=NGRAM, decode_graph=mode, max_num_seqs=4, **settings)
        graph = engine.runner.decode_graph
        bands, run, step = [], graph.run, graph.call  # per graph step: (items carry drafts, the band it ran)
        graph.run = lambda items, plan=None: (bands.append([any(item.drafts for item in items)]), run(items, plan))[1]
        graph.call = lambda *args, **options: (bands[-1].append(args[3].shape[1]), step(*args, **options))[1]
        compiled_before = counters["stats"]["unique_graphs"]
        got, logprobs = _decode(engine, drafter=drafter)
        assert got == want, (settings, drafter)
        assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y)) < tolerance
        assert all(band == (1 + NGRAM["num_speculative_tokens"] if drafted else 1) for drafted, band in bands)
        seen |= {band for _, band in bands}
        if mode == "compiled":
            assert counters["stats"]["unique_graphs"] == compiled_before
        assert graph.steps > 0
        if isinstance(drafter, Oracle):  # the graph verified drafts (and, with the oracle, most of them)
            assert graph.drafts_verified > 0.5 * engine.spec_stats.num_draft_tokens > 10
        if "kv_cache_tokens" in settings:
            assert engine.num_preemptions > 0
    assert seen == {1, 1 + NGRAM["num_speculative_tokens"]}


def test_prefix_cache_entries_hold_only_accepted_tokens():
    """After speculative requests, the same prompts + their outputs hit the cache for whole blocks and give the
    same tokens: no hash was taken over a rejected draft."""
    model = _model("tiny")
    want, _ = _decode(Engine(model, block_size=4))
    engine = Engine(model, block_size=4, speculative_config=NGRAM)
    _decode(engine, drafter=Oracle(PROMPTS, want, wrong=True))
    _decode(engine, drafter=Oracle(PROMPTS, want))
    for block in engine.blocks.blocks:  # every cached block's tokens are a run of some real sequence
        if block.hash is not None:
            assert any(_contains(p + w, list(block.tokens)) for p, w in zip(PROMPTS, want)), block.tokens
    hits = engine.blocks.hit_tokens
    extended = [p + w[:-1] for p, w in zip(PROMPTS, want)]
    again, _ = _decode(engine, extended, [1] * len(PROMPTS))
    assert engine.blocks.hit_tokens - hits >= sum((len(p) - 1) // 4 * 4 for p in extended)
    assert [a[0] for a in again] == [w[-1] for w in want]


def _mtp_model(seed=1, mesh=None):
    model = MoETransformer(preset("deepseek-v3-tiny").replace(mtp_layers=1), mesh).double()
    model.init_weights(seed, std=0.3)
    return model


@torch.no_grad()
def _dense_mtp_drafts(model, ids, k):
    """The MTP module's greedy drafts after ``ids`` (the last one not yet fed), computed densely from scratch:
    position i reads (h_i, t_{i+1}); the chained drafts read the module's own state and its previous draft."""
    tokens = torch.tensor([ids])
    previous, ahead = model.hidden_states(tokens[:, :-1]), tokens[:, 1:]
    drafts = []
    for _ in range(k):
        states = model.mtp_hidden_states(previous, ahead, torch.arange(ahead.shape[1]), model.causal_attention())
        drafts.append(int(model.lm_head(states[0, -1]).argmax()))
        previous = torch.cat([previous, states[:, -1:]], dim=1)
        ahead = torch.cat([ahead, torch.tensor([[drafts[-1]]])], dim=1)
    return drafts


@pytest.mark.parametrize("settings", [dict(), dict(kv_cache_tokens=72, max_num_batched_tokens=10),
                                      dict(kv_cache_dtype="fp8"), dict(decode_graph="static"),
                                      dict(kv_cache_dtype="fp8", decode_graph="static")])
def test_mtp_drafts_are_the_modules_guesses_and_decoding_stays_exact(settings):
    """DeepSeek-V3 with its MTP module (latent cache, MoE in the module): at every step each request's MTP drafts
    equal the module's greedy guesses computed densely from scratch (its paged cache caught up on exactly the
    accepted positions, chained drafts included); the tokens and float64 logprobs equal decoding without
    speculation, with the module's own drafts and with an oracle's (every draft accepted: several positions caught
    up per step), under preemption and a budget that cuts drafts, with an FP8 cache, and with the drafts verified
    by the fixed-shape decode graph (the module then runs over each step's rows inside it, and its other passes as
    graphs of their own), with an FP8 cache there too."""
    model = _mtp_model()
    want, want_logprobs = _decode(Engine(model, block_size=4, **{k: v for k, v in settings.items()
                                                                   if k == "kv_cache_dtype"}))
    oracle = Oracle(PROMPTS, want)
    for use_oracle in (False, True):
        engine = Engine(model, block_size=4, speculative_config=MTP, **settings)
        if use_oracle:
            engine.mtp.propose = lambda request, room: oracle.propose(request.all_ids, room)
        checked = 0
        step = engine.step

        def checked_step():
            nonlocal checked
            outputs = step()
            for request in engine.requests.values():
                if request.mtp_drafts and "kv_cache_dtype" not in settings:  # fp8 K/V: not the dense module's
                    assert request.mtp_drafts == _dense_mtp_drafts(model, request.all_ids, len(request.mtp_drafts))
                    checked += 1
            return outputs

        engine.step = checked_step
        got, logprobs = _decode(engine)
        assert got == want, (settings, use_oracle)
        assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y)) < 1e-10
        assert engine.spec_stats.num_draft_tokens > 20
        if use_oracle:
            assert engine.spec_stats.num_accepted_tokens == engine.spec_stats.num_draft_tokens
        assert checked > 10 or "kv_cache_dtype" in settings
        if "kv_cache_tokens" in settings:
            assert engine.num_preemptions > 0
        if "decode_graph" in settings:  # the drafts verified, the module's passes run, by graphs (its catch-ups
            # inside the model's steps: ``DRAFTED``)
            graph = engine.runner.decode_graph
            assert graph.drafts_verified > 10 and graph.mtp_passes > 10 and engine.mtp.caught_up_by_steps > 10


@pytest.mark.slow  # `make test-all` (the MTP engine compiles its steps' and its module's graphs: minutes)
def test_compiled_mtp_passes_draft_the_modules_guesses():
    """float32, compiled: the module's catch-up runs inside the model's graph step (its rows' greedy tokens read),
    its chained passes as its own graphs, called directly once compiled (their guards checked: ``conftest``), the
    head's greedy choice made inside them; every step's drafts are the module's guesses computed densely, and the
    tokens those of decoding without speculation."""
    model = _mtp_model().float()
    want, _ = _decode(Engine(model, block_size=4), new=[12, 10, 12, 6])
    engine = Engine(model, block_size=4, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                    decode_graph="compiled", max_num_seqs=4)
    step, checked = engine.step, []

    def checked_step():
        outputs = step()
        checked.extend(request.mtp_drafts == _dense_mtp_drafts(model, request.all_ids, len(request.mtp_drafts))
                       for request in engine.requests.values() if request.mtp_drafts)
        return outputs

    engine.step = checked_step
    got, _ = _decode(engine, new=[12, 10, 12, 6])
    graph = engine.runner.decode_graph
    assert got == want and len(checked) > 10 and all(checked)
    assert engine.mtp.caught_up_by_steps > 10 and graph.mtp_passes > 5 and graph.mtp_dispatch.direct_calls > 0


def _mtp_mesh_rank(rank, world, cp, ep, decode_graph):
    engine = Engine(_mtp_model(mesh=make_mesh(cp, ep)), block_size=4, speculative_config=MTP,
                    decode_graph=decode_graph)
    if rank != 0:
        engine.run_worker()
        return None
    reference, step, checked = _mtp_model(), engine.step, []

    def checked_step():  # the drafts the mesh computed are the module's guesses (one process, dense)
        outputs = step()
        for request in engine.requests.values():
            if request.mtp_drafts:
                checked.append(request.mtp_drafts == _dense_mtp_drafts(reference, request.all_ids,
                                                                        len(request.mtp_drafts)))
        return outputs

    engine.step = checked_step
    got = _decode(engine, check_every_step=False)
    engine.shutdown()
    graph = engine.runner.decode_graph
    return got, engine.spec_stats.num_draft_tokens, checked, graph.mtp_passes if graph is not None else None


@pytest.mark.parametrize("cp, ep, decode_graph", [(1, 2, "off"), (2, 1, "off"), (3, 1, "off"), (2, 2, "static")])
def test_mtp_drafting_on_a_mesh_gives_the_same_tokens(cp, ep, decode_graph):
    """ep = 2: the module's MoE exchanges its tokens between the ranks in passes of their own (every rank runs each
    catch-up and draft pass, with or without requests of its group); cp = 2, 3: the module's prompt pass runs as a
    ring prefill over the rows each rank kept of the model's, its later positions as sharded decodes; 2 x 2 with
    the decode graph: the module's decode-like passes run as its graph on every rank (the exchanges inside it)."""
    want, want_logprobs = _decode(Engine(_mtp_model(), block_size=4))
    (got, logprobs), drafted, checked, graph_passes = spawn(_mtp_mesh_rank, cp * ep, cp, ep, decode_graph,
                                                            timeout=180)[0]
    assert len(checked) > 10 and all(checked)
    assert got == want and drafted > 20
    assert graph_passes is None if decode_graph == "off" else graph_passes > 10
    assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y)) < 1e-10


def test_from_checkpoint_loads_the_mtp_layer_for_mtp_drafting(tmp_path):
    from ringmoe.model import save_pretrained

    model = _mtp_model()
    save_pretrained(model, tmp_path)
    plain = Engine.from_checkpoint(tmp_path, dtype=torch.float64)
    assert not list(plain.model.mtp_layers) and len(plain.runner.k_cache) == 3
    engine = Engine.from_checkpoint(tmp_path, dtype=torch.float64, speculative_config={"method": "mtp"})
    assert list(engine.model.mtp_layers) == ["3"] and len(engine.runner.k_cache) == 4
    assert _decode(engine)[0] == _decode(plain)[0] and engine.spec_stats.num_draft_tokens > 0


def _contains(sequence, run):
    return any(sequence[i:i + len(run)] == run for i in range(0, len(sequence) - len(run) + 1, len(run)))


def _mesh_rank(rank, world, family, cp, ep, want):
    engine = Engine(_model(family, mesh=make_mesh(cp, ep)), block_size=4, speculative_config=NGRAM)
    if rank != 0:
        engine.run_worker()
        return None
    runs = []
    for drafter in (Oracle(PROMPTS, want), Oracle(PROMPTS, want, wrong=True), None, "goodput"):
        if drafter == "goodput":  # n-gram lookup again, each step keeping the drafts that pay (the driver's choice)
            engine.draft_budget, drafter = GoodputBudget(), engine.speculative_config.drafter()
        before = (engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens)
        got = _decode(engine, drafter=drafter, check_every_step=False)
        runs.append((got, engine.spec_stats.num_draft_tokens - before[0],
                     engine.spec_stats.num_accepted_tokens - before[1]))
    engine.shutdown()
    return runs


@pytest.mark.parametrize("family, cp, ep", [("tiny", 1, 2), ("tiny", 3, 1), ("gpt-oss-tiny", 2, 1), ("tiny", 2, 2)])
def test_speculation_on_a_mesh_gives_the_same_tokens(family, cp, ep):
    """Drafts verified through the all-to-all (ep) and through the ring-sharded cache (cp: the drafts' K/V written
    round-robin over the cp ranks, each row attending to the positions up to its own on every rank, the parts
    merged; gpt-oss's windows and sinks): every draft accepted, every one rejected, n-gram lookup, and n-gram lookup
    with the drafts chosen by the goodput rule."""
    want, want_logprobs = _decode(Engine(_model(family), block_size=4))
    for index, ((got, logprobs), drafted, accepted) in enumerate(spawn(_mesh_rank, cp * ep, family, cp, ep, want,
                                                                       timeout=240)[0]):
        assert got == want, index
        assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y)) < 1e-10
        assert drafted > 20 or index >= 2
        assert accepted == (drafted if index == 0 else 0 if index == 1 else accepted)


def _chi_square(counts, probs, draws):
    return sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in enumerate(probs) if p > 0)


@pytest.mark.parametrize("drafts", [[4, 4], [0, 2]])  # a bad drafter (unlikely tokens), a good one
def test_the_acceptance_rule_keeps_the_target_distribution(drafts):
    """First and second emitted tokens over 6,000 seeded draws against the target's own distributions (temperature,
    top-k), for a deliberately bad drafter and a good one: chi-square below the 0.1% quantile."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0], [0.3, -0.5, 1.5, 0.0, -2.0], [1.0, 1.0, 0.0, -1.0, 0.5]])
    params = SamplingParams(temperature=0.9, top_k=4)
    from ringmoe.serve.sampling import truncated_probs

    first = truncated_probs(logits[0], params).tolist()
    generator = torch.Generator().manual_seed(7)
    draws, counts, second_counts, second_draws = 6_000, [0] * 5, [0] * 5, 0
    for _ in range(draws):
        chosen = verify_drafts(drafts, logits, params, generator)
        counts[chosen[0].token] += 1
        if chosen[0].token == drafts[0]:  # the second token is drawn given the first was the draft
            second_counts[chosen[1].token] += 1
            second_draws += 1
    assert _chi_square(counts, first, draws) < 18.47  # df 3-4, p = 0.001
    if second_draws > 500:
        second = truncated_probs(logits[1], params).tolist()
        assert _chi_square(second_counts, second, second_draws) < 18.47


@pytest.mark.parametrize("graph", ["off", "static"])
def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(graph):
    """Verification draws each emitted token as decoding does (one draw from the request's generator per token,
    going on while the draw is the draft), so a seeded request samples the same tokens with any drafter: every
    draft accepted, every one rejected, n-gram (float64, where the rows' logits agree to rounding); eagerly and
    from the logits a decode graph's head computed for every row of the step."""
    model = _model("tiny")
    want, want_logprobs = _decode(Engine(model, block_size=4), temperature=0.8, seed=11)
    for drafter in (Oracle(PROMPTS, want), Oracle(PROMPTS, want, wrong=True), None):
        engine = Engine(model, block_size=4, speculative_config=NGRAM, decode_graph=graph, max_num_seqs=4)
        got, logprobs = _decode(engine, drafter=drafter, temperature=0.8, seed=11)
        assert got == want
        assert max(abs(a - b) for x, y in zip(logprobs, want_logprobs) for a, b in zip(x, y)) < 1e-10
        assert engine.spec_stats.num_draft_tokens > 10
        if graph != "off":
            assert engine.runner.decode_graph.drafts_verified > 10


def test_a_draft_row_turning_nan_in_a_graph_step_ends_only_its_request():
    """The decode graph's greedy choices stand for the draws of a verification only while every row of the item
    has one: a request whose draft row reads a NaN (a draft token's embedding) ends alone with an error, keeping
    tokens it had before (at most those up to the poisoned one, as without drafts); the other requests of those
    steps decode as without speculation."""
    model = _model("tiny")
    want, _ = _decode(Engine(model, block_size=4))
    # a token request 0 generates past its first two, which nothing read before it (and no other request reads):
    # the oracle drafts it, so a verification row reads its embedding
    j, poison = next((j, t) for j, t in enumerate(want[0]) if j >= 2 and t not in PROMPTS[0] + want[0][:j]
                     and all(t not in prompt + tokens for prompt, tokens in zip(PROMPTS[1:], want[1:])))
    with torch.no_grad():
        model.embed_tokens.weight[poison] = float("nan")
    engine = Engine(model, block_size=4, speculative_config=NGRAM, decode_graph="static", max_num_seqs=4)
    engine.drafter = Oracle(PROMPTS, want)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(PROMPTS, NEW)]
    final = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.runner.decode_graph.drafts_verified > 0
    first = final[ids[0]]
    assert first.finish_reason == "error" and "NaN" in first.error
    assert 0 < len(first.output_ids) <= j + 1 and first.output_ids == want[0][:len(first.output_ids)]
    assert [final[i].output_ids for i in ids[1:]] == want[1:]


@pytest.mark.parametrize("family, spec", [("tiny", NGRAM), ("deepseek-v3-tiny", MTP)])
def test_the_deterministic_mode_keeps_its_bits_with_drafts(family, spec):
    """float32, deterministic mode with drafts (n-gram; DeepSeek-V3's MTP module): a request samples the same
    tokens and logprobs, bit for bit, alone or among the others under a token budget that cuts drafts (every row on
    the fixed tiles, one draw per token), and the tokens of the deterministic engine without speculation (whose
    lone decodes take the fast kernel: logprobs equal to float32 rounding)."""
    model = MoETransformer(preset(family).replace(mtp_layers=1 if spec is MTP else 0))
    model.init_weights(1, std=0.3)
    params = dict(temperature=0.8, seed=5)
    plain, plain_logprobs = _decode(Engine(model, block_size=4, deterministic=True), **params)
    busy = Engine(model, block_size=4, deterministic=True, speculative_config=spec, max_num_batched_tokens=7)
    tokens, logprobs = _decode(busy, **params)
    assert busy.spec_stats.num_draft_tokens > 0
    assert tokens == plain
    # the two kernels sum in other orders through every layer: float32 logprobs of ~-3 measured 1.7e-5 apart on
    # one of the machines these tests run on (under 1e-5 where CI last ran them)
    assert max(abs(a - b) for x, y in zip(logprobs, plain_logprobs) for a, b in zip(x, y)) < 1e-4
    for i, prompt in enumerate(PROMPTS):
        alone = _decode(Engine(model, block_size=4, deterministic=True, speculative_config=spec), [prompt], [NEW[i]],
                        **params)
        assert alone == ([tokens[i]], [logprobs[i]])


def test_grammar_constrained_requests_verify_drafts_under_their_masks(served_checkpoint):
    """A JSON-schema request with drafts: each row is drawn under the grammar's mask after the rows before it, so the
    text (greedy and seeded sampling) is the one decoding without drafts writes, whether every draft is accepted
    (an oracle), every one is rejected (drafts the grammar forbids) or n-gram lookup drafts."""
    pytest.importorskip("xgrammar")
    import json

    from ringmoe.serve.structured import GrammarBackend, GrammarSpec

    plain = Engine.from_checkpoint(served_checkpoint, dtype=torch.float64)
    backend = GrammarBackend(plain.tokenizer, plain.model.config.vocab_size, plain.eos_ids)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "enum": ["aa", "bb"]}}}, "required": ["name", "tags"], "additionalProperties": False}
    grammar = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    prompts = [plain.tokenizer.encode(p) for p in ("json? ", "give me an object: ", "{")]
    for sampling in (dict(temperature=0), dict(temperature=0.9, seed=3)):
        params = SamplingParams(grammar=grammar, max_tokens=30, **sampling)
        want = [o.output_ids for o in plain.generate(prompts, params)]
        for drafter in (Oracle(prompts, want), Oracle(prompts, want, wrong=True), None):
            engine = Engine(plain.model, tokenizer=plain.tokenizer, speculative_config=NGRAM)
            engine.drafter = drafter if drafter is not None else engine.drafter
            got = engine.generate(prompts, params)
            assert [o.output_ids for o in got] == want, (sampling, drafter)
            assert all(out.finish_reason in ("stop", "length") for out in got)
            if isinstance(drafter, Oracle):
                assert engine.spec_stats.num_draft_tokens > 10


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    assert [c.token for c in verify_drafts([1, 0], logits, greedy, None)] == [1, 0, 2]  # both, then the bonus
    assert [c.token for c in verify_drafts([1, 2], logits, greedy, None)] == [1, 0]  # the correction
    assert [c.token for c in verify_drafts([2, 0], logits, greedy, None)] == [1]
    with pytest.raises(Exception, match="NaN"):
        verify_drafts([1], torch.full((2, 3), float("nan")), greedy, None)


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(1, 3)
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest 3-gram match
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 5) == [7, 8, 1, 2, 3]
    assert drafter.propose([5, 6, 7, 6], 3) == [7, 6]  # no 2-gram or 3-gram recurs: the 1-gram "6"
    assert drafter.propose([1, 2, 3, 4], 3) == []
    assert NgramDrafter(2, 3).propose([5, 6, 7, 6], 3) == []
    assert drafter.propose([4, 4, 4, 4, 4, 4], 3) == [4, 4, 4]  # a loop: an occurrence with k tokens after it


def _scan_proposal(tokens, k, lookup_min, lookup_max):
    """The rule written as a plain scan: for n from max to min, the latest earlier occurrence of the last n tokens
    followed by k tokens, else the occurrence followed by the most."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        ends = [e for e in range(n, len(tokens)) if tokens[e - n:e] == tokens[-n:]]
        if ends:
            full = [e for e in ends if e + k <= len(tokens)]
            end = full[-1] if full else ends[0]
            return tokens[end:end + k]
    return []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_drafter_equals_the_plain_scan_on_random_contexts(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(200):
        length = int(torch.randint(1, 60, (), generator=gen))
        vocabulary = int(torch.randint(2, 6, (), generator=gen))  # few symbols: many repeats and loops
        tokens = torch.randint(0, vocabulary, (length,), generator=gen).tolist()
        k = int(torch.randint(1, 6, (), generator=gen))
        low = int(torch.randint(1, 4, (), generator=gen))
        high = low + int(torch.randint(0, 3, (), generator=gen))
        assert NgramDrafter(low, high).propose(tokens, k) == _scan_proposal(tokens, k, low, high), (tokens, k, low,
                                                                                                    high)


def test_drafting_stops_from_disable_by_batch_size_running_requests():
    """vLLM's disable_by_batch_size: with 4 requests running (>= 3) no step drafts; as requests finish and fewer
    than 3 run, drafting resumes; the tokens are those of decoding without speculation either way."""
    model = _model("tiny")
    want, _ = _decode(Engine(model, block_size=4))
    engine = Engine(model, block_size=4, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    drafted_while = []
    original = engine._propose_drafts

    def watch():
        original()
        drafted_while.append((len(engine.scheduler.running), any(r.draft_ids for r in engine.scheduler.running)))
    engine._propose_drafts = watch
    got, _ = _decode(engine, drafter=Oracle(PROMPTS, want))
    assert got == want
    assert not any(drafted for running, drafted in drafted_while if running >= 3)
    assert any(drafted for running, drafted in drafted_while if running < 3)


def test_bad_speculative_configs_are_refused_naming_the_key():
    for config, match in [({"method": "eagle"}, "method"), ({"method": "mtp", "prompt_lookup_max": 2}, "ngram"),
                          ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                          ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                          ({"draft_model": "x"}, "unsupported key"), ("not json", "JSON object"), ([1], "JSON object"),
                          ({"disable_by_batch_size": 0}, "disable_by_batch_size")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(config)
    with pytest.raises(ValueError, match="multi-token prediction"):
        Engine(_model("deepseek-v3-tiny"), speculative_config={"method": "mtp"})
    assert SpeculativeConfig.parse({"method": "mtp"}).num_speculative_tokens == 1
    assert SpeculativeConfig.parse({"method": "ngram"}).num_speculative_tokens == 4


def test_metrics_count_drafts_with_vllms_names():
    from ringmoe.serve.engine import StepStats

    metrics = ServerMetrics("m")
    spec = SpeculationStats()
    spec.record(3, 2)
    spec.record(3, 0)
    metrics.on_step(StepStats(speculation=spec), [])
    text = metrics.render().decode()
    for line in ('ringmoe:spec_decode_num_drafts_total{model_name="m"} 2.0',
                 'ringmoe:spec_decode_num_draft_tokens_total{model_name="m"} 6.0',
                 'ringmoe:spec_decode_num_accepted_tokens_total{model_name="m"} 2.0',
                 'ringmoe:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0'):
        assert line in text
    assert math.isclose(spec.mean_accepted_length, 2.0)


def test_a_server_with_speculation_streams_what_the_engine_writes_without_it(served_checkpoint):
    """`ringmoe serve --speculative-config` through the openai client: the same greedy text as the engine without
    speculation, and the drafts counted in /metrics."""
    import json

    from tests.served import MODEL, Server, metric

    prompt = "def add(a, b):\n    return a + b\n" * 4
    want = Engine.from_checkpoint(served_checkpoint).generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    server = Server(served_checkpoint, 1, 1, "--speculative-config", json.dumps(NGRAM))
    try:
        stream = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want[0].text
        assert metric(server.url, "ringmoe:spec_decode_num_drafts_total") > 0
    finally:
        server.stop()


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.lists(st.integers(0, 9), max_size=12),
                  st.lists(st.integers(0, 9), max_size=5), st.integers(0, 30), st.integers(0, 30))
def test_a_requests_ids_between_two_places_are_those_of_its_whole_context(prompt, output, drafts, start, length):
    """``Request.ids_between`` (a step's tokens of a request, its last token and drafts at decode) slices the
    prompt, outputs and drafts as one list would, across their borders and past the end."""
    request = Request("r", prompt, SamplingParams(), output_ids=list(output), draft_ids=list(drafts))
    assert request.ids_between(start, start + length) == (prompt + output + drafts)[start:start + length]
