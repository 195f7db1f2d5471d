"""`ringmoe serve` as its users meet it: a live process on 127.0.0.1, the official openai client, httpx for
what the client cannot send, bounded load, disconnects, SIGTERM, and a rank that dies.

Every server is started on a free port and stopped by its PID (its ranks are its children)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ringmoe.serve import Engine, SamplingParams  # noqa: E402
from ringmoe.serve.bench import BenchConfig, run_benchmark  # noqa: E402

from ..served import MODEL, Server, alive, metric  # noqa: E402


@pytest.fixture(scope="module", params=[(1, 1), (2, 2)], ids=["1x1", "2x2"])
def server(served_checkpoint, request):
    s = Server(served_checkpoint, *request.param)
    yield s
    code, err = s.stop()  # SIGTERM: drained, workers released, exit 0 (on the mesh too)
    assert code == 0, err


def _offline_text(checkpoint, prompt: str, **params) -> str:
    engine = Engine.from_checkpoint(checkpoint)
    return engine.generate([prompt], SamplingParams(**params))[0].text


def test_completion_stream_and_offline_engine_agree(server, served_checkpoint):
    prompt = "def add(a, b):"
    plain = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    streamed = "".join(chunk.choices[0].text for chunk in server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True) if chunk.choices)
    offline = _offline_text(served_checkpoint, prompt, temperature=0, max_tokens=24)
    assert plain.choices[0].text == streamed == offline
    assert plain.usage.completion_tokens == 24 or plain.choices[0].finish_reason == "stop"
    assert plain.usage.prompt_tokens > 0 and plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens


def test_chat_streaming_with_usage_and_role(server):
    messages = [{"role": "user", "content": "print('hello, world')"}]
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 1
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"


def test_stop_seed_and_logprobs(server):
    free = server.client.completions.create(model=MODEL, prompt="for i in", max_tokens=20, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    stop = free[4:6]
    cut = server.client.completions.create(model=MODEL, prompt="for i in", max_tokens=20, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == free[:free.index(stop)]
    draws = [server.client.completions.create(model=MODEL, prompt="The quick", max_tokens=16, temperature=1.0,
                                              seed=42).choices[0].text for _ in range(2)]
    other = server.client.completions.create(model=MODEL, prompt="The quick", max_tokens=16, temperature=1.0,
                                             seed=43).choices[0].text
    assert draws[0] == draws[1] and draws[0] != other
    scored = server.client.completions.create(model=MODEL, prompt="The quick", max_tokens=5, temperature=0,
                                              logprobs=3).choices[0]
    assert len(scored.logprobs.token_logprobs) == len(scored.logprobs.tokens) >= 1
    assert all(lp <= 0 for lp in scored.logprobs.token_logprobs)
    assert all(len(top) == 3 for top in scored.logprobs.top_logprobs)
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[" * 100000, 400, None),  # nested past what the JSON parser recurses into
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "x " * 5000}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [1] * 5000}, 400, "stop_token_ids"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "model"),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(server, body, status, param):
    if isinstance(body, bytes):
        reply = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        reply = httpx.post(f"{server.url}/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_models_and_metrics(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("ringmoe:request_success_total", "ringmoe:time_to_first_token_seconds_bucket",
                 "ringmoe:inter_token_latency_seconds", "ringmoe:e2e_request_latency_seconds",
                 "ringmoe:request_queue_time_seconds", "ringmoe:num_requests_running", "ringmoe:num_requests_waiting",
                 "ringmoe:kv_cache_usage_perc", "ringmoe:prefix_cache_queries_total", "ringmoe:prefix_cache_hits_total",
                 "ringmoe:prompt_tokens_total", "ringmoe:generation_tokens_total", "ringmoe:expert_tokens_total"):
        assert name in text, name


def test_bounded_load_without_errors(server):
    result = run_benchmark(BenchConfig(server.url, MODEL, num_prompts=200, concurrency=32, input_len=(4, 40),
                                       output_len=(1, 12), timeout=60))
    assert result["errors"] == 0, result["error_examples"]
    assert result["completed"] == 200 and result["duration_s"] < 60


def test_disconnect_storm_frees_every_kv_block(server):
    def drop_mid_stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hello " * 30, "max_tokens": 400, "stream": True,
                                "ignore_eos": True}) as reply:
            for _ in reply.iter_lines():
                break  # one chunk, then hang up

    threads = [threading.Thread(target=drop_mid_stream) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(server.url, "ringmoe:kv_cache_usage_perc") == 0 and \
                metric(server.url, "ringmoe:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric(server.url, "ringmoe:kv_cache_usage_perc") == 0
    assert metric(server.url, "ringmoe:request_success_total") >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_sigterm_drains_in_flight_requests_then_exits_zero(served_checkpoint):
    s = Server(served_checkpoint)
    results = []

    def ask():
        with contextlib.suppress(Exception):
            results.append(s.client.completions.create(model=MODEL, prompt="hello world", max_tokens=48,
                                                       temperature=0, extra_body={"ignore_eos": True}))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    code, err = s.stop()  # SIGTERM while the requests run
    for t in threads:
        t.join(timeout=30)
    assert code == 0, err
    assert len(results) == 6 and all(r.usage.completion_tokens == 48 for r in results)


def test_a_full_queue_answers_429_and_every_request_ends(served_checkpoint):
    s = Server(served_checkpoint, 1, 1, "--max-waiting", "2", "--max-num-seqs", "1")
    try:
        result = run_benchmark(BenchConfig(s.url, MODEL, num_prompts=24, concurrency=24, input_len=(4, 8),
                                           output_len=(16, 16), timeout=60))
        assert result["completed"] + result["errors"] == 24 and result["completed"] >= 1
        assert result["errors"] >= 1 and all("HTTP 429" in e for e in result["error_examples"])
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


def test_a_rank_killed_during_load_ends_the_mesh_server_with_the_rank_named(served_checkpoint):
    s = Server(served_checkpoint, 2, 2)
    try:
        failures = []  # the load's calls fail once the server is gone: expected, kept out of the thread's exit

        def run_load():
            try:
                run_benchmark(BenchConfig(s.url, MODEL, num_prompts=64, concurrency=16, input_len=(8, 64),
                                          output_len=(32, 32), timeout=30))
            except Exception as error:
                failures.append(error)

        load = threading.Thread(target=run_load)
        load.start()
        # the kill comes under load: once requests run (the load makes its prompts first, ~1 s or more)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and metric(s.url, "ringmoe:num_requests_running") == 0:
            time.sleep(0.1)
        assert metric(s.url, "ringmoe:num_requests_running") > 0
        ranks = s.ranks()
        assert len(ranks) == 4
        killed = time.monotonic()
        os.kill(ranks[2], signal.SIGKILL)
        s.proc.wait(timeout=20)
        assert time.monotonic() - killed < 10
        err = s.stderr()
        assert s.proc.returncode not in (0, None)
        assert "rank 2 was killed by SIGKILL" in err, err
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in ranks):
            time.sleep(0.1)
        assert not any(alive(p) for p in ranks)
        load.join(timeout=60)
        assert not load.is_alive()
    finally:
        s.stop()


def test_without_max_tokens_a_long_prompt_gets_what_the_context_leaves(server):
    limit = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    long = "hello world " * 790  # 3950 tokens: the 4096-token KV cache (1x1) leaves 146, below the default 256
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": long, "temperature": 0,
                                                              "ignore_eos": True}, timeout=120)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["completion_tokens"] == min(256, limit - usage["prompt_tokens"])
