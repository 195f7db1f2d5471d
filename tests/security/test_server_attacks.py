"""A live `ringmoe serve` attacked as a hostile client would (127.0.0.1 only, every loop bounded in count and time).

After every attack a normal seeded request must return the same text as before the attacks, and /metrics must
come back to 0 running requests and 0 KV blocks: a bad request harms only itself."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from ..served import MODEL, Server, metric  # noqa: E402

KEY = "sk-test-4f1d"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROBE = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0.8, "seed": 3}
LIMITS = ["--max-body-bytes", "200000", "--header-timeout", "2", "--body-timeout", "2", "--max-messages", "8",
          "--max-stop-strings", "4", "--graceful", "2", "--max-grammar-bytes", "1000000"]


def _idle(url: str, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if metric(url, "ringmoe:num_requests_running") == 0 and metric(url, "ringmoe:kv_cache_usage_perc") == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server(served_checkpoint):
    s = Server(served_checkpoint, 1, 1, *LIMITS, api_key=KEY)
    s.probe = httpx.post(f"{s.url}/v1/completions", json=PROBE, headers=AUTH, timeout=60).json()["choices"][0]["text"]
    yield s
    code, err = s.stop()
    assert code == 0, err


def _unharmed(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    again = httpx.post(f"{server.url}/v1/completions", json=PROBE, headers=AUTH, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == server.probe
    assert _idle(server.url), "a request or KV block was left behind"


def _post(server, body, path="/v1/completions", timeout=60):
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=timeout)


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 1e-300, "top_p": 1e-300},
                                    {"min_p": 1.0}, {"top_k": 1, "top_p": 1e-30, "repetition_penalty": 0.01}])
def test_extreme_sampling_values_are_served(server, fields):
    reply = _post(server, {**PROBE, **fields, "max_tokens": 6})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    _unharmed(server)


@pytest.mark.parametrize("fields, param", [
    ({"repetition_penalty": 1e-320}, "repetition_penalty"),
    ({"stop_token_ids": [10**6], "min_tokens": 1}, "stop_token_ids"),
    ({"seed": 2**70}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ["x" * 300]}, "stop"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"temperature": float("inf")}, None),
])
def test_values_that_used_to_kill_the_engine_get_a_400_naming_the_field(server, fields, param):
    body = json.dumps({**PROBE, **fields}).replace("Infinity", "1e999")
    reply = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    _unharmed(server)


def test_an_api_key_guards_v1_but_not_health_and_metrics(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        reply = httpx.post(f"{server.url}/v1/completions", json=PROBE, headers=headers)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert [m.id for m in server.client.models.list().data] == [MODEL]  # the SDK sends the key


def test_bodies_past_the_limit_get_413_declared_or_chunked(server):
    big = {**PROBE, "prompt": "x " * 150_000}
    assert _post(server, big).status_code == 413

    def chunks():
        for _ in range(40):
            yield b" " * 10_000
        yield json.dumps(PROBE).encode()

    reply = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                       headers={**AUTH, "content-type": "application/json"})
    assert reply.status_code == 413 and "max-body-bytes" in reply.json()["error"]["message"]
    _unharmed(server)


def _raw(server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(data)
    return sock


def test_a_body_that_never_finishes_gets_408_and_a_slowloris_crowd_is_closed(server):
    header = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n").encode()
    slow_body = _raw(server, header + b'{"model": ')
    crowd = [_raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(200)]
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    reply = _post(server, {**PROBE, "max_tokens": 2})  # a normal client is served meanwhile
    assert reply.status_code == 200 and time.monotonic() - start < 2
    assert b" 408 " in slow_body.recv(4096).split(b"\r\n")[0]
    for sock in crowd:  # headers never completed within --header-timeout: the server hung up
        sock.settimeout(10)
        assert sock.recv(100) == b""
        sock.close()
    slow_body.close()
    _unharmed(server)


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "hacker", "content": "hi"}], "messages.0.role"),
    ([{"role": "user", "content": "hi", "function_call": {"name": "x"}}], "messages.0.function_call"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}],
     "messages.0.content.0.type"),
    ([{"role": "user", "content": "hi"}] * 9, "messages"),
])
def test_chat_input_is_checked(server, messages, param):
    reply = _post(server, {"model": MODEL, "messages": messages, "max_tokens": 4}, "/v1/chat/completions")
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    _unharmed(server)


def test_text_parts_are_the_text_they_hold(server):
    asked = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    parts = _post(server, {**asked, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "print('hello,"}, {"type": "text", "text": "world')"}]}]}, "/v1/chat/completions")
    plain = _post(server, {**asked, "messages": [{"role": "user", "content": "print('hello,\nworld')"}]},
                  "/v1/chat/completions")
    assert parts.status_code == plain.status_code == 200
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert parts.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_a_prompt_too_long_for_the_context_is_refused_without_tokenizing_it(server):
    start = time.monotonic()
    reply = _post(server, {**PROBE, "prompt": "hello world " * 16_000})  # 192 KB: under the body limit
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert time.monotonic() - start < 1.0
    _unharmed(server)


def test_a_non_streaming_client_that_leaves_frees_its_kv_at_once(server):
    body = {**PROBE, "max_tokens": 2000, "ignore_eos": True, "prompt": "hello " * 20}
    with pytest.raises(httpx.ReadTimeout):
        _post(server, body, timeout=0.5)
    left = time.monotonic()
    assert _idle(server.url, 2.0)
    assert time.monotonic() - left < 1.0
    _unharmed(server)


@pytest.mark.slow  # `make test-all`
def test_memory_stays_flat_over_5000_requests(server):
    pid = server.proc.pid

    def rss() -> int:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096

    def burst(n):
        with httpx.Client(headers=AUTH, timeout=60) as client:
            def worker(count):
                for i in range(count):
                    reply = client.post(f"{server.url}/v1/completions",
                                        json={"model": MODEL, "prompt": [1 + i % 200, 7, 9], "max_tokens": 1})
                    assert reply.status_code == 200
            threads = [threading.Thread(target=worker, args=(n // 8,)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)

    burst(800)  # warm-up: allocator pools, caches
    before = rss()
    start = time.monotonic()
    burst(5000)
    assert time.monotonic() - start < 120
    grown = rss() - before
    assert grown < 24 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 5000 requests"
    _unharmed(server)


# -- a hostile checkpoint: a chat template that never ends, a token whose embedding is NaN -----------------------

@pytest.fixture(scope="module")
def hostile_checkpoint(served_checkpoint, tmp_path_factory):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("hostile")
    for file in served_checkpoint.iterdir():
        shutil.copy(file, path / file.name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                               "{{ messages[0]['content'] }}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][5] = float("nan")  # token 5 poisons what reads it
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_template_that_never_ends_and_nan_logits_harm_only_their_request(hostile_checkpoint):
    s = Server(hostile_checkpoint, 1, 1, "--template-timeout", "1", "--graceful", "2")
    try:
        healthy, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                start = time.monotonic()
                assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200
                healthy.append(time.monotonic() - start)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.monotonic()
        reply = httpx.post(f"{s.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 400 and "longer than 1 s" in reply.json()["error"]["message"]
        assert time.monotonic() - start < 5
        poisoned = httpx.post(f"{s.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": [1, 5, 9], "max_tokens": 4})
        clean = httpx.post(f"{s.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": [1, 6, 9], "max_tokens": 4, "temperature": 0})
        stop.set()
        watcher.join(timeout=10)
        # the engine ended that request alone; it is answered with the reason, in OpenAI's error shape
        assert poisoned.status_code == 500, poisoned.text
        assert poisoned.json()["error"]["type"] == "server_error" and "NaN" in poisoned.json()["error"]["message"]
        assert clean.status_code == 200 and clean.json()["choices"][0]["finish_reason"] == "length"
        assert max(healthy) < 0.5, f"/health took {max(healthy):.2f} s while the template ran"
        assert _idle(s.url)
    finally:
        code, err = s.stop()  # SIGTERM is obeyed: nothing holds the event loop
    assert code == 0, err


def test_sigterm_after_the_grace_period_ends_streams_with_an_error_event(served_checkpoint):
    s = Server(served_checkpoint, 1, 1, "--graceful", "1")
    events = []

    def listen():
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as reply:
            events.extend(line for line in reply.iter_lines() if line)

    listener = threading.Thread(target=listen)
    listener.start()
    time.sleep(1.0)
    start = time.monotonic()
    code, err = s.stop()
    listener.join(timeout=30)
    assert code == 0, err
    assert time.monotonic() - start < 10
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["type"] == "server_error" and "shutting down" in last["error"]["message"]


def test_a_grammar_too_big_to_send_is_refused_and_nothing_waits_for_it(server):
    """A schema of arrays nested 120 deep (3 KB) compiles to a grammar whose serialized form (~11 MB) would stall
    the engine core while it loads: refused past --max-grammar-bytes, made in a worker thread meanwhile, so other
    requests and /health go on; a plain schema is still served."""
    schema = '{"type": "array", "items": ' * 120 + '{"type": "integer"}' + "}" * 120
    body = ('{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "deep", "schema": %s}}}' % (MODEL, schema))
    answers = {}

    def deep():
        answers["deep"] = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=60,
                                     headers={**AUTH, "content-type": "application/json"})

    sender = threading.Thread(target=deep)
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        waits.append(time.monotonic() - start)
    sender.join()
    refused = answers["deep"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format", refused.text
    assert "--max-grammar-bytes" in refused.json()["error"]["message"]
    assert max(waits) < 0.5, waits
    plain = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "items": {
                "type": "integer"}}}}})
    assert plain.status_code == 200, plain.text
