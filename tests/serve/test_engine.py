"""The engine's greedy tokens equal transformers' greedy generate, whatever the batching does."""

from __future__ import annotations

import logging

import pytest
import torch

from ringmoe.model import load_checkpoint
from ringmoe.serve import Engine, SamplingParams

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 96
LENGTHS = [1, 5, 17, 40, 3, 64, 23]
NEW = [6, 3, 8, 5, 7, 4, 6]


def _save(kind, path):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  experts_implementation="eager", attn_implementation="eager", initializer_range=0.15)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                           intermediate_size=40, **common))
    elif kind == "deepseek":  # MLA: the engine's cache holds latents and decoding runs in the latent space
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{
            **common, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            intermediate_size=48, kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6, first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=16, norm_topk_prob=True, **common))
    model.save_pretrained(path)
    return model.double().eval()


def _prompts(seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _hf_greedy(hf, prompt, new):
    """transformers' model, greedy, recomputing the whole sequence each step (no cache to trust)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=["mixtral", "qwen3", "deepseek"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save(request.param, path)
    want = [_hf_greedy(hf, p, n) for p, n in zip(_prompts(), NEW)]
    return path, want


@pytest.mark.parametrize("setting", [
    dict(),                                                   # everything in one step when it fits
    dict(max_num_batched_tokens=7, block_size=4),             # tiny chunks: prompts split over many steps
    dict(kv_cache_tokens=96, block_size=8),                   # tiny cache: preemption and recompute
    dict(max_num_seqs=2, block_size=4),                       # few at a time
])
def test_greedy_tokens_equal_transformers(checkpoint, setting):
    path, want = checkpoint
    engine = Engine(load_checkpoint(path, dtype=torch.float64), **setting)
    outs = engine.generate(_prompts(), [SamplingParams(temperature=0, max_tokens=n) for n in NEW])
    assert [o.output_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    engine.blocks.check_integrity()
    assert engine.blocks.usage == 0  # every block released
    if "kv_cache_tokens" in setting:
        assert engine.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert engine.requests == {}  # finished requests leave the engine


def test_a_prompt_of_a_few_hundred_tokens_among_short_ones(checkpoint, tmp_path):
    path, want = checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    long = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    engine = Engine(load_checkpoint(path, dtype=torch.float64), max_num_batched_tokens=64, block_size=16)
    outs = engine.generate([long] + _prompts()[:3], [SamplingParams(temperature=0, max_tokens=n) for n in (5, *NEW[:3])])
    assert outs[0].output_ids == _hf_greedy(hf, long, 5)
    assert [o.output_ids for o in outs[1:]] == want[:3]


def test_prefix_cache_hits_give_the_same_tokens(checkpoint):
    path, want = checkpoint
    engine = Engine(load_checkpoint(path, dtype=torch.float64), block_size=4)
    prompts = _prompts()
    first = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in NEW])
    hits_before = engine.blocks.hit_tokens
    again = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in NEW])
    assert engine.blocks.hit_tokens - hits_before >= sum((n - 1) // 4 * 4 for n in LENGTHS)
    assert [o.output_ids for o in again] == [o.output_ids for o in first] == want


def test_abort_in_the_middle_frees_blocks_and_others_finish(checkpoint):
    path, want = checkpoint
    engine = Engine(load_checkpoint(path, dtype=torch.float64), block_size=4, max_num_batched_tokens=16)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n)) for p, n in zip(_prompts(), NEW)]
    engine.step()
    engine.step()
    engine.abort(ids[3])
    engine.blocks.check_integrity()
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.output_ids
    assert ids[3] not in finals and ids[3] not in engine.requests
    assert [finals[i] for i in ids if i != ids[3]] == [w for j, w in enumerate(want) if j != 3]
    assert engine.blocks.usage == 0


def test_bad_requests_raise_and_the_engine_keeps_serving(checkpoint):
    path, want = checkpoint
    engine = Engine(load_checkpoint(path, dtype=torch.float64), kv_cache_tokens=256)
    good = engine.add_request(_prompts()[2], SamplingParams(temperature=0, max_tokens=NEW[2]))
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        Engine(load_checkpoint(path), kv_cache_bytes=100)
    c = load_checkpoint(path).config
    per_token = (c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4 if c.mla  # MLA: one latent + RoPE key
                 else 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4)           # K and V, float32
    assert Engine(load_checkpoint(path), kv_cache_bytes=2**20).blocks.num_blocks == 2**20 // per_token // 16
    for prompt, params, match in [([], None, "at least one token"), ([1, VOCAB], None, "token ids must lie"),
                                  ([1] * 250, SamplingParams(max_tokens=10), "exceeds"),
                                  ("text", None, "need a tokenizer"), ([1, 2], "greedy", "SamplingParams")]:
        with pytest.raises((ValueError, TypeError), match=match):
            engine.add_request(prompt, params)
    outs = engine.generate([], [])
    assert outs == []
    final = {}
    while engine.has_unfinished:
        final.update((out.request_id, out.output_ids) for out in engine.step() if out.finished)
    assert final[good] == want[2]


def _run_one(engine, prompt, params, others=()):
    """Run ``prompt`` (among ``others``); its output ids and chosen logprobs."""
    for i, p in enumerate(others):
        engine.add_request(p, SamplingParams(temperature=0.8, seed=i, max_tokens=5, logprobs=2))
    target = engine.add_request(prompt, params)
    choices, final = [], None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == target:
                choices += out.logprobs
                final = out if out.finished else final
    return final.output_ids, [c.logprob for c in choices], [c.top for c in choices]


def test_deterministic_mode_is_bitwise_alone_busy_chunked_and_with_prefix_hits(checkpoint):
    path, _ = checkpoint
    model = load_checkpoint(path)  # float32: where batch-dependent rounding shows
    prompt = _prompts(9)[5]
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=12, logprobs=3)
    alone = _run_one(Engine(model, deterministic=True, prefix_caching=False), prompt, params)
    busy = _run_one(Engine(model, deterministic=True, prefix_caching=False), prompt, params, _prompts(4))
    chunked = _run_one(Engine(model, deterministic=True, max_num_batched_tokens=5, block_size=4,
                              prefix_caching=False), prompt, params, _prompts(5))
    warm = Engine(model, deterministic=True, block_size=4)
    _run_one(warm, prompt[:40] + [1, 2, 3], SamplingParams(max_tokens=2))  # caches the prompt's first blocks
    hit = _run_one(warm, prompt, params, _prompts(6))
    assert warm.blocks.hit_tokens >= 36
    assert alone == busy == chunked == hit


def test_nan_logits_end_only_their_request(checkpoint):
    """A token whose embedding is NaN poisons the requests that read it; every other request is untouched."""
    path, want = checkpoint
    model = load_checkpoint(path, dtype=torch.float64)
    poison = next(t for t in range(VOCAB) if all(t not in w for w in want))  # never generated by a clean request
    with torch.no_grad():
        model.embed_tokens.weight[poison] = float("nan")
    prompts = [p for p in _prompts() if poison not in p]
    clean = [w for p, w in zip(_prompts(), want) if poison not in p]
    engine = Engine(model, block_size=4)
    bad = engine.add_request([1, poison, 3], SamplingParams(temperature=0, max_tokens=5))
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=len(w))) for p, w in zip(prompts, clean)]
    final = {}
    while engine.has_unfinished:
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    assert final[bad].finish_reason == "error" and "NaN" in final[bad].error and final[bad].output_ids == []
    assert [final[i].output_ids for i in ids] == clean
    assert engine.requests == {} and engine.blocks.usage == 0


def test_stop_token_ids_past_the_vocabulary_are_refused_at_admission(checkpoint):
    path, _ = checkpoint
    engine = Engine(load_checkpoint(path))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(VOCAB + 3,), min_tokens=1))
    assert engine.requests == {} and not engine.has_unfinished
    # min_tokens bans the stop ids: covering the whole vocabulary they would leave nothing to choose (greedy would
    # take token 0, a banned one; a draw would fail on a NaN distribution)
    with pytest.raises(ValueError, match="stop_token_ids.*min_tokens"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=tuple(range(VOCAB)), min_tokens=2, temperature=0))
    assert engine.requests == {}
    out = engine.generate([[1, 2]], SamplingParams(stop_token_ids=tuple(range(VOCAB)), max_tokens=3, temperature=0))
    assert out[0].finish_reason == "stop" and len(out[0].output_ids) == 1  # without min_tokens nothing is banned


def test_prepacked_weights_give_the_plain_engines_tokens_and_logits(checkpoint):
    """float32 on a CPU the engine keeps packed copies of its matrices (``ringmoe.prepacked``: panels where
    ``panel_gemm`` runs, else oneDNN's): every family decodes the tokens of an engine with one copy, logits within
    float32 rounding, chunked and preempted too."""
    path, _ = checkpoint
    model = load_checkpoint(path, dtype=torch.float32)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in NEW]
    runs = {}
    for prepack in (False, True):
        engine = Engine(model, return_logits=True, prepack_weights=prepack, max_num_batched_tokens=9,
                        kv_cache_tokens=128, block_size=8)
        runs[prepack] = engine.generate(_prompts(), params)
        matrices = sum(p.numel() for name, p in model.named_parameters() if name != "embed_tokens.weight"
                       and p.dim() >= 2)
        assert engine.runner.prepacked_bytes == (4 * matrices if prepack else 0)
    # the serve memory check's estimate: an upper bound (it counts the norms' few values too)
    assert 4 * matrices <= model.config.prepacked_bytes(model.config.num_experts, 4) <= 1.05 * 4 * matrices
    for plain, fast in zip(runs[False], runs[True]):
        assert plain.output_ids == fast.output_ids and fast.logits is not None
        torch.testing.assert_close(fast.logits, plain.logits, rtol=1e-4, atol=1e-4)
    assert Engine(model, deterministic=True).runner.prepacked_bytes == 0  # fixed tiles are the point there
    with pytest.raises(TypeError, match="prepack_weights"):
        Engine(model, prepack_weights="no")
