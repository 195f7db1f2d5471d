"""The engine-core process and its front ends: the wire format round-trips what the front end reads, several front
ends share one engine, and either side dying ends the whole server with a clear message and no process left.

(Every other live-server test runs through the same process boundary: it is ``ringmoe serve``'s default.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from ringmoe.serve import Engine, SamplingParams
from ringmoe.serve.engine import StepStats
from ringmoe.serve.request import RequestOutput
from ringmoe.serve.sampling import TokenChoice
from ringmoe.serve.speculative import SpeculationStats
from ringmoe.serve.structured import GrammarBackend, GrammarSpec, grammar_masks
from ringmoe.serve.wire import (decode, encode, output_from_wire, output_to_wire, params_from_wire, params_to_wire,
                                stats_from_wire, stats_to_wire)

from ..served import MODEL, Server, alive, children, descendants, metric

httpx = pytest.importorskip("httpx")


def _round_trip(value):
    return decode(encode(value))


def test_sampling_parameters_and_grammars_cross_the_wire(served_checkpoint):
    engine = Engine.from_checkpoint(served_checkpoint)
    backend = GrammarBackend(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
    grammar = backend.compile(GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}},'
                                                         ' "required": ["a"]}'))
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=-3, presence_penalty=0.5,
                            frequency_penalty=-0.25, repetition_penalty=1.1, stop=("\n\n", "END"),
                            stop_token_ids=(3, 7), max_tokens=40, min_tokens=2, ignore_eos=True, logprobs=3,
                            prompt_logprobs=1, n=2, logit_bias=((5, -100.0), (9, 2.5)), grammar=grammar)
    # the engine side loads the grammar with its own backend (another process: another vocabulary object)
    other = GrammarBackend(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
    back = params_from_wire(_round_trip(params_to_wire(params)), other.load)
    assert back.grammar is not grammar and back.grammar.spec == grammar.spec
    assert {f: getattr(back, f) for f in params.__dataclass_fields__ if f != "grammar"} == \
        {f: getattr(params, f) for f in params.__dataclass_fields__ if f != "grammar"}
    # the loaded grammar masks exactly as the compiled one, token after token of a valid output
    here, there = grammar.matcher(), back.grammar.matcher()
    for token in engine.tokenizer.encode('{"a": 12}', add_special_tokens=False):
        mask_here, mask_there = grammar_masks([here, there], engine.model.config.vocab_size)
        assert torch.equal(mask_here, mask_there) and (mask_here == 0).sum() < engine.model.config.vocab_size
        assert here.advance(token) == there.advance(token)
    with pytest.raises(ValueError, match="compiled json_schema grammar"):
        other.load(GrammarSpec("json_schema", '{"type": "string"}'), "not a grammar")
    with pytest.raises(ValueError, match="malformed"):
        params_from_wire([1, 2, 3], other.load)
    wired = params_to_wire(SamplingParams())
    wired[0] = -1.0  # a temperature no request could have: validated again on the engine side
    with pytest.raises(ValueError, match="temperature"):
        params_from_wire(wired, other.load)


def test_outputs_and_step_statistics_cross_the_wire():
    choice = TokenChoice(11, -0.25, [(11, -0.25), (4, -1.5)])
    prompt = [None, TokenChoice(7, -2.0, [(3, -0.5)], rank=4)]
    out = RequestOutput("r#1", [11, 12], "ab", False, None, [choice], [9, 11, 12], "xxab", {"ttft_s": 0.5},
                        group_id="r", index=1, prompt_logprobs=prompt)
    back = output_from_wire(_round_trip(output_to_wire(out)))
    assert (back.request_id, back.new_token_ids, back.text_delta, back.finished, back.group_id, back.index) == \
        ("r#1", [11, 12], "ab", False, "r", 1)
    assert back.logprobs == [choice] and back.prompt_logprobs == prompt and back.timings == {"ttft_s": 0.5}
    assert back.output_ids == [] and back.text == ""  # the whole text and ids travel with the last output only
    last = RequestOutput("r", [5], "!", True, "stop", [], [9, 11, 5], "xx!", {}, error=None, group_id="r")
    back = output_from_wire(_round_trip(output_to_wire(last)))
    assert (back.finished, back.finish_reason, back.output_ids, back.text) == (True, "stop", [9, 11, 5], "xx!")
    stats = StepStats(batch_tokens=9, num_sequences=3, running=2, waiting=5, kv_blocks_used=7, kv_usage=0.25,
                      prefix_hit_tokens=16, preempted=1, step_s=0.003, tokens_per_expert=[3, 0, 6],
                      tokens_per_ep_rank=[4, 5], ring_exposed_comm=0.5, dropped_tokens=2, prefix_query_tokens=40,
                      speculation=SpeculationStats(2, 6, 3, [2, 1, 0]))
    assert stats_from_wire(_round_trip(stats_to_wire(stats))) == stats


def _greedy(server: Server, prompt: str) -> str:
    return server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text


def test_two_api_servers_share_one_engine(served_checkpoint):
    s = Server(served_checkpoint, 1, 1, "--api-server-count", "2")
    try:
        deadline = time.monotonic() + 60  # healthy once one front end answers: the other may still be starting
        while len(s.frontends()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        frontends = s.frontends()
        assert len(frontends) == 2 and s.engine_process() is not None
        prompts = [f"def f{i}(x):" for i in range(12)]
        answers: dict[int, str] = {}

        def ask(i):
            answers[i] = _greedy(s, prompts[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        offline = Engine.from_checkpoint(served_checkpoint).generate(
            prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        assert [answers[i] for i in range(len(prompts))] == [o.text for o in offline]
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/stats").json()["ranks"][0]["requests"] == len(prompts)
        # /metrics sums both front ends (whichever answers): every request counted once, the engine's figures once
        for _ in range(4):
            assert metric(s.url, "ringmoe:request_success_total") == len(prompts)
            assert metric(s.url, "ringmoe:time_to_first_token_seconds_count") == len(prompts)
            assert metric(s.url, "ringmoe:generation_tokens_total") == 10 * len(prompts)
            assert metric(s.url, "ringmoe:expert_tokens_total") > 0
            assert metric(s.url, "ringmoe:num_requests_running") == 0
        tokenized = [httpx.post(f"{s.url}/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
        assert metric(s.url, "ringmoe:prompt_tokens_total") == sum(tokenized)
    finally:
        code, err = s.stop()
    assert code == 0, err  # SIGTERM: both front ends drained, then the engine stopped
    assert not any(alive(p) for p in frontends)


def _stream_until_error(server: Server, results: list) -> None:
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hello " * 8, "max_tokens": 2000, "stream": True,
                                "ignore_eos": True}) as reply:
            results.append("".join(reply.iter_lines()))
    except httpx.HTTPError as error:
        results.append(repr(error))


def test_a_killed_engine_process_ends_the_server_with_a_clear_error(served_checkpoint):
    s = Server(served_checkpoint, 1, 1)
    try:
        everything = [s.proc.pid, *descendants(s.proc.pid)]
        engine = s.engine_process()
        results: list = []
        reader = threading.Thread(target=_stream_until_error, args=(s, results))
        reader.start()
        time.sleep(1.0)
        os.kill(engine, signal.SIGKILL)
        s.proc.wait(timeout=20)
        reader.join(timeout=30)
        err = s.stderr()
        assert s.proc.returncode == 1, err
        assert "the engine core process was killed by signal 9: stopping the server" in err, err
        assert results and ("the engine core process stopped" in results[0] or "Error" in results[0]), results
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in everything):
            time.sleep(0.1)
        assert not any(alive(p) for p in everything)  # no front end, template worker or tracker left
    finally:
        s.stop()


def test_a_killed_front_end_stops_the_engine(served_checkpoint):
    s = Server(served_checkpoint, 2, 1)
    try:
        everything = [s.proc.pid, *descendants(s.proc.pid)]
        ranks = s.ranks()
        assert len(ranks) == 2 and _greedy(s, "def g(") != ""
        os.kill(s.frontends()[0], signal.SIGKILL)
        s.proc.wait(timeout=30)
        err = s.stderr()
        assert s.proc.returncode == 1, err
        assert "API server 0 was killed by signal 9: stopping the server" in err, err
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in everything):
            time.sleep(0.1)
        assert not any(alive(p) for p in everything)  # the engine process and both ranks stopped with it
        assert all(children(p) == [] for p in ranks if alive(p))
    finally:
        s.stop()


def test_the_engine_in_the_server_process_serves_the_same_tokens(served_checkpoint):
    """--engine-core thread (the fallback, and each rank's mode under torchrun): same answers, same routes."""
    prompts = ["def add(a, b):", "print('hello"]
    answers = {}
    for mode in ("thread", "process"):
        s = Server(served_checkpoint, 1, 1, "--engine-core", mode)
        try:
            assert (s.engine_process() is None) == (mode == "thread")
            answers[mode] = [_greedy(s, p) for p in prompts]
            assert metric(s.url, "ringmoe:generation_tokens_total") == 10 * len(prompts)
            assert httpx.get(f"{s.url}/stats").json()["ranks"][0]["requests"] == len(prompts)
        finally:
            code, err = s.stop()
        assert code == 0, err
    assert answers["thread"] == answers["process"] and all(answers["thread"])
