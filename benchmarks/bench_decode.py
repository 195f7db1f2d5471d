"""One decode step of the engine, as close to its arithmetic as it gets: step time at batch 1 .. 64.

Model: the small preset (4 layers, hidden 256, 8 experts top-2, vocab 4096; ~15M parameters), random
weights, float32, 2 threads.  Each batch size B: B requests with 64-token prompts are prefilled, then every
request decodes greedily (EOS ignored) and the engine's own step time is recorded for ``--steps`` steps; the
median is reported with:

- the compute floor of the same step: its FLOPs (2 x the multiply-adds of every matmul a token of that step
  runs, attention over its context included) over the machine's measured sgemm rate (a (512, 512) x (512,
  512) product on the same threads), and the bytes floor: the weights the step must read once (attention,
  router, the experts its tokens select, the LM head) over a measured memory-copy rate;
- the host-overhead share: the part of a step spent outside matmul / attention kernels (``ringmoe.panel_gemm``'s C
  calls among them) and outside the compiled graph's own code (inductor's fused C++ kernels and its C++
  wrapper): the Python of the scheduler, the step's inputs, torch.compile's guards, sampling, the K/V writes,
  dispatch and small ops.  The torch profiler tells the
  compute apart (its events' times); the share is one minus that compute over the wall time of as many steps
  run without the profiler, interleaved with the profiled ones (``host_overhead_share``).  A step timed under
  the profiler also pays the profiler's recording of every op, most of them host-side ops: that share is
  reported too (``host_overhead_share_profiled``); on a machine whose speed drifts the two can swap places.

Each batch runs five ways, side by side (``measure_modes``: steps in turns): the eager step
(``decode_graph="off"``), the compiled decode graph (``decode_graph="compiled"``, its compile time reported; the
ratio is the speed-up), the compiled graph with one copy of the weights (``prepack_weights=False``: the eager
products, the experts' sorted GEMMs among them, through MKL instead of the prepacked copies, ``ringmoe.prepacked``),
and the compiled graph whose weights are prepacked as oneDNN copies instead of ``ringmoe.panel_gemm``'s panels
(where that kernel runs): the experts one product per expert instead of the grouped kernel (the step then also
takes the dense form at 16-31 tokens, as it does without the kernel), the projections through MKL inside the graph
instead of ``ringmoe::panel_linear``, and the compiled graph whose attention gathers each row's cache
blocks in tensor ops instead of ``ringmoe.attention.paged_cpu``'s C kernel (``attention_kernel_speedup``).

Writes benchmarks/results/decode.json and decode.png.

    python benchmarks/bench_decode.py [--batches 1,8,32,64] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import contextmanager
from copy import deepcopy
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe import panel_gemm  # noqa: E402
from ringmoe.attention import paged_cpu  # noqa: E402
from ringmoe.model import MoETransformer, preset  # noqa: E402
from ringmoe.serve import Engine, SamplingParams  # noqa: E402

PROMPT = 64
# kernels that do the step's arithmetic; everything else in a step is overhead
COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::baddbmm", "aten::linear", "mkldnn::_linear_pointwise", "ringmoe::panel_grouped_linear",
               "ringmoe::panel_linear",  # a product by a matrix's panel copy (eager steps; in the graph: counted)
               "ringmoe::panel_routed_experts",  # a MoE layer's routed part in C, sort and sums included
               "ringmoe::paged_cached_attention")  # a layer's decode attention over the cache in C
# (label, Engine options) of the rows measured at each batch size
MODES = {"off": dict(decode_graph="off"), "compiled": dict(decode_graph="compiled"),
         "compiled, one weight copy": dict(decode_graph="compiled", prepack_weights=False),
         "compiled, oneDNN copies": dict(decode_graph="compiled"),
         "compiled, attention in tensor ops": dict(decode_graph="compiled")}
NO_PANELS = {"compiled, oneDNN copies"}  # modes whose engine packs its weights without panel_gemm
NO_ATTENTION_KERNEL = {"compiled, attention in tensor ops"}  # modes whose graph gathers the cache in tensor ops
GRAPH_CALL = "## Call CompiledFxGraph"


def machine_rates(device: str) -> dict:
    """sgemm FLOP/s and memory-copy bytes/s on the device (this process's threads on a CPU; medians of 20)."""
    size = 512 if device == "cpu" else 4096
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    big = torch.randn(16 * 2**20 // 4 * (1 if device == "cpu" else 64), device=device)
    out = torch.empty_like(big)
    gemm, copy = [], []

    def timed(fn) -> float:
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(20):
        gemm.append(timed(lambda: torch.mm(a, b)))
        copy.append(timed(lambda: out.copy_(big)))
    return {"sgemm_flops": 2 * size**3 / statistics.median(gemm),
            "copy_bytes_per_s": 2 * big.numel() * 4 / statistics.median(copy)}


def step_cost(model: MoETransformer, batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, weight bytes read) of one decode step of ``batch`` tokens, each over ``context`` cached keys."""
    c = model.config
    attention = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    expert = 3 * c.hidden_size * c.ffn_size
    router = c.hidden_size * c.num_experts
    scores = 2 * c.num_heads * c.head_dim * context  # q.k and p.v
    per_token = c.num_layers * (attention + c.top_k * expert + router + scores) + c.hidden_size * c.vocab_size
    touched = min(c.num_experts, batch * c.top_k)  # experts read at least once (uniform routing's best case)
    weights = c.num_layers * (attention + touched * expert + router) + c.hidden_size * c.vocab_size
    return 2.0 * per_token * batch, 4.0 * weights


def host_shares(engine: Engine, rounds: int = 4, steps: int = 8) -> tuple[float, float]:
    """(host-overhead share, the same timed under the profiler) over ``rounds`` rounds of ``steps`` plain steps
    then ``steps`` profiled ones (interleaved, so a machine that drifts in speed moves both sides alike; each
    round's plain steps after as many untimed ones).
    Compute: the time the profiler finds in the compute kernels (matmuls, attention, the compiled graph's own
    code), over the wall time of the plain steps, or of the profiled ones."""
    from torch.profiler import ProfilerActivity, profile

    compute = plain = profiled = 0.0
    for _ in range(rounds):
        for _ in range(steps):  # untimed: after the profiler's bookkeeping the first steps run slow (the OpenMP
            engine.step()       # workers asleep, the caches cold: a batch-1 step's first ~2x, its next ~1.3x)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        plain += time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            profiled += time.perf_counter() - start
        for event in prof.events():
            if event.name.startswith(GRAPH_CALL):  # the compiled graph's own code: fused kernels, its C++ wrapper
                compute += event.cpu_time_total / 1e6
            elif event.name in COMPUTE_OPS and not _inside_graph(event):  # (inside: counted with the graph)
                compute += event.self_cpu_time_total / 1e6
    return max(0.0, 1.0 - compute / plain), max(0.0, 1.0 - compute / profiled)


def _inside_graph(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(GRAPH_CALL):
            return True
        parent = parent.cpu_parent
    return False


def measure(model: MoETransformer, batch: int, steps: int, mode: str, max_num_seqs: int = 64, prompt: int = PROMPT,
            **engine_options) -> dict:
    """The median decode step of ``batch`` requests with ``prompt``-token prompts; mode: a key of ``MODES``
    (engine_options: more, e.g. kv_cache_dtype)."""
    return measure_modes({mode: model}, batch, steps, max_num_seqs, prompt, **engine_options)[0]


@contextmanager
def panel_kernel(allowed: bool):
    """Engines built inside pack their expert stacks for ``panel_gemm`` only if ``allowed`` (and it runs here)."""
    real = panel_gemm.available
    if not allowed:
        panel_gemm.available = lambda: False
    try:
        yield
    finally:
        panel_gemm.available = real


@contextmanager
def attention_kernel(allowed: bool):
    """Engines built (and so compiled) inside run their decode attention through ``paged_cpu``'s C kernel only if
    ``allowed`` (and it runs here): the graph takes the kernel's presence as a constant when it is traced."""
    real = paged_cpu.panel_gemm
    if not allowed:
        paged_cpu.panel_gemm = types.SimpleNamespace(_library=lambda: None)
    try:
        yield
    finally:
        paged_cpu.panel_gemm = real


def measure_modes(models: dict[str, MoETransformer], batch: int, steps: int, max_num_seqs: int = 64,
                  prompt: int = PROMPT, block: int = 16, **engine_options) -> list[dict]:
    """``measure`` for several modes side by side: models maps each mode to its model (copies of one: a model's
    prepacked copies and compiled graphs are its own); one engine per mode, all given the same requests, then
    steps taken in turns, ``block`` steps of each engine at a time (the order alternating), so a machine whose
    speed drifts moves every mode alike."""
    engines, modes = [], list(models)
    model = models[modes[0]]
    for mode in modes:
        with panel_kernel(mode not in NO_PANELS), attention_kernel(mode not in NO_ATTENTION_KERNEL):
            engine = Engine(models[mode], kv_cache_tokens=batch * (prompt + 3 * steps + 32) + 256,
                            max_num_seqs=max(max_num_seqs, batch),
                            max_num_batched_tokens=max(2048, batch * prompt), **{**MODES[mode], **engine_options})
        gen = torch.Generator().manual_seed(batch)
        params = SamplingParams(temperature=0, max_tokens=3 * steps + 8, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(torch.randint(0, model.config.vocab_size, (prompt,), generator=gen).tolist(), params)
        while engine.last_stats.num_sequences != batch or engine.last_stats.batch_tokens != batch:
            engine.step()  # prefill, until a step is one decode per request
        engines.append(engine)
    times: list[list[float]] = [[] for _ in modes]
    for turn in range(-(-steps // block)):
        order = list(enumerate(engines)) if turn % 2 == 0 else list(enumerate(engines))[::-1]
        for i, engine in order:
            for _ in range(4):  # untimed: the other engines' steps have cooled this one's caches
                engine.step()
            for _ in range(block):
                engine.step()
                times[i].append(engine.last_stats.step_s)
    shares = [host_shares(engine) for engine in engines]  # each interleaves its own plain and profiled steps
    rows = []
    for mode, engine, mode_times, (share, share_profiled) in zip(modes, engines, times, shares):
        step_s = statistics.median(mode_times)
        flops, weight_bytes = step_cost(model, batch, prompt + 8 + steps)
        rows.append({"batch": batch, "mode": mode, "step_ms": 1e3 * step_s, "tokens_per_s": batch / step_s,
                     "flops": flops, "weight_bytes": weight_bytes, "host_overhead_share": share,
                     "host_overhead_share_profiled": share_profiled, "compile_s": engine.compile_seconds,
                     "prepacked_bytes": engine.runner.prepacked_bytes})
    return rows


def plot(data: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, label in (("off", "eager step"), ("compiled", "compiled decode graph"),
                        ("compiled, one weight copy", "compiled, without prepacked weights"),
                        ("compiled, oneDNN copies", "compiled, oneDNN copies (no panel_gemm)"),
                        ("compiled, attention in tensor ops", "compiled, attention gathered in tensor ops")):
        rows = [r for r in data["steps"] if r["mode"] == mode]
        ax.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], "o-", label=label)
    ax.plot([r["batch"] for r in rows], [r["floor_ms"] for r in rows], "s--",
            label="floor: max(FLOPs / sgemm, weight bytes / copy)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decoding requests (batch)")
    ax.set_ylabel("ms per step")
    ax.set_title("decode step vs its floor (small preset, fp32, 2 threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (benchmarks/gpu.sh)")
    parser.add_argument("--name", default="decode", help="results file name")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = MoETransformer(preset("small")).eval().to(args.device)
    models = {mode: model if i == 0 else deepcopy(model) for i, mode in enumerate(MODES)}  # (the same weights)
    rates = machine_rates(args.device)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for row in measure_modes(models, batch, args.steps):
            mode = row["mode"]
            row["compute_floor_ms"] = 1e3 * row["flops"] / rates["sgemm_flops"]
            row["bytes_floor_ms"] = 1e3 * row["weight_bytes"] / rates["copy_bytes_per_s"]
            row["floor_ms"] = max(row["compute_floor_ms"], row["bytes_floor_ms"])
            row["over_floor"] = row["step_ms"] / row["floor_ms"]
            rows.append(row)
            print(f"batch {batch:3d} {mode:26s}: {row['step_ms']:.2f} ms/step ({row['tokens_per_s']:.0f} tok/s), "
                  f"floor {row['floor_ms']:.3f} ms ({row['over_floor']:.0f}x), host overhead "
                  f"{row['host_overhead_share']:.0%} ({row['host_overhead_share_profiled']:.0%} timed under the "
                  f"profiler)")
    eager = {r["batch"]: r["step_ms"] for r in rows if r["mode"] == "off"}
    speedup = {str(r["batch"]): eager[r["batch"]] / r["step_ms"] for r in rows if r["mode"] == "compiled"}
    plain = {r["batch"]: r["step_ms"] for r in rows if r["mode"] == "compiled, one weight copy"}
    prepack_speedup = {str(r["batch"]): plain[r["batch"]] / r["step_ms"] for r in rows if r["mode"] == "compiled"}
    onednn = {r["batch"]: r["step_ms"] for r in rows if r["mode"] == "compiled, oneDNN copies"}
    panel_speedup = {str(r["batch"]): onednn[r["batch"]] / r["step_ms"] for r in rows if r["mode"] == "compiled"}
    gathered = {r["batch"]: r["step_ms"] for r in rows if r["mode"] == "compiled, attention in tensor ops"}
    attention_speedup = {str(r["batch"]): gathered[r["batch"]] / r["step_ms"] for r in rows if r["mode"] == "compiled"}
    data = {"model": "small preset, random weights, float32", "threads": 2, "device": args.device,
            "prompt_tokens": PROMPT,
            "rates": rates, "steps": rows, "compiled_speedup": speedup, "prepacked_speedup": prepack_speedup,
            "panel_kernel": panel_gemm.available(), "panel_kernel_speedup": panel_speedup,
            "attention_kernel_speedup": attention_speedup,
            "compile_s": max(r["compile_s"] for r in rows)}
    out = write_results(args.name, data)
    plot(data, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
