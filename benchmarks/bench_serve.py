"""`ringmoe serve` vs `transformers serve --continuous-batching`: same checkpoint, same load, one run.

Checkpoint: the demo's (small preset, Mixtral architecture, 4 layers, hidden 256, 8 experts top-2,
float32, a BPE tokenizer trained on the standard library).  Servers on 127.0.0.1, each started,
warmed up, loaded and stopped in turn: ringmoe 1 x 1 (the default: the engine in its own process with
every core, one HTTP front-end process), ringmoe-thread (--engine-core thread: the engine stepped by a
thread of the HTTP process, a core left to the HTTP loop), ringmoe-api2 (--api-server-count 2),
ringmoe cp=1 x ep=2 (2 ranks x 1 thread: the mesh that fits 2 cores), ringmoe-eager (--enforce-eager:
no compiled decode graph), transformers serve (CPU, continuous batching) with 2 and with 1 intra-op
thread (each load compares against the peer's better one).
The servers take turns, ``--rounds`` times (each turn: start, warm up, every load, stop; one at a time:
transformers serve sizes its cache to the machine's memory): this machine's speed drifts by up to 2x over
minutes, and turns expose every server to the same drift.  Each load's median run is kept
(``rounds_output_tokens_per_s`` lists every round's).
Load (``ringmoe bench serve``'s client): streaming /v1/completions, prompts of 32..256 tokens of the
checkpoint's tokenizer (counted by the client: every server gets the same texts), ``--new`` tokens at most
(no ignore_eos: transformers serve rejects it; the random model rarely ends early, and the output tokens
counted are the ones streamed), at concurrency 8 / 32 / 64 with all
requests at once, then Poisson rates at concurrency 64.  Writes benchmarks/results/serve.json and
serve.png; the rate a server sustains within the TTFT SLO is the highest completed request rate
among its runs whose p99 TTFT is under it.

    python benchmarks/bench_serve.py [--prompts 64] [--new 32] [--concurrency 8,32,64] [--rates 2,4,8,16]
        [--slo 2.0] [--rounds 3] [--servers ringmoe,ringmoe-eager,...] [--name serve]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from ringmoe.apps.demo_model import build_demo_checkpoint  # noqa: E402
from ringmoe.parallel.launch import free_port  # noqa: E402
from ringmoe.serve.bench import BenchConfig, plot, run_benchmark, wait_healthy  # noqa: E402

BIN = Path(sys.executable).parent


def start(kind: str, checkpoint: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    """A server of ``kind`` on a free port, healthy; (process, base URL, model name).  extra: ringmoe flags."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if kind.startswith("transformers"):
        env["OMP_NUM_THREADS"] = "1" if kind.endswith("-1thread") else "2"
        cmd = [str(BIN / "transformers"), "serve", str(checkpoint), "--continuous-batching", "--device", "cpu",
               "--host", "127.0.0.1", "--port", str(port)]
        model = str(checkpoint)
    else:
        ep = "2" if kind == "ringmoe-ep2" else "1"
        flags = {"ringmoe-eager": ["--enforce-eager"], "ringmoe-thread": ["--engine-core", "thread"],
                 "ringmoe-api2": ["--api-server-count", "2"]}.get(kind, [])
        cmd = [str(BIN / "ringmoe"), "serve", "--model", str(checkpoint), "--port", str(port), "--ep", ep,
               "--served-model-name", "demo", "--kv-cache-tokens", "65536", *flags, *extra]
        model = "demo"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180)
    except RuntimeError:
        stop(proc)
        raise
    return proc, url, model


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_load(server: tuple[str, str], kind: str, rate: float, concurrency: int, args, round_: int,
             checkpoint: Path, seed: int) -> dict:
    url, model = server
    # prompt lengths in the checkpoint's own tokens, counted here: every server gets the same texts; each load of
    # a server's session its own prompts (``seed``), so none is answered from the prefix cache of an earlier load
    config = BenchConfig(url, model, num_prompts=args.prompts, rate=rate, concurrency=concurrency,
                         input_len=(32, 256), output_len=(args.new, args.new), timeout=600,
                         tokenizer=str(checkpoint), seed=seed)
    result = run_benchmark(config) | {"server": kind, "round": round_}
    print(f"{kind} round {round_} rate={result['rate']} c={concurrency}: {result['output_tokens_per_s']:.1f} tok/s, "
          f"TTFT p50 {result['ttft_s']['p50']:.2f} p99 {result['ttft_s']['p99']:.2f} s, "
          f"TPOT p50 {result['tpot_s']['p50'] * 1e3:.0f} ms, errors {result['errors']}", flush=True)
    return result


def median_run(rounds: list[dict]) -> dict:
    """The run of the median throughput among a server's rounds at one load, with every round's throughput."""
    ranked = sorted(rounds, key=lambda r: r["output_tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2] | {"rounds_output_tokens_per_s": [r["output_tokens_per_s"] for r in rounds]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--concurrency", default="8,32,64")
    parser.add_argument("--rates", default="2,4,8,16")
    parser.add_argument("--slo", type=float, default=2.0, help="p99 TTFT target, seconds")
    parser.add_argument("--rounds", type=int, default=3, help="turns each server takes at each load (the median "
                        "is reported; the machine's speed drifts over minutes)")
    parser.add_argument("--name", default="serve", help="results file name (benchmarks/results/NAME.json)")
    parser.add_argument("--servers", default="ringmoe,ringmoe-eager,ringmoe-ep2,transformers,transformers-1thread")
    args = parser.parse_args()
    checkpoint = build_demo_checkpoint(Path(tempfile.gettempdir()) / "ringmoe-bench-serve")
    kinds = args.servers.split(",")
    plans = [(math.inf, int(c)) for c in args.concurrency.split(",")]
    plans += [(float(r), max(int(c) for c in args.concurrency.split(","))) for r in args.rates.split(",") if r]
    runs = []
    for round_ in range(args.rounds):  # every server in turn, round after round, so drift hits them all alike
        for kind in kinds:
            proc, url, model = start(kind, checkpoint)
            try:
                # warm-up at the measured lengths (first long prefills allocate, and kernels pick their plans)
                run_benchmark(BenchConfig(url, model, num_prompts=16, concurrency=8, input_len=(32, 256),
                                          output_len=(args.new, args.new), seed=99, tokenizer=str(checkpoint)))
                runs += [run_load((url, model), kind, rate, concurrency, args, round_, checkpoint, seed)
                         for seed, (rate, concurrency) in enumerate(plans)]
            finally:
                stop(proc)
    runs = [median_run([r for r in runs if (r["server"], r["rate"], r["concurrency"]) == key])
            for key in dict.fromkeys((r["server"], r["rate"], r["concurrency"]) for r in runs)]
    summary = {}
    for kind in args.servers.split(","):
        mine = [r for r in runs if r["server"] == kind]
        within = [r["requests_per_s"] for r in mine if r["errors"] == 0 and r["ttft_s"]["p99"] <= args.slo]
        summary[kind] = {"best_output_tokens_per_s": max(r["output_tokens_per_s"] for r in mine),
                         f"sustained_requests_per_s_within_p99_ttft_{args.slo}s": max(within, default=0.0),
                         "errors": sum(r["errors"] for r in mine)}
    peers = [k for k in summary if k.startswith("transformers")]
    if peers:  # against the peer's better configuration at each load
        for kind in summary:
            if not kind.startswith("transformers"):
                pairs = []
                for a in (r for r in runs if r["server"] == kind):
                    same = [b for b in runs if b["server"] in peers and b["rate"] == a["rate"]
                            and b["concurrency"] == a["concurrency"]]
                    pairs.append((a, max(same, key=lambda b: b["output_tokens_per_s"])))
                summary[kind]["throughput_ratio_vs_transformers"] = [
                    {"rate": a["rate"], "concurrency": a["concurrency"], "peer": b["server"],
                     "ratio": a["output_tokens_per_s"] / b["output_tokens_per_s"],
                     "p99_ttft_s": [a["ttft_s"]["p99"], b["ttft_s"]["p99"]]} for a, b in pairs]
    print(summary)
    write_results(args.name, {"checkpoint": "demo (small preset, random weights, float32)", "prompts": args.prompts,
                            "new_tokens": args.new, "slo_p99_ttft_s": args.slo, "runs": runs, "summary": summary},
                  lambda data, path: plot(data, path), runs)


if __name__ == "__main__":
    main()
