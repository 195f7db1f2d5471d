"""The ``ringmoe`` command.  It only composes library calls; no logic of its own.

A user's mistake (a bad flag value, a missing or broken file, a job too big for the
machine) ends in one line naming the flag or file, exit status 2, before any rank
starts; ``--debug`` shows the traceback.  A rank that fails ends the job with the
failing rank named first (exit 1); SIGINT / SIGTERM stop every rank (exit 130 / 143).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from pathlib import Path


def _number(cast, accept, expected: str):
    """An argparse type: ``cast`` the text, keep it if ``accept(value)``, else say what was ``expected``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    return parse


_positive = _number(int, lambda n: n >= 1, "a positive int")
_positive_float = _number(float, lambda x: math.isfinite(x) and x > 0, "a finite number > 0")
_seconds = _number(float, lambda x: math.isfinite(x) and x >= 0, "a number of seconds >= 0")  # 0 = off


def _writable_file(flag: str, path: str) -> None:
    """ValueError unless ``path``'s folder exists (checked before any work starts)."""
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {str(folder)!r} does not exist")
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file name")


def _add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo", help="the main job: serve a MoE model on a cp=2 x ep=2 mesh and talk to it with the openai client",
        description="Trains (once, about two minutes, cached) a small MoE model on the standard library's "
                    "sources, starts `ringmoe serve` on 4 local ranks, sends a streaming "
                    "chat, a long prompt (ring attention prefill) and concurrent completions, prints a per-rank "
                    "table, latencies and an exactness check against one process, then stops the server.")
    demo.add_argument("--cp", type=_positive, default=2, help="context-parallel degree (default 2)")
    demo.add_argument("--ep", type=_positive, default=2, help="expert-parallel degree (default 2)")
    demo.add_argument("--retrain", action="store_true", help="train the cached demo model again (about two minutes)")
    demo.add_argument("--train-steps", type=_positive, default=900,
                      help="optimizer steps of the demo model's training (default 900, about two minutes on 2 cores; "
                           "a different count trains and caches a model of its own)")
    demo.add_argument("--enforce-eager", action="store_true",
                      help="serve with eager decode steps (default: each rank compiles its decode step at start-up)")


def _add_check(sub) -> None:
    demo = sub.add_parser(
        "check",
        help="prefill + decode a MoE transformer on a cp x ep mesh of local ranks, checked exactly against one process",
        description="Spawns cp x ep CPU ranks (gloo), prefills a long prompt with ring attention (context parallel) "
                    "and expert parallelism, decodes greedily with a sharded KV cache, and checks tokens and logits "
                    "against one process running the same weights.  Exit code 0 = exact.",
    )
    demo.add_argument("--preset", default="small", help="model preset: tiny, small (default), mixtral-8x7b, qwen3-30b-a3b "
                      "(random weights; the large ones need real GPUs)")
    demo.add_argument("--checkpoint", metavar="DIR", help="a transformers checkpoint directory (config.json + "
                      "safetensors) of a Mixtral or Qwen3-MoE model, instead of --preset; each rank reads only its experts")
    demo.add_argument("--cp", type=_positive, default=2, help="context-parallel degree: ranks sharing each sequence (default 2)")
    demo.add_argument("--ep", type=_positive, default=2, help="expert-parallel degree: ranks sharing the experts; also "
                      "splits the batch (default 2)")
    demo.add_argument("--seqlen", type=_positive, default=4096, help="prompt tokens per sequence (default 4096)")
    demo.add_argument("--batch", type=_positive, default=None, help="sequences (default: ep, one per expert-parallel rank)")
    demo.add_argument("--new-tokens", type=_positive, default=8, help="tokens to decode greedily (default 8)")
    demo.add_argument("--layout", default="zigzag", choices=["zigzag", "striped", "contiguous"],
                      help="how each sequence is sharded over the cp ranks (default zigzag: balanced causal work)")
    demo.add_argument("--capacity-factor", type=_positive_float, default=None, help="expert capacity factor (default: dropless); capacity is decided per ep group over its tokens, so with --cp > 1 it differs from one process (the check then fails by design)")
    demo.add_argument("--overlap-chunks", type=_positive, default=2, help="expert-parallel micro-batches: each "
                      "travels while another computes (default 2; 1 = exchanges wait; results are the same)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
    demo.add_argument("--watchdog", type=_seconds, default=30.0, metavar="SECONDS",
                      help="stop the job, naming the stuck rank and what it was doing, when no rank makes progress "
                           "for this long (default 30; 0 = off)")
    demo.add_argument("--no-check", action="store_true", help="skip the single-process exactness check")
    demo.add_argument("--launcher", default="local", choices=["local", "torchrun"],
                      help="local: spawn the ranks here (default); torchrun: this process is one rank of a torchrun "
                           "job (NCCL on GPUs), world size must be cp x ep")


def _add_simulate(sub) -> None:
    sim = sub.add_parser(
        "simulate",
        help="predict prefill time, communication, imbalance and memory at cluster scale (cost model)",
        description="Schedules one layer's ring attention and expert-parallel exchanges as events on compute and "
                    "link queues of every rank, for a model preset and a hardware profile.",
    )
    sim.add_argument("--preset", default="mixtral-8x7b", help="model preset (default mixtral-8x7b)")
    sim.add_argument("--checkpoint", metavar="DIR", help="take the model shape from a checkpoint's config.json")
    sim.add_argument("--cp", type=_positive, default=8, help="context-parallel degree (default 8)")
    sim.add_argument("--ep", type=_positive, default=8, help="expert-parallel degree (default 8)")
    sim.add_argument("--seqlen", type=_positive, default=131072, help="tokens per sequence (default 131072)")
    sim.add_argument("--batch", type=_positive, default=None, help="sequences (default: ep)")
    sim.add_argument("--layout", default="zigzag", choices=["zigzag", "striped", "contiguous"], help="shard layout")
    sim.add_argument("--hw", default="h100", help="hardware profile: h100, h200, h800, or a JSON file from --calibrate")
    sim.add_argument("--skew", type=_skew, default=1.0, help="expert load max/mean over ep ranks (default 1)")
    sim.add_argument("--chunks", type=_positive, default=1, help="EP micro-batches overlapping exchange and compute")
    sim.add_argument("--bytes", type=_positive, default=2, help="bytes per element (default 2: bf16)")
    sim.add_argument("--png", metavar="FILE", help="also draw time vs cp and exposed communication vs tokens per rank")
    sim.add_argument("--calibrate", metavar="FILE", help="measure this machine (2 gloo ranks x 1 thread), write the "
                     "profile to FILE and exit; use it with --hw FILE")


def _skew(value: str) -> float:
    number = _positive_float(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (max/mean load), got {value}")
    return number


def _require_matplotlib(flag: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib: pip install 'ringmoe[plot]'") from None


def _simulate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .sim import Scenario, calibrate_this_machine, hardware_profile, simulate
    from .sim.report import plot, summary_rows, sweep_cp, sweep_tokens

    console = Console()
    if args.calibrate:
        _writable_file("--calibrate", args.calibrate)
        hw = calibrate_this_machine()
        hw.save(args.calibrate)
        console.print(f"wrote {args.calibrate}: {hw}")
        return 0
    if args.png:
        _writable_file("--png", args.png)
        _require_matplotlib("--png")
    if args.checkpoint:
        from .model import load_config

        config = load_config(args.checkpoint)
    else:
        from .model import preset

        config = preset(args.preset)
    scenario = Scenario(config, hardware_profile(args.hw), args.seqlen, args.cp, args.ep, args.batch, args.layout,
                        skew=args.skew, chunks=args.chunks, element_bytes=args.bytes)
    prediction = simulate(scenario)
    table = Table(title=f"ringmoe simulate: {args.checkpoint or args.preset}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary_rows(prediction):
        table.add_row(key, value)
    console.width = max(console.width, 120)
    console.print(table)
    if args.cp > 1:
        from .sim.sequence_parallel import choose_sequence_parallel

        _, _, why = choose_sequence_parallel(config, scenario.hw, args.seqlen, args.cp, batch=args.batch or args.ep,
                                             ep=args.ep, element_bytes=args.bytes)
        console.print(f"sequence parallelism over cp = {args.cp}: {why}")
    if args.png:
        plot(sweep_cp(scenario, args.cp), sweep_tokens(scenario), args.png)
        console.print(f"wrote {args.png}")
    return 0


def _add_serve(sub) -> None:
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server for a checkpoint, on one process or a cp x ep mesh",
        description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. Rank 0 runs "
                    "the HTTP front end and the engine's driver; the other ranks run the step loop. SIGTERM drains "
                    "in-flight requests, then exits 0.")
    serve.add_argument("--model", required=True, metavar="DIR", help="a transformers checkpoint folder (config.json, "
                       "safetensors, tokenizer.json)")
    serve.add_argument("--cp", type=_positive, default=1, help="context-parallel degree (ring prefill)")
    serve.add_argument("--ulysses-degree", type=_positive, default=1, metavar="U",
                       help="prefill prompts by Ulysses inside groups of U cp ranks and the ring across them "
                            "(divides --cp; default 1: the ring alone)")
    serve.add_argument("--ep", type=_positive, default=1, help="expert-parallel degree (ep groups are data-parallel "
                       "replicas for attention)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: the "
                       "checkpoint's: config.json _name_or_path, else the folder's, the run's for RUN/hf)")
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes", "deepseek_v3", "harmony", "none"],
                       help="the model's tool-call syntax (default: deepseek_v3 for DeepSeek-V3, harmony for "
                       "gpt-oss, else hermes)")
    serve.add_argument("--json-any-whitespace", action="store_true", help="let JSON grammars (response_format, "
                       "forced tool calls) put whitespace between tokens (default: compact JSON)")
    serve.add_argument("--allowed-origins", default="", help="comma-separated CORS origins ('*' for any; "
                       "default: none)")
    serve.add_argument("--max-num-seqs", type=_positive, default=64, help="running requests per ep group")
    serve.add_argument("--max-num-batched-tokens", type=_positive, default=2048, help="tokens per step per ep group")
    serve.add_argument("--kv-cache-tokens", type=_positive, default=65536, help="KV cache per rank, in tokens")
    serve.add_argument("--block-size", type=_positive, default=16, help="tokens per KV block")
    serve.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,fp8,fp8_e4m3}",
                       help="auto: K/V cached in --dtype; fp8 / fp8_e4m3: one byte per value (e4m3 codes, per-layer "
                            "scales measured at start-up), decoded as attention reads them")
    serve.add_argument("--max-model-len", type=_positive, default=None, help="prompt + output limit")
    serve.add_argument("--max-waiting", type=_positive, default=1024, help="waiting requests before 429")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    serve.add_argument("--quantization", default=None, choices=["fp8", "mxfp4"],
                       help="quantize a float checkpoint's weights once loaded: fp8 (e4m3, 128x128 blocks, every "
                       "projection) or mxfp4 (the experts); a checkpoint that ships quantized needs no flag")
    serve.add_argument("--deterministic", action="store_true", help="bitwise-reproducible tokens whatever the batch")
    serve.add_argument("--speculative-config", metavar="JSON", default=None,
                       help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\' (n-gram prompt lookup) or '
                            '\'{"method": "mtp"}\'; add "draft_length": "goodput" to keep, each step, only the '
                            'drafts that raise its expected tokens per second')
    serve.add_argument("--enforce-eager", action="store_true", help="run decode steps eagerly (default: one rank "
                       "compiles its decode step with torch.compile at start-up, ~10-40 s on a CPU)")
    serve.add_argument("--no-prepack-weights", dest="prepack_weights", action="store_false",
                       help="keep one copy of the weights (default with float32: a second copy in oneDNN's blocked "
                       "layout for the eager products: decode steps of 8-64 requests 1.1-1.3x faster on a CPU)")
    serve.add_argument("--threads", type=_positive, default=None, help="intra-op threads per rank (default: the "
                       "cores less one, left to the HTTP loop, shared among the ranks)")
    serve.add_argument("--engine-core", default="process", choices=["process", "thread"],
                       help="process: the engine steps in a process of its own and the HTTP front ends talk to it "
                       "over ZMQ (default); thread: the engine steps in a thread of the HTTP server's process "
                       "(also what each rank does under --launcher torchrun)")
    serve.add_argument("--api-server-count", type=_positive, default=1, metavar="N",
                       help="HTTP front-end processes sharing the port and the one engine (--engine-core process)")
    serve.add_argument("--launcher", default="spawn", choices=["spawn", "torchrun"],
                       help="spawn: local ranks (default); torchrun: this process is one rank")
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every /v1 route "
                       "(default: $RINGMOE_API_KEY if set; /health and /metrics stay open)")
    _add_limit_flags(serve)


# what each input limit of the server bounds (flags named after serve.limits.ServerLimits' fields)
_LIMIT_HELP = {
    "max_body_bytes": "request body size (413 past it)", "max_messages": "chat messages per request",
    "max_stop_strings": "stop strings per request", "max_stop_chars": "characters per stop string",
    "max_stop_token_ids": "stop_token_ids entries per request",
    "header_timeout_s": "seconds a connection has to send its request headers (slowloris)",
    "body_timeout_s": "seconds a request has to send its body (408 past it)",
    "keep_alive_s": "seconds an idle keep-alive connection stays open",
    "limit_concurrency": "connections + requests before 503", "template_timeout_s": "seconds a chat template may "
    "render (400 past it; its worker process is replaced)", "template_workers": "chat-template worker processes",
    "tokenizer_threads": "threads that tokenize prompts",
    "graceful_s": "seconds in-flight requests get after SIGTERM before they end with an error",
    "log_requests": "log one line per request", "max_log_len": "prompt characters per logged request",
    "max_choices": "choices per request (prompts x n)", "max_tools": "tool definitions per request",
    "max_logit_bias": "logit_bias entries per request",
    "grammar_timeout_s": "seconds a structured-output grammar may take to compile (400 past it)",
    "max_grammar_bytes": "bytes of a compiled structured-output grammar sent to the engine-core process (400 past it)",
    "log_stats_s": "seconds between throughput lines while requests run (0: none)",
}


def _add_limit_flags(serve) -> None:
    import dataclasses

    from .serve.limits import ServerLimits

    for f in dataclasses.fields(ServerLimits):
        flag = "--" + f.name.replace("_", "-").removesuffix("-s")
        if f.name == "log_requests":
            serve.add_argument("--enable-log-requests", dest=f.name, action="store_true", help=_LIMIT_HELP[f.name])
            continue
        kind = int if isinstance(f.default, int) else float
        serve.add_argument(flag, dest=f.name, type=kind, default=f.default,
                           help=f"{_LIMIT_HELP[f.name]} (default {f.default})")


def _add_train(sub) -> None:
    train = sub.add_parser(
        "train", help="train a MoE model on packed documents on a cp x ep mesh; writes a transformers checkpoint",
        description="Trains a byte-level BPE tokenizer and the model on a corpus (default: the Python standard "
                    "library's sources), packing documents into sequences whose attention never crosses a "
                    "document (varlen ring attention under --cp > 1). Writes checkpoints (resumable), metrics.jsonl, "
                    "loss.png and out/hf, a transformers folder that `ringmoe serve --model OUT/hf` serves.")
    train.add_argument("--out", required=True, metavar="DIR", help="output folder")
    train.add_argument("--data", metavar="PATH", help="a folder of text files or a .jsonl with a \"text\" field "
                       "(default: the standard library's .py files)")
    train.add_argument("--preset", default="small", help="model preset (default small)")
    train.add_argument("--vocab-size", type=_positive, default=None, help="tokenizer/model vocabulary (default: preset's)")
    train.add_argument("--cp", type=_positive, default=1)
    train.add_argument("--ep", type=_positive, default=1)
    train.add_argument("--cp-mode", default="ring", choices=["ring", "ulysses", "usp", "auto"],
                       help="sequence parallelism over the cp ranks: the ring (default), Ulysses all-to-all, "
                            "usp = Ulysses x ring (with --ulysses-degree), auto = the cost model picks (see --hw)")
    train.add_argument("--ulysses-degree", type=_positive, default=None, metavar="U",
                       help="--cp-mode usp: ranks of each Ulysses group (divides --cp; the ring is cp / U)")
    train.add_argument("--hw", default="h100", help="--cp-mode auto: hardware profile the cost model weighs "
                       "(h100, h200, h800 or a calibrated JSON; default h100)")
    train.add_argument("--seqlen", type=_positive, default=512)
    train.add_argument("--tokens-per-step", type=_positive, default=8192)
    train.add_argument("--steps", type=_positive, default=200)
    train.add_argument("--minutes", type=_positive_float, default=None, help="stop after this long (whichever first)")
    train.add_argument("--lr", type=_positive_float, default=3e-3)
    train.add_argument("--warmup", type=_positive, default=20)
    train.add_argument("--balance", default="aux", choices=["aux", "bias", "none"],
                       help="load balancing: auxiliary loss, or DeepSeek-V3's aux-loss-free bias")
    train.add_argument("--aux-coef", type=_positive_float, default=1e-2, help="balancing loss weight (default 0.01)")
    train.add_argument("--bias-rate", type=_positive_float, default=1e-3,
                       help="selection-bias step per update with --balance bias (default 0.001)")
    train.add_argument("--mtp", action="store_true",
                       help="train a DeepSeek-V3 multi-token prediction module with the model (a DeepSeek-V3 preset); "
                            "exported as its num_nextn_predict_layers layer, it drafts for `serve --speculative-config "
                            "'{\"method\": \"mtp\"}'`")
    train.add_argument("--mtp-lambda", type=_positive_float, default=0.3,
                       help="weight of the MTP loss (default 0.3, DeepSeek-V3's)")
    train.add_argument("--eval-every", type=_positive, default=50)
    train.add_argument("--save-every", type=_positive, default=100)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--log-every", type=_positive, default=10, help="print every n-th step (default 10)")
    train.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    train.add_argument("--bf16", action="store_true", help="bfloat16 autocast, float32 master weights")
    train.add_argument("--launcher", default="spawn", choices=["spawn", "torchrun"],
                       help="spawn: local ranks (default); torchrun: this process is one rank")
    train.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute each layer in backward: less memory, more compute")
    train.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")


def _add_convert(sub) -> None:
    convert = sub.add_parser(
        "convert-checkpoint", help="rewrite a pickled training checkpoint of ringmoe 0.1 (rank*.pt) as safetensors + JSON",
        description="Reads each rank*.pt of a step folder with torch.load(weights_only=True) (tensors and plain "
                    "containers only: no code runs) and writes the folder again in the current format, in place.")
    convert.add_argument("folder", metavar="STEP_DIR", help="e.g. out/step-000100")
    convert.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")


def _train(args) -> int:
    from rich.console import Console

    from .train.run import TrainOptions, run_training

    console = Console()
    console.width = max(console.width, 120)
    options = TrainOptions(out=args.out, data=args.data, preset=args.preset, vocab_size=args.vocab_size, cp=args.cp,
                           ep=args.ep, cp_mode=args.cp_mode, ulysses_degree=args.ulysses_degree,
                           seqlen=args.seqlen, tokens_per_step=args.tokens_per_step, steps=args.steps,
                           minutes=args.minutes, lr=args.lr, warmup=args.warmup, balance=args.balance,
                           aux_coef=args.aux_coef, bias_rate=args.bias_rate, mtp=args.mtp, mtp_lambda=args.mtp_lambda,
                           eval_every=args.eval_every, save_every=args.save_every, seed=args.seed, resume=args.resume,
                           bf16=args.bf16, activation_checkpointing=args.activation_checkpointing,
                           log_every=args.log_every)
    if options.cp_mode == "auto":  # the cost model picks ring / ulysses / usp for this model, length and cluster
        from .sim.hardware import hardware_profile
        from .sim.sequence_parallel import auto_cp_mode
        from .train.run import model_config

        if args.ulysses_degree is not None:
            raise ValueError("--ulysses-degree is for --cp-mode usp (auto picks it)")
        options.cp_mode, options.ulysses_degree, why = auto_cp_mode(
            model_config(options), hardware_profile(args.hw), options.seqlen, options.cp,
            batch=max(1, options.rows // options.ep), ep=options.ep)
        console.print(f"--cp-mode auto on {args.hw}: {why}")
    result = run_training(options, console, args.launcher)
    console.print(f"trained {result['steps']} steps: validation loss {result['val_loss']:.3f} nats "
                  f"(unigram entropy {result['unigram_entropy']:.3f}); transformers checkpoint: {result['hf']}")
    if "mtp_draft_acceptance" in result:
        console.print(f"MTP: validation loss {result['mtp_val_loss']:.3f} nats (two tokens ahead); its greedy draft "
                      f"matches the model's next greedy token at {result['mtp_draft_acceptance']:.1%} of positions")
    return 0


def _add_bench(sub) -> None:
    bench_parser = sub.add_parser("bench", help="load benchmarks")
    bench = bench_parser.add_subparsers(dest="bench_command", required=True)
    serve = bench.add_parser("serve", help="load any OpenAI-compatible server: throughput, TTFT, TPOT, ITL, latency",
                             description="Poisson arrivals of streaming /v1/completions requests, bounded in count "
                                         "and time; one run per --rate; JSON (and a PNG with --png).")
    serve.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    serve.add_argument("--model", required=True, help="model name to send")
    serve.add_argument("--rate", default="inf", help="requests per second, comma separated (inf: all at once)")
    serve.add_argument("--num-prompts", type=_positive, default=32)
    serve.add_argument("--concurrency", type=_positive, default=32)
    serve.add_argument("--input-len", default="64", help="prompt tokens: N or LO:HI (the served tokenizer's: "
                       "--tokenizer, else the server's /tokenize; words when it has neither)")
    serve.add_argument("--output-len", default="64", help="max_tokens: N or LO:HI")
    serve.add_argument("--timeout", type=_positive_float, default=300.0, help="seconds per request")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos (some servers reject it)")
    serve.add_argument("--tokenizer", metavar="DIR", default=None, help="a folder with the served tokenizer.json")
    serve.add_argument("--dataset", metavar="FILE.jsonl", default=None, help="replay these prompts: one "
                       '{"prompt": ..., "max_tokens": ...} per line')
    serve.add_argument("--out", metavar="FILE", help="write the results as JSON")
    serve.add_argument("--png", metavar="FILE", help="draw latency and throughput against the request rate")
    for parser in (bench_parser, serve):
        parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _span(flag: str, text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        span = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"{flag} must be N or LO:HI, got {text!r}") from None
    if not 1 <= span[0] <= span[1]:
        raise ValueError(f"{flag} must satisfy 1 <= LO <= HI, got {text!r}")
    return span


def _bench_serve(args) -> int:
    from rich.console import Console

    from .serve.bench import BenchConfig, plot, run_benchmark

    try:
        rates = [math.inf if r.strip() == "inf" else float(r) for r in args.rate.split(",")]
    except ValueError:
        raise ValueError(f"--rate must be numbers or inf, comma separated, got {args.rate!r}") from None
    if any(not r > 0 for r in rates):
        raise ValueError(f"--rate must be > 0, got {args.rate!r}")
    for flag, path in (("--out", args.out), ("--png", args.png)):
        if path:
            _writable_file(flag, path)
    if args.png:
        _require_matplotlib("--png")
    console, runs = Console(), []
    for rate in rates:
        config = BenchConfig(args.url.rstrip("/"), args.model, args.num_prompts, rate, args.concurrency,
                             _span("--input-len", args.input_len), _span("--output-len", args.output_len),
                             args.seed, args.timeout, args.ignore_eos, args.tokenizer, args.dataset)
        result = run_benchmark(config)
        runs.append(result)
        console.print(f"rate {result['rate']}: {result['completed']}/{args.num_prompts} ok, {result['errors']} errors, "
                      f"{result['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {result['ttft_s']['p50'] * 1e3:.0f} ms "
                      f"p99 {result['ttft_s']['p99'] * 1e3:.0f} ms, TPOT p50 {result['tpot_s']['p50'] * 1e3:.1f} ms, "
                      f"e2e p99 {result['e2e_s']['p99']:.2f} s")
        if result["errors"]:
            console.print(f"  errors, e.g.: {result['error_examples']}")
    if args.out:
        import json

        Path(args.out).write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    if args.png:
        plot(runs, args.png)
    return 0 if all(r["errors"] == 0 for r in runs) else 1


def _serve(args) -> int:
    import dataclasses
    import os

    from .serve.limits import ServerLimits
    from .serve.service import ServeOptions, run_server

    options = ServeOptions(model=args.model, cp=args.cp, ep=args.ep, ulysses=args.ulysses_degree, host=args.host,
                           port=args.port, speculative_config=args.speculative_config,
                           served_model_name=args.served_model_name, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens,
                           block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                           max_model_len=args.max_model_len, max_waiting=args.max_waiting,
                           deterministic=args.deterministic, enforce_eager=args.enforce_eager, dtype=args.dtype,
                           prepack_weights=args.prepack_weights,
                           quantization=args.quantization, threads=args.threads, engine_core=args.engine_core,
                           api_server_count=args.api_server_count,
                           limits=ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)}),
                           api_key=args.api_key if args.api_key is not None else os.environ.get("RINGMOE_API_KEY"),
                           tool_call_parser=args.tool_call_parser, json_any_whitespace=args.json_any_whitespace,
                           allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()))
    return run_server(options, args.launcher)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringmoe",
        description="Exact long-context mixture-of-experts transformers across devices: FlashAttention, ring "
                    "attention (context parallel), expert parallelism.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors (default: one line)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_check(sub)
    attention = sub.add_parser("attention", help="FlashAttention backends vs the float64 oracle and torch SDPA")
    attention.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    attention.add_argument("--seqlen", type=_positive, default=4096, help="tokens (default 4096)")
    attention.add_argument("--seed", type=int, default=0, help="random seed")
    _add_simulate(sub)
    _add_serve(sub)
    _add_train(sub)
    _add_convert(sub)
    _add_bench(sub)
    for name in ("demo", "check", "simulate", "serve"):  # --debug after the command too
        sub.choices[name].add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                       help="show tracebacks of errors")
    return parser


def _run(args) -> int:
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "train":
        return _train(args)
    if args.command == "convert-checkpoint":
        from .train.checkpoint import convert_legacy

        print(f"converted {convert_legacy(args.folder)}")
        return 0
    if args.command == "bench":
        return _bench_serve(args)
    if args.command == "attention":
        from .apps.attention import attention_showcase

        return 0 if attention_showcase(args.seqlen, args.seed) else 1
    if args.command == "demo":
        from .apps.demo import DemoOptions, run_demo

        return 0 if run_demo(DemoOptions(cp=args.cp, ep=args.ep, retrain=args.retrain, train_steps=args.train_steps,
                                         enforce_eager=args.enforce_eager)) else 1
    from .apps.check import CheckOptions, run_check, run_check_torchrun

    options = CheckOptions(preset=args.preset, checkpoint=args.checkpoint, cp=args.cp, ep=args.ep,
                          seqlen=args.seqlen, batch=args.batch, new_tokens=args.new_tokens, layout=args.layout,
                          capacity_factor=args.capacity_factor, overlap_chunks=args.overlap_chunks,
                          seed=args.seed, check=not args.no_check, watchdog=args.watchdog)
    ok = run_check_torchrun(options) if args.launcher == "torchrun" else run_check(options)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from .parallel.launch import JobInterrupted, RankFailed

    parser = _parser()
    args = parser.parse_args(argv)
    prog = f"ringmoe {args.command}"
    try:
        return _run(args)
    except (ValueError, TypeError) as error:  # the user's input: one line, exit 2
        if args.debug:
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except RankFailed as failure:  # the job failed: the failing rank first, its traceback below
        if args.debug:
            raise
        print(f"{prog}: {failure}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, JobInterrupted) as interrupt:
        signum = getattr(interrupt, "signum", signal.SIGINT)
        print(f"{prog}: interrupted by {signal.Signals(signum).name}; every rank was stopped", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
