"""The OpenAI API as real clients use it, against a live `ringmoe serve` on 127.0.0.1: the openai SDK (batched
prompts, echo and logprobs, n, logit_bias, structured outputs, tools with every tool_choice, streamed tool calls),
LangChain, litellm, and httpx for the endpoints and the error shapes.  The tiny random model can only pass
the JSON-schema and tool tests through constrained decoding."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from ..served import MODEL, Server

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

ORIGIN = "http://client.example"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                             "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def server(served_checkpoint):
    s = Server(served_checkpoint, 1, 1, "--allowed-origins", ORIGIN, "--enable-log-requests", "--log-stats", "1")
    yield s
    s.stop()


def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _greedy(server, prompt, **extra):
    return server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, **extra)


# -- /v1/completions -----------------------------------------------------------------------------------------
def test_a_batch_of_prompts_answers_each_in_order(server):
    prompts = ["def add(a, b):", "The quick brown", "naïve café"]
    batch = _greedy(server, prompts)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [_greedy(server, p).choices[0].text for p in prompts]
    ids = _post(server, "/tokenize", {"model": MODEL, "prompt": prompts[1]})["tokens"]
    as_ids = _greedy(server, [ids, ids[:2]])
    assert as_ids.choices[0].text == batch.choices[1].text
    assert as_ids.choices[1].text == _greedy(server, ids[:2]).choices[0].text
    single_ids = _greedy(server, ids)
    assert single_ids.choices[0].text == batch.choices[1].text
    assert batch.usage.prompt_tokens == sum(_greedy(server, p).usage.prompt_tokens for p in prompts)


def test_echo_with_logprobs_and_max_tokens_zero_score_the_prompt(server, served_checkpoint):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    prompt = "The quick brown fox jumps"
    scored = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    ids = _post(server, "/tokenize", {"model": MODEL, "prompt": prompt})["tokens"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(served_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        table = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    want = [float(table[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-4
    assert "".join(lp.tokens) == prompt and lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    generated = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                                 temperature=0)
    g = generated.choices[0]
    assert g.text.startswith(prompt) and len(g.logprobs.tokens) == len(ids) + 3
    assert g.logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
    extra = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0,
                                                             "prompt_logprobs": 1}).json()["choices"][0]
    assert extra["prompt_logprobs"][0] is None
    first = extra["prompt_logprobs"][1][str(ids[1])]
    assert abs(first["logprob"] - want[0]) < 1e-4 and first["rank"] >= 1


def test_n_samples_are_the_seeded_requests_and_stream_interleaved(server):
    many = server.client.completions.create(model=MODEL, prompt=["Hello", "abc"], n=3, max_tokens=5, seed=4,
                                            temperature=1.0)
    assert [c.index for c in many.choices] == list(range(6))
    for p, prompt in enumerate(["Hello", "abc"]):
        for i in range(3):
            alone = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, seed=4 + i,
                                                     temperature=1.0)
            assert many.choices[3 * p + i].text == alone.choices[0].text
    texts, finished = {}, set()
    for chunk in server.client.completions.create(model=MODEL, prompt=["Hello", "abc"], n=3, max_tokens=5, seed=4,
                                                  temperature=1.0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == set(range(6)) and [texts[i] for i in range(6)] == [c.text for c in many.choices]
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=4, seed=1)
    assert [c.index for c in chat.choices] == [0, 1]


def test_logit_bias_forces_and_bans_tokens(server):
    ids = _post(server, "/tokenize", {"model": MODEL, "prompt": " fox", "add_special_tokens": False})["tokens"]
    forced = _greedy(server, "Hello", logit_bias={str(ids[0]): 100})
    assert forced.choices[0].text == _post(server, "/detokenize", {"model": MODEL, "tokens": ids[:1] * 6})["prompt"]
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


# -- structured outputs ------------------------------------------------------------------------------------
def test_json_schema_and_json_object(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    for seed in range(3):
        out = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=120, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                    "strict": True}})
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        assert out.choices[0].finish_reason == "stop"
    obj = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                                max_tokens=60, seed=2, response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    assert text.startswith("{")
    choice = server.client.completions.create(model=MODEL, prompt="pick", max_tokens=10, seed=3,
                                              extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")
    regex = server.client.completions.create(model=MODEL, prompt="code", max_tokens=10, seed=3,
                                             extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_a_request_that_fails_while_generating_answers_with_the_reason(server, served_checkpoint):
    """The grammar allows only "x", which min_tokens bans (a stop token id): no token can be chosen at the first step.
    The request is answered 400 with the engine's reason (no 200 whose finish_reason OpenAI's clients do not know);
    streamed, an error event then [DONE]; n = 2 fails whole; the server goes on."""
    x = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "x", "add_special_tokens": False})
    body = {"model": MODEL, "prompt": "say x", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": x.json()["tokens"],
            "structured_outputs": {"choice": ["x"]}}
    for extra in ({}, {"n": 2, "seed": 1}):
        reply = httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and "no token is allowed" in error["message"], error
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.status_code == 200 and lines[-1] == "data: [DONE]", lines
    last = json.loads(lines[-2][len("data: "):])
    assert last["error"]["type"] == "invalid_request_error" and "no token is allowed" in last["error"]["message"]
    assert all('"finish_reason":"error"' not in line.replace(" ", "") for line in lines)
    fine = httpx.post(f"{server.url}/v1/completions", json={**body, "min_tokens": 0, "stop_token_ids": None},
                      timeout=60)
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == "x", fine.text
    vocab = json.loads((served_checkpoint / "config.json").read_text())["vocab_size"]
    every = httpx.post(f"{server.url}/v1/completions", json={**body, "stop_token_ids": list(range(vocab)),
                                                            "structured_outputs": None}, timeout=60)
    # (refused before any step: min_tokens bans every token)
    assert every.status_code == 400 and every.json()["error"]["param"] == "stop_token_ids", every.text


# -- tools ---------------------------------------------------------------------------------------------------
def _call(server, tool_choice, parallel=True, **extra):
    return server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice=tool_choice, parallel_tool_calls=parallel, max_tokens=150, **extra)


def test_tool_choice_required_named_and_none(server):
    for seed in range(3):
        # parallel calls: the model chooses between another call and the end; a run that reaches max_tokens
        # inside a call answers the complete calls before it
        out = _call(server, "required", seed=seed).choices[0]
        assert out.finish_reason in ("tool_calls", "length") and out.message.tool_calls
        for call in out.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            assert call.id.startswith("call_") and call.type == "function"
        one = _call(server, "required", parallel=False, seed=seed).choices[0]
        assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
        jsonschema.validate(json.loads(one.message.tool_calls[0].function.arguments),
                            SCHEMAS[one.message.tool_calls[0].function.name])
    named = _call(server, {"type": "function", "function": {"name": "add"}}, seed=2).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["add"]
    jsonschema.validate(json.loads(named.message.tool_calls[0].function.arguments), ADD)
    free = _call(server, "none", seed=1).choices[0]
    assert free.message.tool_calls is None and free.finish_reason in ("stop", "length")
    auto = _call(server, "auto", seed=1).choices[0]
    assert auto.finish_reason in ("stop", "length", "tool_calls")
    unknown = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice"


def test_streamed_tool_calls_and_a_tool_result_back(server):
    calls, reasons = {}, []
    for chunk in _call(server, "required", parallel=False, seed=5, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                reasons.append(c.finish_reason)
            for delta in c.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                if delta.function is not None:
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
    assert reasons == ["tool_calls"] and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
    first = calls[0]
    answer = server.client.chat.completions.create(model=MODEL, max_tokens=5, tools=TOOLS, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": first["id"], "type": "function", "function": {
            "name": first["name"], "arguments": first["arguments"]}}]},
        {"role": "tool", "tool_call_id": first["id"], "content": "sunny, 21 C"}])
    assert answer.choices[0].message.role == "assistant"
    rendered = _post(server, "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "sunny"}]})
    text = _post(server, "/detokenize", {"model": MODEL, "tokens": rendered["tokens"]})
    assert "<tool_response>\nsunny\n</tool_response>" in text["prompt"]


def test_harmony_tool_calls_whole_and_streamed(harmony_checkpoint):
    """gpt-oss's syntax lives in special tokens: the server parses the output decoded with them."""
    harmony = Server(harmony_checkpoint, 1, 1, "--tool-call-parser", "harmony")
    try:
        for seed in range(2):
            out = _call(harmony, "required", seed=seed).choices[0]
            assert out.finish_reason == "tool_calls" and len(out.message.tool_calls) == 1
            assert not out.message.content and "<|" not in (out.message.content or "")
            call = out.message.tool_calls[0].function
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        streamed, reasons = [], []
        for chunk in _call(harmony, {"type": "function", "function": {"name": "add"}}, seed=3, stream=True):
            for c in chunk.choices:
                reasons += [c.finish_reason] if c.finish_reason else []
                assert not c.delta.content  # the markers never reach the client as text
                streamed += [d.function for d in c.delta.tool_calls or () if d.function is not None]
        assert reasons == ["tool_calls"] and [f.name for f in streamed if f.name] == ["add"]
        jsonschema.validate(json.loads("".join(f.arguments or "" for f in streamed)), ADD)
    finally:
        harmony.stop()


# -- endpoints and errors --------------------------------------------------------------------------------------
def test_endpoints_and_openai_error_shapes(server):
    card = httpx.get(f"{server.url}/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["max_model_len"] > 0
    assert httpx.get(f"{server.url}/version").json()["version"]
    for response, status in [(httpx.get(f"{server.url}/v1/models/other"), 404), (httpx.get(f"{server.url}/nowhere"), 404),
                             (httpx.get(f"{server.url}/v1/completions"), 405),
                             (httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                                                "frobnicate": 1}), 400),
                             (httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                                                "suffix": "y"}), 400),
                             (httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}), 400)]:
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    unknown = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "x"}], "frobnicate": 1}).json()["error"]
    assert unknown["param"] == "frobnicate"
    deep = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]})  # arguments nested too deeply to parse
    assert deep.status_code == 400 and deep.json()["error"]["param"] == "messages.1.tool_calls", deep.text
    ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "naïve café 🚀"}).json()
    assert ids["count"] == len(ids["tokens"])
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "naïve café 🚀"


def test_cors_and_request_logs(server):
    preflight = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    _greedy(server, "log me")
    logs = server.stderr()
    assert "finished: length, " in logs and "prompt tokens" in logs
    assert "avg generation throughput" in logs


# -- other clients -------------------------------------------------------------------------------------------
def test_langchain_completions_and_structured_chat(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    llm = langchain_openai.OpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", max_tokens=5,
                                  temperature=0, max_retries=0)
    prompts = ["The quick brown", "def add(a, b):"]
    want = [server.client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
            for p in prompts]
    assert llm.invoke(prompts[0]) == want[0]
    assert llm.batch(prompts) == want

    class City(BaseModel):
        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=10**7)
        capital: bool

    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", max_tokens=200,
                                       temperature=0, max_retries=0)
    city = chat.with_structured_output(City, method="json_schema").invoke("Name a city.")
    assert isinstance(city, City)
    called = chat.bind_tools([TOOLS[0]], tool_choice="get_weather").invoke("Weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(called.tool_calls[0]["args"], WEATHER)


def test_litellm_n_samples(server):
    litellm = pytest.importorskip("litellm")
    out = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="none", n=2,
                             max_tokens=4, seed=3, messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in out.choices] == [0, 1] and all(c.message.content is not None for c in out.choices)


def test_bench_prompts_are_measured_in_served_tokens(server, served_checkpoint, tmp_path):
    from ringmoe.serve.bench import BenchConfig, make_prompts, run_benchmark

    for tokenizer in (None, str(served_checkpoint)):  # the server's /tokenize, then the local folder
        config = BenchConfig(server.url, MODEL, num_prompts=6, input_len=(20, 30), tokenizer=tokenizer)
        for prompt, _ in make_prompts(config):
            count = len(_post(server, "/tokenize", {"model": MODEL, "prompt": prompt,
                                                    "add_special_tokens": False})["tokens"])
            assert 18 <= count <= 32, (prompt, count)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "The quick brown", "max_tokens": 3}\n\n{"prompt": "def add(a, b):"}\n')
    replay = BenchConfig(server.url, MODEL, num_prompts=3, output_len=(2, 2), dataset=str(data))
    assert make_prompts(replay) == [("The quick brown", 3), ("def add(a, b):", 2), ("The quick brown", 3)]
    result = run_benchmark(replay)
    assert result["completed"] == 3 and result["output_tokens"] == 3 + 2 + 3


@pytest.mark.slow  # `make test-all`
def test_aiperf_profiles_the_server(server, served_checkpoint, tmp_path):
    import os
    import shutil
    import subprocess
    import sys

    aiperf = shutil.which("aiperf", path=os.path.dirname(sys.executable))
    if aiperf is None:
        pytest.skip("aiperf is not installed")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # offline, aiperf looks paths up in the hub
    done = subprocess.run([aiperf, "profile", "--model", MODEL, "--url", server.url, "--endpoint-type", "chat",
                           "--streaming", "--request-count", "8", "--concurrency", "4",
                           "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "8", "--extra-inputs",
                           "ignore_eos:true", "--tokenizer", str(served_checkpoint), "--artifact-dir", str(tmp_path),
                           "--ui-type", "none"], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == 8 and not report.get("error_summary")
    assert report["time_to_first_token"]["avg"] > 0 and report["output_token_throughput"]["avg"] > 0
