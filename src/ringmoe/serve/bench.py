"""`ringmoe bench serve`: load any OpenAI-compatible server and measure it.

Requests arrive as a Poisson process of ``rate`` per second (``inf``: all at once), at most
``concurrency`` in flight; each streams a /v1/completions answer.  Per request: time to first token
(TTFT: to the first chunk with a choice, text or not, as vLLM's benchmark counts it), inter-token
latencies (ITL, between streamed chunks), time per output token after the first
(TPOT) and end-to-end latency; per run: output and total tokens per second, percentiles, errors.
Prompt lengths are in tokens of the served tokenizer: ``tokenizer`` (a checkpoint folder) when given,
else the server's own ``/tokenize`` (ringmoe and vLLM have it): a stream of random words is tokenized
once and each prompt is the text of a slice of exactly ``input_len`` of its tokens.  A server with
neither gets words (about one token each; the usage counts the server reports are what the results
use).  ``dataset``: a JSON-lines file of {"prompt": str[, "max_tokens": int]} replayed in order (cycled
to ``num_prompts``).  Bounded: ``num_prompts`` requests and a per-request ``timeout``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from ..jsonio import read_json_lines
from ..text import Tokenizer

__all__ = ["BenchConfig", "run_benchmark", "percentiles", "wait_healthy"]

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or has had "
         "not but first one their its new after who they have her she two been other when there all during "
         "into school time may years more most only over city some world would where later up such used many "
         "can state about national out known university united then made").split()


@dataclass
class BenchConfig:
    url: str
    model: str
    num_prompts: int = 32
    rate: float = math.inf
    concurrency: int = 32
    input_len: tuple[int, int] = (64, 64)   # prompt tokens, uniform in [lo, hi]
    output_len: tuple[int, int] = (64, 64)  # max_tokens, uniform in [lo, hi]
    seed: int = 0
    timeout: float = 300.0
    ignore_eos: bool = False  # a vLLM extra some servers reject (transformers serve does)
    tokenizer: str | None = None  # a folder with tokenizer.json: prompt lengths in its tokens
    dataset: str | None = None  # a JSON-lines file of {"prompt"[, "max_tokens"]}


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list = field(default_factory=list)
    error: str = ""


def wait_healthy(url: str, proc=None, seconds: float = 120.0) -> None:
    """Poll ``url``/health until it answers 200; RuntimeError if ``proc`` (a Popen) exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else ""
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
            raise RuntimeError(f"the server exited with code {proc.returncode}: {err[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not become healthy in {seconds:.0f} s")


def percentiles(values: list[float]) -> dict:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}

    def at(q):
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]

    return {"mean": statistics.fmean(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


async def _one(client, config: BenchConfig, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": config.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    chunks = 0
    try:
        async with client.stream("POST", f"{config.url}/v1/completions", json=body, timeout=config.timeout) as reply:
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                # vLLM's rule: the first chunk with a choice is the first token, even with no text (a server holds
                # back the bytes of a character not yet complete; a special token has none)
                choices = chunk.get("choices") or []
                if choices:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += bool(choices[0].get("text"))
    except Exception as error:  # a refused connection, a timeout: counted as an error
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = last is not None
    if not result.ok:
        result.error = "no choice streamed"
    return result


def _token_counter(config: BenchConfig):
    """(encode, decode) of the served tokenizer: the local folder, else the server's /tokenize and /detokenize,
    else None (the server has neither)."""
    if config.tokenizer is not None:
        tokenizer = Tokenizer(config.tokenizer)
        return (lambda text: tokenizer.encode(text, add_special_tokens=False)), tokenizer.decode
    import httpx

    def call(path, body):
        reply = httpx.post(f"{config.url}{path}", json={"model": config.model, **body}, timeout=60)
        reply.raise_for_status()
        return reply.json()

    try:
        call("/tokenize", {"prompt": "probe", "add_special_tokens": False})
    except (httpx.HTTPError, ValueError):
        return None
    return (lambda text: call("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"],
            lambda ids: call("/detokenize", {"tokens": ids})["prompt"])


def make_prompts(config: BenchConfig) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) of every request of the run."""
    rng = random.Random(config.seed)
    if config.dataset is not None:
        rows = read_json_lines(config.dataset)
        if not rows or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in rows):
            raise ValueError(f"--dataset {config.dataset}: every line must be an object with a string 'prompt'")
        return [(row["prompt"], int(row.get("max_tokens") or rng.randint(*config.output_len)))
                for row in (rows[i % len(rows)] for i in range(config.num_prompts))]
    lengths = [rng.randint(*config.input_len) for _ in range(config.num_prompts)]
    outputs = [rng.randint(*config.output_len) for _ in range(config.num_prompts)]
    counter = _token_counter(config)
    if counter is None:  # words: about one token each
        return [(" ".join(rng.choice(WORDS) for _ in range(n)), m) for n, m in zip(lengths, outputs)]
    encode, decode = counter
    stream = encode(" ".join(rng.choice(WORDS) for _ in range(2 * max(lengths) + 64)))
    prompts = []
    for n, m in zip(lengths, outputs):
        start = rng.randrange(0, len(stream) - n)
        prompts.append((decode(stream[start:start + n]), m))
    return prompts


async def _run(config: BenchConfig) -> tuple[list[RequestResult], float]:
    import httpx

    rng = random.Random(config.seed + 1)
    jobs = await asyncio.get_running_loop().run_in_executor(None, make_prompts, config)
    gate = asyncio.Semaphore(config.concurrency)
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=config.timeout) as client:
        async def guarded(prompt, max_tokens):
            async with gate:
                return await _one(client, config, prompt, max_tokens)

        tasks, start = [], time.perf_counter()
        for prompt, max_tokens in jobs:
            tasks.append(asyncio.create_task(guarded(prompt, max_tokens)))
            if math.isfinite(config.rate):
                await asyncio.sleep(rng.expovariate(config.rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def run_benchmark(config: BenchConfig) -> dict:
    """Run the load; a JSON-ready summary."""
    if config.num_prompts < 1 or config.concurrency < 1 or not config.rate > 0:
        raise ValueError("num_prompts and concurrency must be >= 1 and rate > 0")
    results, seconds = asyncio.run(_run(config))
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "url": config.url, "model": config.model, "num_prompts": config.num_prompts,
        "rate": "inf" if math.isinf(config.rate) else config.rate, "concurrency": config.concurrency,
        "input_len": list(config.input_len), "output_len": list(config.output_len),
        "duration_s": seconds, "completed": len(ok), "errors": len(results) - len(ok),
        "error_examples": [r.error for r in results if not r.ok][:3],
        "output_tokens": output, "prompt_tokens": prompt,
        "output_tokens_per_s": output / seconds, "total_tokens_per_s": (output + prompt) / seconds,
        "requests_per_s": len(ok) / seconds,
        "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles(tpot),
        "itl_s": percentiles([x for r in ok for x in r.itl]), "e2e_s": percentiles([r.e2e for r in ok]),
    }


def plot(runs: list[dict], path) -> None:
    """Left: p50 / p99 time to first token against the completed request rate (one line per server, sorted).
    Right: output tokens per second at each load (rate or concurrency), servers side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    servers = list(dict.fromkeys(r.get("server", r["url"]) for r in runs))
    loads = list(dict.fromkeys(_load(r) for r in runs))
    width = 0.8 / len(servers)
    for i, server in enumerate(servers):
        mine = sorted((r for r in runs if r.get("server", r["url"]) == server), key=lambda r: r["requests_per_s"])
        rates = [r["requests_per_s"] for r in mine]
        line = left.plot(rates, [r["ttft_s"]["p50"] for r in mine], "o-", label=f"{server} p50")[0]
        left.plot(rates, [r["ttft_s"]["p99"] for r in mine], "x--", color=line.get_color(), label=f"{server} p99")
        by_load = {_load(r): r["output_tokens_per_s"] for r in mine}
        right.bar([j + i * width for j in range(len(loads))], [by_load.get(load, 0) for load in loads], width,
                  label=server, color=line.get_color())
    left.set_xlabel("completed requests / s")
    left.set_ylabel("time to first token, s")
    left.set_yscale("log")
    left.legend(fontsize=7)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))], loads)
    right.set_xlabel("load (c = concurrent requests sent at once, r = Poisson rate per s)")
    right.set_ylabel("output tokens / s")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _load(run: dict) -> str:
    return f"c={run['concurrency']}" if run["rate"] == "inf" else f"r={run['rate']:g}"
