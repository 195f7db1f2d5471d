"""What the OpenAI API features cost: structured outputs, parallel samples, prompt logprobs.  One run, this CPU.

Checkpoint: the demo's (small preset, random weights, its BPE tokenizer and ChatML template).
- Structured outputs: 32 concurrent chat requests through a live ``ringmoe serve``, with a json_schema
  response_format (every answer parses) and without (ignore_eos, 64 tokens each): output tokens/s of each and
  the ratio (the grammar's bitmasks are filled for the whole step, then applied as one additive mask).
- Parallel samples: one request with n=4 against 4 separate requests of the same 384-token prompt (32 new
  tokens each, ignore_eos), in process: peak KV blocks held and output tokens/s.
- Prompt logprobs, an lm-eval-like workload: 64 requests (a 96-token context + a 12-token continuation as token
  ids, echo + logprobs=1 + max_tokens=0), 4 clients, through the server: requests/s and scored tokens/s; the
  peer is transformers scoring the same sequences in process, batch 1 (lm-eval's `hf` model does that).
Writes benchmarks/results/openai_api.json and openai_api.png.

    python benchmarks/bench_openai_api.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import start, stop  # noqa: E402
from common import pyplot, write_results  # noqa: E402

from ringmoe.apps.demo_model import build_demo_checkpoint  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]}, "tags": {"type": "array", "items": {"type": "string",
                                                                                            "maxLength": 8},
                                                             "maxItems": 4}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}


async def _chat_load(url: str, model: str, clients: int, structured: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 64, "temperature": 1.0}
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        body["max_tokens"] = 256  # room for the whole object: a constrained request ends when it is complete
    else:
        body["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(seed):
            reply = await client.post(f"{url}/v1/chat/completions", json={**body, "seed": seed})
            reply.raise_for_status()
            data = reply.json()
            if structured:
                json.loads(data["choices"][0]["message"]["content"])  # valid JSON, or the run fails
            return data["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(s) for s in range(clients)))
        seconds = time.perf_counter() - start
    return {"requests": clients, "output_tokens": sum(tokens), "seconds": seconds,
            "output_tokens_per_s": sum(tokens) / seconds, "mean_output_tokens": sum(tokens) / clients}


def structured_overhead(url: str, model: str) -> dict:
    asyncio.run(_chat_load(url, model, 8, True))  # warm-up (and the schema's compilation, cached after)
    plain = asyncio.run(_chat_load(url, model, 32, False))
    structured = asyncio.run(_chat_load(url, model, 32, True))
    return {"plain": plain, "json_schema": structured,
            "tokens_per_s_ratio": structured["output_tokens_per_s"] / plain["output_tokens_per_s"]}


def parallel_samples(checkpoint: Path) -> dict:
    prompt = torch.randint(3, 300, (384,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for name, requests in (("n=4", [SamplingParams(n=4, max_tokens=32, ignore_eos=True, seed=1)]),
                           ("4 separate", [SamplingParams(max_tokens=32, ignore_eos=True, seed=1 + i)
                                           for i in range(4)])):
        engine = Engine.from_checkpoint(checkpoint, kv_cache_tokens=8192)
        engine.generate([prompt[:16]], SamplingParams(max_tokens=2))  # warm-up
        for params in requests:
            engine.add_request(prompt, params)
        peak, tokens, start = 0, 0, time.perf_counter()
        while engine.has_unfinished:
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            peak = max(peak, engine.blocks.num_blocks - engine.blocks.num_free)
        seconds = time.perf_counter() - start
        out[name] = {"peak_kv_blocks": peak, "block_size": engine.blocks.block_size, "output_tokens": tokens,
                     "seconds": seconds, "output_tokens_per_s": tokens / seconds}
    out["kv_blocks_ratio"] = out["n=4"]["peak_kv_blocks"] / out["4 separate"]["peak_kv_blocks"]
    out["tokens_per_s_ratio"] = out["n=4"]["output_tokens_per_s"] / out["4 separate"]["output_tokens_per_s"]
    return out


def _scoring_workload(count: int = 64) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 300, (96 + 12,), generator=generator).tolist() for _ in range(count)]


async def _score_served(url: str, model: str, sequences: list[list[int]], clients: int) -> float:
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(ids):
            async with gate:
                reply = await client.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
                reply.raise_for_status()
                assert len(reply.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)

        start = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in sequences))
        return time.perf_counter() - start


def prompt_logprobs(url: str, model: str, checkpoint: Path) -> dict:
    import transformers

    sequences = _scoring_workload()
    asyncio.run(_score_served(url, model, sequences[:8], 4))  # warm-up
    served = asyncio.run(_score_served(url, model, sequences, 4))
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    torch.set_num_threads(2)
    with torch.no_grad():
        for ids in sequences[:4]:
            hf(torch.tensor([ids]))
        start = time.perf_counter()
        for ids in sequences:
            torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        local = time.perf_counter() - start
    tokens = sum(len(s) - 1 for s in sequences)
    return {"requests": len(sequences), "tokens_per_request": len(sequences[0]),
            "ringmoe_served": {"seconds": served, "requests_per_s": len(sequences) / served,
                               "scored_tokens_per_s": tokens / served},
            "transformers_in_process": {"seconds": local, "requests_per_s": len(sequences) / local,
                                        "scored_tokens_per_s": tokens / local},
            "ringmoe_over_transformers_requests_per_s": local / served}


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    s = results["structured_outputs"]
    axes[0].bar(["no grammar", "json_schema"], [s["plain"]["output_tokens_per_s"],
                                                s["json_schema"]["output_tokens_per_s"]], color=["#888", "#1f77b4"])
    axes[0].set_ylabel("output tokens / s (32 concurrent)")
    axes[0].set_title(f"structured outputs: {s['tokens_per_s_ratio']:.2f}x")
    p = results["parallel_samples"]
    axes[1].bar(["n=4", "4 separate"], [p["n=4"]["peak_kv_blocks"], p["4 separate"]["peak_kv_blocks"]],
                color=["#1f77b4", "#888"])
    axes[1].set_ylabel("peak KV blocks")
    axes[1].set_title(f"parallel samples: {p['kv_blocks_ratio']:.2f}x blocks, {p['tokens_per_s_ratio']:.2f}x tok/s")
    q = results["prompt_logprobs"]
    axes[2].bar(["ringmoe serve", "transformers\nin process"], [q["ringmoe_served"]["requests_per_s"],
                                                                 q["transformers_in_process"]["requests_per_s"]],
                color=["#1f77b4", "#888"])
    axes[2].set_ylabel("scoring requests / s")
    axes[2].set_title("prompt logprobs (lm-eval-like)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    checkpoint = build_demo_checkpoint(Path(tempfile.gettempdir()) / "ringmoe-bench-serve")
    results = {"checkpoint": "demo small preset (random weights)"}
    proc, url, model = start("ringmoe", checkpoint)
    try:
        results["structured_outputs"] = structured_overhead(url, model)
        results["prompt_logprobs"] = prompt_logprobs(url, model, checkpoint)
    finally:
        stop(proc)
    results["parallel_samples"] = parallel_samples(checkpoint)
    print(json.dumps(results, indent=2))
    path = write_results("openai_api", results)
    plot(results, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
