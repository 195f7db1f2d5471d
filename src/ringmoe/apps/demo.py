"""`ringmoe demo` (= `make demo`): serve a MoE model on a cp x ep mesh of local ranks and talk to it as a user.

1. Trains (once, cached in the user's cache folder; ``--retrain`` trains again) the "demo" preset on
   the standard library's Python sources with ``ringmoe train`` (about two minutes on 2 cores), and
   uses its transformers export (``demo_model.trained_demo_checkpoint``).
2. Starts ``ringmoe serve`` at cp=2 x ep=2 (4 local ranks) on 127.0.0.1 and a free port.
3. Through the official ``openai`` client: a streaming chat, a long prompt prefilled by ring attention,
   and a burst of concurrent completions (``serve.bench``'s load generator).
4. Prints the answers, a per-rank table (requests of its ep group, peak KV blocks, expert rows,
   exposed ring communication) from the server's /stats, the latency summary, and the exactness line:
   the server's greedy completions equal one process running the same checkpoint.
5. Stops the server with SIGTERM (it drains and exits 0) and checks that nothing is left running.

Two minutes of training on 2 CPU cores buys a model that writes Python-looking text (indentation,
keywords, ``self.``), not working code: the machinery is what the demo shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..parallel.launch import free_port
from ..serve import Engine, SamplingParams
from ..serve.bench import BenchConfig, run_benchmark, wait_healthy
from ..text import stdlib_texts
from .demo_model import DEMO_TRAINING, default_cache, trained_demo_checkpoint

__all__ = ["DemoOptions", "run_demo"]


@dataclass
class DemoOptions:
    cp: int = 2
    ep: int = 2
    long_prompt_words: int = 2250
    concurrent: int = 16
    new_tokens: int = 24
    retrain: bool = False
    train_steps: int = 900
    enforce_eager: bool = False  # serve with eager decode steps (default: compiled on every rank at start-up)


def _start_server(checkpoint: Path, cp: int, ep: int, port: int, enforce_eager: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ringmoe.cli", "serve", "--model", str(checkpoint), "--cp", str(cp), "--ep", str(ep),
           "--port", str(port), "--served-model-name", "demo", "--kv-cache-tokens", "16384"]
    cmd += ["--enforce-eager"] if enforce_eager else []
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                todo += children
    return found


def _trained_checkpoint(options: DemoOptions, console) -> Path:
    training = {**DEMO_TRAINING, "steps": options.train_steps}
    folder = None if options.train_steps == DEMO_TRAINING["steps"] else \
        default_cache() / f"demo-trained-{options.train_steps}-steps"
    checkpoint = trained_demo_checkpoint(folder, retrain=options.retrain, console=console, training=training)
    summary = json.loads((checkpoint.parent / "summary.json").read_text())
    console.print(f"[dim]checkpoint: {checkpoint} (demo preset trained {summary['steps']} steps on the standard "
                  f"library: validation loss {summary['val_loss']:.2f} nats vs unigram entropy "
                  f"{summary['unigram_entropy']:.2f})")
    return checkpoint


def _stream_a_completion(client, console, options: DemoOptions) -> None:
    prompt = "class Stack:\n    def push(self, item):\n"
    console.print("\n[bold]1. a streaming completion[/] (openai client, stream=True, temperature 0.7, repetition "
                  "penalty 1.1; the model saw only Python, so a raw prompt, not the chat template)")
    console.print(prompt, end="", markup=False, highlight=False, style="dim")
    began, first = time.perf_counter(), None
    for chunk in client.completions.create(model="demo", prompt=prompt, max_tokens=4 * options.new_tokens,
                                           temperature=0.7, seed=1, stream=True,
                                           extra_body={"repetition_penalty": 1.1}):
        delta = chunk.choices[0].text if chunk.choices else None
        if delta:
            first = first or time.perf_counter() - began
            console.print(delta, end="", markup=False, highlight=False)
    console.print(f"\n[dim]first token after {first * 1e3:.0f} ms")


def _answer_a_long_prompt(client, console, options: DemoOptions, words: list[str]) -> None:
    console.print(f"\n[bold]2. a long prompt[/] ({options.long_prompt_words} words of the standard library, "
                  f"prefilled by ring attention over the cp group; sampled at temperature 0.7 with a repetition "
                  f"penalty of 1.2, which keeps a small model out of loops)")
    long_prompt = " ".join(words[:options.long_prompt_words])
    began = time.perf_counter()
    answer = client.completions.create(model="demo", prompt=long_prompt, max_tokens=16, temperature=0.7, seed=2,
                                       extra_body={"repetition_penalty": 1.2})
    console.print(f"{answer.usage.prompt_tokens} prompt tokens -> {answer.choices[0].text!r} in "
                  f"{time.perf_counter() - began:.2f} s")


def _concurrent_load(url: str, console, options: DemoOptions) -> bool:
    console.print(f"\n[bold]3. {options.concurrent} concurrent streaming completions[/]")
    load = run_benchmark(BenchConfig(url, "demo", num_prompts=options.concurrent, concurrency=options.concurrent,
                                     input_len=(16, 128), output_len=(options.new_tokens, options.new_tokens),
                                     timeout=120))
    console.print(f"{load['completed']}/{options.concurrent} answered, {load['errors']} errors, "
                  f"{load['output_tokens_per_s']:.0f} output tokens/s; TTFT p50 {load['ttft_s']['p50'] * 1e3:.0f} ms"
                  f" p99 {load['ttft_s']['p99'] * 1e3:.0f} ms; TPOT p50 {load['tpot_s']['p50'] * 1e3:.0f} ms; "
                  f"end-to-end p99 {load['e2e_s']['p99']:.2f} s")
    return load["errors"] == 0


def _rank_table(url: str, console) -> None:
    import httpx

    stats = httpx.get(f"{url}/stats").json()
    table = Table(title="per rank (since the server started)")
    for col in ("rank", "cp,ep", "requests", "peak KV blocks", "expert rows", "ring exposed"):
        table.add_column(col, justify="right")
    for row in stats["ranks"]:
        ring = row["ring_compute_s"] + row["ring_wait_s"]
        table.add_row(str(row["rank"]), f"{row['cp_rank']},{row['ep_rank']}", str(row["requests"]),
                      str(row["kv_blocks_peak"]), str(row["expert_rows"]),
                      f"{row['ring_wait_s'] / ring:.1%}" if ring else "-")
    console.print(table)


def _exactness(client, console, checkpoint: Path, options: DemoOptions, words: list[str]) -> bool:
    prompts = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):",
               " ".join(words[:300])]
    served = [client.completions.create(model="demo", prompt=p, max_tokens=options.new_tokens, temperature=0)
              .choices[0].text for p in prompts]
    local = Engine.from_checkpoint(checkpoint).generate(prompts, SamplingParams(temperature=0,
                                                                                max_tokens=options.new_tokens))
    same = sum(a == b.text for a, b in zip(served, local))
    world = options.cp * options.ep
    console.print(f"exactness: the {world}-rank server's greedy completions equal one process for {same} of "
                  f"{len(prompts)} prompts: {'[green]PASS' if same == len(prompts) else '[red]FAIL'}")
    return same == len(prompts)


def _stop(proc: subprocess.Popen) -> tuple[bool, list[int]]:
    """SIGTERM the server, then make sure no rank is left: (it drained in time, pids that had to be killed)."""
    ranks = _descendants(proc.pid)
    drained = True
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        drained = False
    time.sleep(0.5)
    left = [p for p in ranks if Path(f"/proc/{p}").exists()]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return drained, left


def run_demo(options: DemoOptions) -> bool:
    """Train (or reuse) the demo model, serve it on a cp x ep mesh, and show what the server does."""
    import openai

    console = Console()
    console.width = max(console.width, 110)
    start = time.monotonic()
    checkpoint = _trained_checkpoint(options, console)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    world = options.cp * options.ep
    launched = time.monotonic()
    proc = _start_server(checkpoint, options.cp, options.ep, port, options.enforce_eager)
    if not options.enforce_eager:
        console.print("[dim]every rank compiles its decode step at start-up (a minute or more the first time on a "
                      "small machine; inductor's cache on disk makes a restart fast)[/]")
    try:
        wait_healthy(url, proc, 900)
        console.print(f"[bold]ringmoe serve[/] on {url}: cp={options.cp} x ep={options.ep}, {world} ranks "
                      f"(pids {_descendants(proc.pid)[:world]}), up in {time.monotonic() - launched:.1f} s")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        words = "\n".join(stdlib_texts(200_000)).split(" ")
        _stream_a_completion(client, console, options)
        _answer_a_long_prompt(client, console, options, words)
        ok = _concurrent_load(url, console, options)
        _rank_table(url, console)
        ok &= _exactness(client, console, checkpoint, options, words)
    finally:
        drained, left = _stop(proc)
    console.print(f"server stopped by SIGTERM: exit code {proc.returncode}, processes left: {len(left)}; "
                  f"demo took {time.monotonic() - start:.0f} s")
    return ok and drained and proc.returncode == 0 and not left
