"""The ``ringmoe`` command.  It only composes library calls; no logic of its own."""

from __future__ import annotations

import argparse
import sys


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return number


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
    demo.add_argument("--capacity-factor", type=float, default=None, help="expert capacity factor (default: dropless); capacity is decided per ep group over its tokens, so with --cp > 1 it differs from one process (the check then fails by design)")
    demo.add_argument("--overlap-chunks", type=_positive, default=2, help="expert-parallel micro-batches: each "
                      "travels while another computes (default 2; 1 = exchanges wait; results are the same)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
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
    sim.add_argument("--skew", type=float, default=1.0, help="expert load max/mean over ep ranks (default 1)")
    sim.add_argument("--chunks", type=_positive, default=1, help="EP micro-batches overlapping exchange and compute")
    sim.add_argument("--bytes", type=_positive, default=2, help="bytes per element (default 2: bf16)")
    sim.add_argument("--png", metavar="FILE", help="also draw time vs cp and exposed communication vs tokens per rank")
    sim.add_argument("--calibrate", metavar="FILE", help="measure this machine (2 gloo ranks x 1 thread), write the "
                     "profile to FILE and exit; use it with --hw FILE")


def _simulate(parser, args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .sim import Scenario, calibrate_this_machine, hardware_profile, simulate
    from .sim.report import plot, summary_rows, sweep_cp, sweep_tokens

    console = Console()
    if args.calibrate:
        hw = calibrate_this_machine()
        hw.save(args.calibrate)
        console.print(f"wrote {args.calibrate}: {hw}")
        return 0
    try:
        if args.checkpoint:
            from .model import load_config

            config = load_config(args.checkpoint)
        else:
            from .model import preset

            config = preset(args.preset)
        scenario = Scenario(config, hardware_profile(args.hw), args.seqlen, args.cp, args.ep, args.batch, args.layout,
                            skew=args.skew, chunks=args.chunks, element_bytes=args.bytes)
        prediction = simulate(scenario)
    except ValueError as error:
        parser.error(str(error))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ringmoe",
        description="Exact long-context mixture-of-experts transformers across devices: FlashAttention, ring "
                    "attention (context parallel), expert parallelism.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    attention = sub.add_parser("attention", help="FlashAttention backends vs the float64 oracle and torch SDPA")
    attention.add_argument("--seqlen", type=_positive, default=4096, help="tokens (default 4096)")
    attention.add_argument("--seed", type=int, default=0, help="random seed")
    _add_simulate(sub)
    args = parser.parse_args(argv)

    if args.command == "simulate":
        return _simulate(parser, args)

    if args.command == "attention":
        from .demo import attention_showcase

        return 0 if attention_showcase(args.seqlen, args.seed) else 1
    if args.command == "demo":
        from .demo import DemoOptions, run_demo, run_demo_torchrun

        options = DemoOptions(preset=args.preset, checkpoint=args.checkpoint, cp=args.cp, ep=args.ep,
                              seqlen=args.seqlen, batch=args.batch, new_tokens=args.new_tokens, layout=args.layout,
                              capacity_factor=args.capacity_factor, overlap_chunks=args.overlap_chunks,
                              seed=args.seed, check=not args.no_check)
        try:
            ok = run_demo_torchrun(options) if args.launcher == "torchrun" else run_demo(options)
        except ValueError as error:
            parser.error(str(error))
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
