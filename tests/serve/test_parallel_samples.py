"""Parallel samples (n > 1) sharing the prompt's KV blocks, prompt logprobs, logit_bias and grammars in the engine.

The n samples of a prompt must be exactly the n requests one would send alone with seeds seed, seed + 1, ...
(same tokens, same logprobs) while the prompt is computed once and its blocks are shared (copy on write of
the partial last block); prompt logprobs must equal transformers' float64 log-softmax at every position,
whatever the chunking and the prefix cache do.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ringmoe.model import load_checkpoint
from ringmoe.parallel import make_mesh
from ringmoe.parallel.launch import spawn
from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.kv_cache import BlockManager, NoFreeBlocks

from .test_engine import _save

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

PROMPTS = [[5, 17, 3, 44, 9, 61, 2, 8, 30, 11, 70, 4, 19], [7, 7, 1], list(range(20, 52))]  # 13, 3, 32 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("samples")
    hf = _save("mixtral", path)
    return path, hf


def _engine(path, **options):
    return Engine(load_checkpoint(path, dtype=torch.float64), **{"block_size": 4, **options})


def _alone(engine, prompt, params, n):
    """The n samples sent as n separate requests, seeds seed .. seed + n - 1."""
    single = [SamplingParams(**{**_fields(params), "n": 1, "seed": params.seed + i}) for i in range(n)]
    return [(o.output_ids, [c.logprob for c in o.logprobs]) for o in engine.generate([prompt] * n, single)]


def _fields(params):
    return {k: getattr(params, k) for k in ("temperature", "top_p", "max_tokens", "seed", "logprobs", "ignore_eos")}


@pytest.mark.parametrize("settings", [dict(), dict(max_num_batched_tokens=5), dict(kv_cache_tokens=48)])
def test_n_samples_equal_separate_seeded_requests(checkpoint, settings):
    path, _ = checkpoint
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=11, logprobs=0, ignore_eos=True)
    engine = _engine(path, **settings)
    got = engine.generate(PROMPTS, params)
    assert [(o.group_id, o.index) for o in got] == [(g, i) for g in sorted({o.group_id for o in got}, key=int)
                                                     for i in range(4)]
    for p, prompt in enumerate(PROMPTS):
        mine = [(o.output_ids, [c.logprob for c in o.logprobs]) for o in got[4 * p:4 * p + 4]]
        assert mine == _alone(_engine(path), prompt, params, 4)
        assert len({tuple(ids) for ids, _ in mine}) > 1  # the samples differ from one another
    engine.blocks.check_integrity()
    assert engine.blocks.usage == 0 and not engine.requests
    if "kv_cache_tokens" in settings:
        assert engine.num_preemptions > 0


def test_n_samples_share_the_prompt_blocks(checkpoint):
    """While 4 samples of a 32-token prompt decode, they hold its 8 blocks once: 8 + 4 blocks, not 4 x 9."""
    path, _ = checkpoint
    engine = _engine(path)
    engine.add_request(PROMPTS[2], SamplingParams(n=4, max_tokens=3, ignore_eos=True, seed=1))
    peak = 0
    while engine.has_unfinished:
        engine.step()
        peak = max(peak, engine.blocks.num_blocks - engine.blocks.num_free)
    assert peak == 8 + 4


def test_copy_on_write_keeps_every_sample_exact_on_a_partial_block(checkpoint):
    """A 13-token prompt ends inside a block: each sample writes its tokens to its own copy of that block."""
    path, _ = checkpoint
    params = SamplingParams(n=3, temperature=0.9, max_tokens=9, seed=5, ignore_eos=True)
    got = [o.output_ids for o in _engine(path, prefix_caching=False).generate([PROMPTS[0]], params)]
    assert got == [ids for ids, _ in _alone(_engine(path), PROMPTS[0], params, 3)]


def test_block_manager_fork_and_copy_on_write():
    blocks = BlockManager(6, block_size=4)
    blocks.admit("a", list(range(6)))
    blocks.grow("a", 6)  # blocks x (positions 0-3) and y (4-5, partial)
    blocks.fork("a", "b")
    blocks.check_integrity()
    assert blocks.block_table("a") == blocks.block_table("b")
    copy = blocks.copy_on_write("b", 6)  # b writes position 6, in the shared y: it gets a copy
    assert len(copy) == 1 and copy[0] == (blocks.block_table("a")[1], blocks.block_table("b")[1])
    assert blocks.block_table("a")[0] == blocks.block_table("b")[0]  # the full block stays shared
    assert blocks.copy_on_write("a", 6) == []  # a holds y alone now
    blocks.check_integrity()
    blocks.fork("a", "c")
    blocks.fork("a", "d")
    blocks.grow("d", 9)
    assert blocks.copy_on_write("c", 6) and blocks.copy_on_write("d", 6) and blocks.num_free == 0
    blocks.fork("a", "e")
    with pytest.raises(NoFreeBlocks):
        blocks.copy_on_write("e", 6)
    blocks.check_integrity()
    for request in "abcde":
        blocks.release(request)
    blocks.check_integrity()
    assert blocks.usage == 0


def _reference_logprobs(hf, ids):
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))], logprobs


@pytest.mark.parametrize("settings", [dict(), dict(max_num_batched_tokens=6), dict(max_num_batched_tokens=7,
                                                                                      kv_cache_tokens=40)])
def test_prompt_logprobs_equal_transformers_whatever_the_chunking_and_cache(checkpoint, settings):
    path, hf = checkpoint
    engine = _engine(path, **settings)
    engine.generate([PROMPTS[2]], SamplingParams(max_tokens=2))  # warms the prefix cache with the same prompt
    out = engine.generate([PROMPTS[2], PROMPTS[0]], SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0))
    for o, prompt in zip(out, [PROMPTS[2], PROMPTS[0]]):
        want, table = _reference_logprobs(hf, prompt)
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(prompt)
        got = [c.logprob for c in o.prompt_logprobs[1:]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5  # logprobs are float32
        for position, choice in enumerate(o.prompt_logprobs[1:]):
            best = torch.topk(table[position], 3)
            assert [t for t, _ in choice.top] == best.indices.tolist()
            assert choice.rank == int((table[position] > table[position, choice.token]).sum()) + 1


def test_max_tokens_zero_returns_the_prompt_only(checkpoint):
    path, hf = checkpoint
    out = _engine(path).generate([PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))
    want, _ = _reference_logprobs(hf, PROMPTS[0])
    assert [o.index for o in out] == [0, 1]
    for o in out:
        assert o.output_ids == [] and o.finish_reason == "length"
        assert max(abs(c.logprob - w) for c, w in zip(o.prompt_logprobs[1:], want)) < 1e-5


def test_logit_bias_steers_sampling_and_leaves_logprobs_raw(checkpoint):
    path, _ = checkpoint
    engine = _engine(path)
    plain = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True))[0]
    forced = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True,
                                                          logit_bias={77: 100.0}))[0]
    assert forced.output_ids == [77] * 4 and plain.output_ids != forced.output_ids
    banned = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                          logit_bias={plain.output_ids[0]: -100.0}))[0]
    assert banned.output_ids[0] != plain.output_ids[0]
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(PROMPTS[1], SamplingParams(logit_bias={96: 1.0}))  # the vocabulary is 96


def _mesh_samples(rank, world, path, cp, ep):
    mesh = make_mesh(cp, ep)
    engine = Engine(load_checkpoint(path, mesh, "zigzag", dtype=torch.float64), block_size=4)
    if rank != 0:
        engine.run_worker()
        return None
    if cp > 1:  # a ring prefill keeps only the last position's state
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.add_request(PROMPTS[0], SamplingParams(prompt_logprobs=1))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=7, ignore_eos=True)
    got = [o.output_ids for o in engine.generate(PROMPTS, params)]
    engine.shutdown()
    for group in engine.groups:
        group.blocks.check_integrity()
        assert group.blocks.usage == 0
    return got


@pytest.mark.parametrize("cp, ep", [(1, 2), (2, 1)])
def test_n_samples_on_a_mesh_equal_one_process(checkpoint, cp, ep):
    path, _ = checkpoint
    got = spawn(_mesh_samples, cp * ep, str(path), cp, ep, timeout=240, stall_timeout=60)[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=7, ignore_eos=True)
    assert got == [o.output_ids for o in _engine(path).generate(PROMPTS, params)]


def test_grammar_choice_and_schema(served_checkpoint):
    pytest.importorskip("xgrammar")
    from ringmoe.serve.structured import GrammarBackend, GrammarSpec

    engine = Engine.from_checkpoint(served_checkpoint)
    backend = GrammarBackend(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
    choice = backend.compile(GrammarSpec("choice", json.dumps(["red", "green", "blue sky"])))
    assert backend.compile(GrammarSpec("choice", json.dumps(["red", "green", "blue sky"]))) is choice  # cached
    texts = [o.text for o in engine.generate(["colour?"] * 6, [SamplingParams(grammar=choice, seed=s, max_tokens=20)
                                                                for s in range(6)])]
    assert set(texts) <= {"red", "green", "blue sky"}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
              "required": ["ok", "kind"], "additionalProperties": False}
    grammar = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    for out in engine.generate(["json?"] * 3, SamplingParams(grammar=grammar, n=2, seed=1, max_tokens=40)):
        value = json.loads(out.text)
        assert out.finish_reason == "stop" and set(value) == {"ok", "kind"} and value["kind"] in "ab"
        assert " \n" not in out.text and "\t" not in out.text  # compact JSON
    with pytest.raises(ValueError, match="json_schema"):
        backend.compile(GrammarSpec("json_schema", '{"type": "object", "properties": 3}'))
