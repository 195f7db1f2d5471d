"""The main job: a long prompt through the MoE transformer on a cp x ep mesh, checked against one process.

``run_check(options)`` spawns cp * ep local gloo ranks (or, under torchrun, is
one of them), prefills ``batch`` prompts of ``seqlen`` tokens context-parallel,
decodes ``new_tokens`` greedily with the sharded KV cache, and compares tokens
and logits with a single-process run of the same weights.  Each rank reports
its timings, peak memory, ring attention statistics and MoE routing counts.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import queue
from dataclasses import dataclass

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..model import MoETransformer, check_checkpoint, load_checkpoint, load_config, preset
from ..moe.layer import check_capacity_factor
from ..parallel import make_mesh
from ..parallel.launch import join_torchrun, spawn
from ..parallel.layout import check_layout
from ..resources import PROCESS_OVERHEAD_BYTES, available_memory_bytes, gib, require_memory
from ..serve import generate
from ..sim.costs import memory_per_rank

__all__ = ["CheckOptions", "run_check"]


@dataclass
class CheckOptions:
    preset: str = "small"
    checkpoint: str | None = None
    cp: int = 2
    ep: int = 2
    seqlen: int = 4096
    batch: int | None = None  # default: ep (one sequence per expert-parallel coordinate)
    new_tokens: int = 8
    layout: str = "zigzag"
    capacity_factor: float | None = None
    overlap_chunks: int = 2
    seed: int = 0
    check: bool = True
    watchdog: float = 30.0  # seconds without progress before the job is stopped (0 = off)

    @property
    def rows(self) -> int:
        return self.batch if self.batch is not None else self.ep


def _config(options: CheckOptions):
    config = load_config(options.checkpoint) if options.checkpoint else preset(options.preset)
    return config.replace(capacity_factor=options.capacity_factor, overlap_chunks=options.overlap_chunks)


def validate(options: CheckOptions, device_type: str = "cpu") -> None:
    """Every option error, and a job too big for this machine, before any process starts."""

    for name in ("cp", "ep", "seqlen", "new_tokens", "overlap_chunks"):
        value = getattr(options, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
    try:
        check_capacity_factor(options.capacity_factor)
    except ValueError:
        raise ValueError(f"--capacity-factor must be a finite number > 0 (omit it for dropless experts), "
                         f"got {options.capacity_factor!r}") from None
    if options.cp > 1:
        check_layout(options.seqlen, options.cp, options.layout)
    if options.rows % options.ep:
        raise ValueError(f"--batch ({options.rows}) must be divisible by --ep ({options.ep})")
    if options.checkpoint:
        check_checkpoint(options.checkpoint)  # config, files and tensor shapes, headers only
    config = _config(options)
    if config.num_experts % options.ep:
        raise ValueError(f"--ep ({options.ep}) must divide the model's {config.num_experts} experts")
    check_fits(options, config, device_type)


def memory_estimate(options: CheckOptions, config, cp: int, ep: int, rows: int) -> dict:
    """Bytes one rank of a cp x ep mesh holds (weights, KV cache, activations) for this job, float32."""

    local_rows = rows // ep
    local_tokens = math.ceil(options.seqlen / cp)
    cached = local_tokens + math.ceil(options.new_tokens / cp)
    parts = memory_per_rank(config, cp, ep, local_rows, cached, 4, recv_rows=local_rows * local_tokens * config.top_k,
                            chunks=options.overlap_chunks)
    parts["kv_cache"] += parts.pop("kv_in_flight")
    parts.pop("total")
    return parts


def check_fits(options: CheckOptions, config, device_type: str = "cpu") -> None:
    """Refuse (ValueError) a job whose ranks (or single-process check) cannot fit in memory."""

    world = options.cp * options.ep
    advice = "lower --seqlen, --batch or --new-tokens, or pick a smaller --preset"
    per_rank = memory_estimate(options, config, options.cp, options.ep, options.rows)
    ranks = 1 if device_type == "cuda" else world  # local ranks share this machine's memory; GPUs have their own
    mesh = {name: ranks * value for name, value in per_rank.items()} | {"processes": ranks * PROCESS_OVERHEAD_BYTES}
    require_memory(f"the {world}-rank job" if ranks > 1 else "each rank", mesh, advice=advice,
                   available=_available(device_type))
    if options.check:
        single = memory_estimate(options, config, 1, 1, options.rows) | {"processes": PROCESS_OVERHEAD_BYTES}
        require_memory("the single-process check", single, advice=advice + " (or pass --no-check)",
                       available=_available(device_type))


def _available(device_type: str) -> int:
    return available_memory_bytes(device_type)


def _prompt(options: CheckOptions, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (options.rows, options.seqlen), generator=torch.Generator().manual_seed(options.seed))


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _build(options: CheckOptions, mesh, device):
    if options.checkpoint:
        return load_checkpoint(options.checkpoint, mesh, options.layout, capacity_factor=options.capacity_factor,
                               overlap_chunks=options.overlap_chunks).to(device)
    model = MoETransformer(_config(options), mesh, options.layout)
    model.init_weights(options.seed)
    return model.to(device)


def check_rank(rank: int, world: int, options: CheckOptions, progress=None) -> dict:
    """One rank of the demo (the process group is up, world = cp * ep); returns its report."""

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = make_mesh(options.cp, options.ep, device.type)
    model = _build(options, mesh, device)
    prompt = _prompt(options, model.config.vocab_size).to(device)
    report = (lambda phase, done, total: progress.put((phase, done, total))) if progress is not None and rank == 0 else None
    out = generate(model, prompt, options.new_tokens, return_logits=True, progress=report)  # collective: all ranks
    ring = out.ring.totals("forward")
    per_expert = sum(s.tokens_per_expert for s in out.moe)
    return {
        "rank": rank, "cp_rank": mesh.cp_rank, "ep_rank": mesh.ep_rank,
        "prefill_s": out.prefill_s, "decode_s": out.decode_s, "peak_rss_mib": _peak_rss_mib(),
        "attention_compute_s": ring["compute_s"], "exposed_comm": ring["exposed_comm_fraction"],
        "ring_bytes": ring["bytes_sent"],
        "tokens_per_expert": per_expert.tolist(),
        "expert_rows_computed": sum(int(s.tokens_per_rank[mesh.ep_rank]) for s in out.moe) if options.ep > 1
        else int(per_expert.sum()),
        "dropped_tokens": sum(s.dropped_tokens for s in out.moe),
        "tokens": out.tokens.tolist(),
        "logits": out.logits.tolist() if rank == 0 else None,
    }


def _reference_rank(rank: int, world: int, options: CheckOptions, progress=None) -> dict:
    """The same job on one process (no mesh): the exactness baseline."""
    single = dataclasses.replace(options, cp=1, ep=1, batch=options.rows)
    result = check_rank(rank, world, single, progress)
    return {key: result[key] for key in ("prefill_s", "decode_s", "peak_rss_mib", "tokens", "logits")}


def _with_progress(console, title: str, fn, world: int, options: CheckOptions, threads: int) -> list[dict]:
    """spawn(fn, world, ...) while a rich progress bar follows rank 0's prefill layers and decode steps."""

    updates = mp.get_context("fork").Queue()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        tasks = {"prefill": bar.add_task(f"{title}: prefill layers", total=None),
                 "decode": bar.add_task(f"{title}: decode tokens", total=None)}

        def refresh():
            while True:
                try:
                    phase, done, total = updates.get_nowait()
                except queue.Empty:
                    return
                bar.update(tasks[phase], completed=done, total=total)

        try:
            return spawn(fn, world, options, updates, threads_per_rank=threads, timeout=None,
                         stall_timeout=options.watchdog or None, on_poll=refresh)
        finally:
            updates.close()
            updates.cancel_join_thread()


def _compare(ranks: list[dict], reference: dict) -> tuple[bool, float]:
    """(every rank's tokens equal the reference's, max |logit difference| on rank 0)."""
    tokens_ok = all(r["tokens"] == reference["tokens"] for r in ranks)
    err = (torch.tensor(ranks[0]["logits"]) - torch.tensor(reference["logits"])).abs().max().item()
    return tokens_ok, err


def print_report(console, options: CheckOptions, config, ranks: list[dict], reference: dict | None) -> bool:
    console.width = max(console.width, 110)  # the table's columns, unwrapped

    world = options.cp * options.ep
    prompt_tokens = options.rows * options.seqlen
    table = Table(title=f"{world} ranks (cp={options.cp} x ep={options.ep}, {options.layout}), "
                        f"{options.rows} x {options.seqlen} prompt tokens, {options.new_tokens} new tokens each, "
                        f"EP overlap_chunks={options.overlap_chunks}")
    for col in ("rank", "cp,ep", "prefill s", "decode s", "RSS MiB", "attn s", "exposed", "expert rows", "dropped"):
        table.add_column(col, justify="right")
    for r in ranks:
        table.add_row(str(r["rank"]), f"{r['cp_rank']},{r['ep_rank']}", f"{r['prefill_s']:.2f}",
                      f"{r['decode_s']:.2f}", f"{r['peak_rss_mib']:.0f}", f"{r['attention_compute_s']:.2f}",
                      f"{r['exposed_comm']:.1%}", str(r["expert_rows_computed"]), str(r["dropped_tokens"]))
    console.print(table)
    prefill = max(r["prefill_s"] for r in ranks)
    decode = max(r["decode_s"] for r in ranks)
    decoded = options.rows * (options.new_tokens - 1)
    attention = [r["attention_compute_s"] for r in ranks]
    per_expert = torch.tensor([r["tokens_per_expert"] for r in ranks if r["ep_rank"] == 0]).sum(0)
    lines = [
        f"model: {config.arch}, {config.num_layers} layers, hidden {config.hidden_size}, {config.num_experts} experts "
        f"top-{config.top_k}, {config.num_params / 1e6:.1f}M parameters",
        f"prefill: {prefill:.2f} s, {prompt_tokens / prefill:,.0f} tokens/s; decode: {decode:.2f} s, "
        f"{decoded / decode:,.1f} tokens/s" if decode > 0 else f"prefill: {prefill:.2f} s",
        f"attention work imbalance over ranks (max/mean compute): {max(attention) / (sum(attention) / world):.3f}"
        if options.cp > 1 else "attention: one cp rank (no ring)",
        f"exposed ring communication: {max(r['exposed_comm'] for r in ranks):.1%} (worst rank)",
        f"tokens per expert (prefill, all layers): {per_expert.tolist()}, max/mean "
        f"{(per_expert.max() / per_expert.float().mean()).item():.2f}",
        f"dropped tokens: {sum(r['dropped_tokens'] for r in ranks)}",
    ]
    ok = True
    if reference is not None:
        tokens_ok, err = _compare(ranks, reference)
        ok = tokens_ok and err < 1e-3
        lines.append(f"single process: prefill {reference['prefill_s']:.2f} s, decode {reference['decode_s']:.2f} s, "
                     f"peak RSS {reference['peak_rss_mib']:.0f} MiB")
        lines.append(f"exactness vs single process: tokens {'equal' if tokens_ok else 'DIFFER'}, "
                     f"max |logit diff| {err:.1e}: {'[green]PASS' if ok else '[red]FAIL'}")
    else:
        lines.append("exactness check skipped (--no-check, or torchrun: run locally with --check to compare)")
    for line in lines:
        console.print(line)
    return ok


def _estimate_line(options: CheckOptions, config) -> str:
    per_rank = memory_estimate(options, config, options.cp, options.ep, options.rows)
    return (f"{gib(sum(per_rank.values()))} per rank ("
            + ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in per_rank.items()) + ")")


def run_check(options: CheckOptions, threads_per_rank: int = 1) -> bool:
    """Spawn the mesh locally, run the single-process check, print the report; True when exact."""

    validate(options)
    console = Console()
    config = _config(options)
    console.print(f"[dim]memory estimate: {_estimate_line(options, config)}")
    world = options.cp * options.ep
    reference = None
    if options.check:
        reference = _with_progress(console, "single process", _reference_rank, 1, options,
                                   threads=max(1, torch.get_num_threads()))[0]
    ranks = _with_progress(console, f"{world} ranks", check_rank, world, options, threads=threads_per_rank)
    return print_report(console, options, config, ranks, reference)


def run_check_torchrun(options: CheckOptions) -> bool:
    """This process is one rank under torchrun (NCCL on GPUs); rank 0 prints the report."""

    validate(options, "cuda" if torch.cuda.is_available() else "cpu")
    rank, world = join_torchrun(options.cp, options.ep)
    try:
        result = check_rank(rank, world, options)
        results = [None] * world if rank == 0 else None
        dist.gather_object(result, results, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return True
    return print_report(Console(), options, _config(options), results, None)
