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


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return number


def _seconds(value: str) -> float:
    """A duration >= 0 (0 = off)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return number


def _writable_file(flag: str, path: str) -> None:
    """ValueError unless ``path``'s folder exists (checked before any work starts)."""
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {str(folder)!r} does not exist")
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file name")


def _add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="the main job: prefill + decode a MoE transformer on a cp x ep mesh of local ranks, checked exactly",
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
    if args.png:
        plot(sweep_cp(scenario, args.cp), sweep_tokens(scenario), args.png)
        console.print(f"wrote {args.png}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringmoe",
        description="Exact long-context mixture-of-experts transformers across devices: FlashAttention, ring "
                    "attention (context parallel), expert parallelism.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors (default: one line)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    attention = sub.add_parser("attention", help="FlashAttention backends vs the float64 oracle and torch SDPA")
    attention.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    attention.add_argument("--seqlen", type=_positive, default=4096, help="tokens (default 4096)")
    attention.add_argument("--seed", type=int, default=0, help="random seed")
    _add_simulate(sub)
    for name in ("demo", "simulate"):  # --debug after the command too
        sub.choices[name].add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                       help="show tracebacks of errors")
    return parser


def _run(args) -> int:
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "attention":
        from .demo import attention_showcase

        return 0 if attention_showcase(args.seqlen, args.seed) else 1
    from .demo import DemoOptions, run_demo, run_demo_torchrun

    options = DemoOptions(preset=args.preset, checkpoint=args.checkpoint, cp=args.cp, ep=args.ep,
                          seqlen=args.seqlen, batch=args.batch, new_tokens=args.new_tokens, layout=args.layout,
                          capacity_factor=args.capacity_factor, overlap_chunks=args.overlap_chunks,
                          seed=args.seed, check=not args.no_check, watchdog=args.watchdog)
    ok = run_demo_torchrun(options) if args.launcher == "torchrun" else run_demo(options)
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
