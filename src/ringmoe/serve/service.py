"""`ringmoe serve`: the server on one process or on a cp x ep mesh of local ranks (or torchrun's).

Rank 0 runs the HTTP front end and the engine's driver; every other rank runs the step loop
(``Engine.run_worker``).  On one process (cp = ep = 1) everything runs here.  SIGTERM drains: the
server stops accepting, finishes in-flight requests, releases the workers and exits 0 (the local
launcher forwards the signal to rank 0).  A rank that dies ends the job at once with the rank named
(exit 1): the launcher watches every rank.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..jsonio import read_json
from ..model import check_checkpoint
from ..model.quantize import requested_scheme
from ..parallel import make_mesh
from ..parallel.ulysses import check_heads
from ..parallel.launch import join_torchrun, spawn
from ..parallel.layout import LAYOUTS
from ..resources import PROCESS_OVERHEAD_BYTES, require_memory
from .async_engine import AsyncEngine
from .engine import Engine
from .kv_scales import kv_cache_is_fp8
from .limits import ServerLimits
from .metrics import ServerMetrics
from .server import build_app, serve_app
from .speculative import SpeculativeConfig
from .stats_log import ThroughputLog

__all__ = ["ServeOptions", "run_server", "serve_rank"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class ServeOptions:
    model: str
    cp: int = 1
    ep: int = 1
    ulysses: int = 1  # prompt prefill by Ulysses inside groups of this many cp ranks, the ring across (1: the ring)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int = 65536
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # "fp8" / "fp8_e4m3": e4m3 codes with per-layer scales, one byte per value
    max_model_len: int | None = None
    max_waiting: int = 1024
    max_tokens_default: int = 256
    deterministic: bool = False
    enforce_eager: bool = False  # decode steps eager too (default: the compiled decode graph where it applies)
    dtype: str = "float32"
    quantization: str | None = None  # "fp8" | "mxfp4": quantize a float checkpoint's weights once loaded
    layout: str = "zigzag"
    threads: int | None = None  # intra-op threads per rank; default: the cores less one for HTTP, shared out
    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None  # every /v1 route then needs Authorization: Bearer <api_key>
    tool_call_parser: str | None = None  # "hermes" | "deepseek_v3" | "harmony" | "none"; default: from the model type
    json_any_whitespace: bool = False  # JSON grammars may put whitespace between tokens
    allowed_origins: tuple[str, ...] = ()  # CORS (none by default)
    speculative_config: str | None = None  # JSON, vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4, ...}

    def threads_per_rank(self) -> int:
        """Rank 0 also runs the HTTP loop: leave it a core (busy OpenMP workers starve the event loop)."""
        if self.threads is not None:
            return self.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, (cores - 1) // (self.cp * self.ep))

    @property
    def name(self) -> str:
        """--served-model-name, else the checkpoint's own name: config.json's _name_or_path when it names a model,
        else the folder's name (the run folder's for a training export ``RUN/hf``)."""
        if self.served_model_name:
            return self.served_model_name
        folder = Path(self.model).resolve()
        config = folder / "config.json"
        named = read_json(config).get("_name_or_path") if config.is_file() else None
        if isinstance(named, str) and named.strip() and not Path(named).is_absolute() and named not in (".", ""):
            return named
        return folder.parent.name if folder.name == "hf" and folder.parent.name else folder.name

    def tool_parser(self) -> str | None:
        """The tool-call syntax: the flag, else DeepSeek-V3's tokens for deepseek_v3, harmony for gpt-oss, Hermes for
        the rest."""
        if self.tool_call_parser is not None:
            return None if self.tool_call_parser == "none" else self.tool_call_parser
        config = Path(self.model) / "config.json"
        model_type = read_json(config).get("model_type") if config.is_file() else None
        return {"deepseek_v3": "deepseek_v3", "gpt_oss": "harmony"}.get(model_type, "hermes")


def validate(options: ServeOptions) -> None:
    """Every option and checkpoint error before any rank starts (ValueError naming the flag or file)."""

    if options.threads is not None and (not isinstance(options.threads, int) or options.threads < 1):
        raise ValueError(f"--threads must be a positive int, got {options.threads!r}")
    for flag in ("cp", "ep", "ulysses", "max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens", "block_size",
                 "max_waiting", "max_tokens_default"):
        value = getattr(options, flag)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive int, got {value!r}")
    try:
        speculative = SpeculativeConfig.parse(options.speculative_config)
    except (ValueError, TypeError) as error:
        raise ValueError(f"--{str(error).replace('_', '-', 1)}") from None
    if options.cp % options.ulysses:
        raise ValueError(f"--ulysses-degree ({options.ulysses}) must divide --cp ({options.cp})")
    if not 0 <= options.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {options.port}")
    if options.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {options.dtype!r}")
    try:
        kv_cache_is_fp8(options.kv_cache_dtype)
    except ValueError as error:
        raise ValueError(f"--{str(error).replace('_', '-', 2)}") from None
    if options.layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {LAYOUTS}, got {options.layout!r}")
    if options.api_key is not None and not options.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if options.host not in LOOPBACK and options.api_key is None:
        print(f"ringmoe serve: warning: binding {options.host}, beyond this machine, without --api-key: anyone "
              f"who reaches the port can use the model", file=sys.stderr, flush=True)
    config = check_checkpoint(options.model)
    try:
        requested_scheme(config, options.quantization)
    except ValueError as error:
        raise ValueError(f"--{error}") from None
    if config.num_experts % options.ep:
        raise ValueError(f"--ep ({options.ep}) must divide the model's {config.num_experts} experts")
    try:
        check_heads(config.num_heads, config.num_heads if config.mla else config.num_kv_heads, options.ulysses)
    except ValueError as error:
        raise ValueError(f"--ulysses-degree: {error}") from None
    if options.deterministic and config.capacity_factor is not None:
        raise ValueError("--deterministic needs dropless experts")
    mtp = speculative is not None and speculative.method == "mtp"
    if mtp and not config.mtp_layers:  # check_checkpoint counts the MTP layers the files hold
        raise ValueError(f"--speculative-config method 'mtp' needs a checkpoint with a multi-token prediction layer "
                         f"(config.json's num_nextn_predict_layers); {options.model} has none")
    check_fits(options, config.replace(mtp_layers=config.mtp_layers if mtp else 0))


def check_fits(options: ServeOptions, config, available: int | None = None) -> float:
    """Refuse (ValueError, one line) a server whose local ranks cannot hold their weights and KV caches.

    Per rank: the replicated weights, its 1/ep of the experts, and ``kv_cache_tokens`` of K/V (MLA: the latent
    and RoPE key) in --dtype (one byte per value with --kv-cache-dtype fp8), plus a process's own overhead; local
    ranks share this machine's memory."""

    width = DTYPES[options.dtype].itemsize
    kv_width = 1 if kv_cache_is_fp8(options.kv_cache_dtype) else width
    per_token = config.kv_values_per_token
    ranks = options.cp * options.ep
    parts = {"weights": ranks * config.weight_bytes(config.num_experts // options.ep, width),
             "KV cache": ranks * options.kv_cache_tokens * per_token * kv_width,
             "processes": ranks * PROCESS_OVERHEAD_BYTES}
    return require_memory(f"serving {Path(options.model).name} on {ranks} rank(s)", parts, available,
                          advice="lower --kv-cache-tokens, raise --ep, pick a smaller --dtype or "
                                 "--kv-cache-dtype fp8")


def _build_engine(options: ServeOptions, mesh):
    return Engine.from_checkpoint(
        options.model, mesh, dtype=DTYPES[options.dtype], layout=options.layout, quantization=options.quantization,
        kv_cache_tokens=options.kv_cache_tokens, kv_cache_dtype=options.kv_cache_dtype, block_size=options.block_size,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens, max_model_len=options.max_model_len,
        deterministic=options.deterministic, decode_graph="off" if options.enforce_eager else "compiled",
        speculative_config=options.speculative_config,
    )


def _serve_driver(engine, options: ServeOptions) -> int:
    metrics = ServerMetrics(options.name)
    app = None
    if engine.compile_seconds:
        print(f"ringmoe serve: decode step compiled in {engine.compile_seconds:.1f} s", file=sys.stderr, flush=True)

    def failed(error):  # the engine thread died (a collective broke): stop serving, exit non-zero
        print(f"ringmoe serve: the engine stopped: {error}", file=sys.stderr, flush=True)
        app.state.exit_code = 1
        app.state.server.should_exit = True

    throughput = ThroughputLog(options.limits.log_stats_s)

    def on_step(stats, outputs):
        metrics.on_step(stats, outputs)
        throughput.on_step(stats, outputs)

    async_engine = AsyncEngine(engine, options.max_waiting, on_step=on_step, on_failure=failed).start()
    app = build_app(async_engine, engine.tokenizer, options.name, metrics, options.max_tokens_default,
                    options.limits, options.api_key, options.tool_parser(),
                    options.json_any_whitespace, options.allowed_origins, throughput)

    def started():
        mesh = engine.mesh
        print(f"ringmoe serve: {options.name} on http://{options.host}:{options.port} "
              f"(cp={mesh.cp} x ep={mesh.ep}, {options.dtype}"
              f"{', KV cache ' + options.kv_cache_dtype if options.kv_cache_dtype != 'auto' else ''})", flush=True)

    try:
        code = serve_app(app, options.host, options.port, options.limits, on_started=started)
    finally:
        async_engine.stop()
        async_engine.shutdown_mesh()
    return code


def serve_rank(rank: int, world: int, options: ServeOptions) -> int:
    """One rank of a mesh server (the process group is up)."""

    engine = _build_engine(options, make_mesh(options.cp, options.ep, ulysses=options.ulysses))
    if rank == 0:
        return _serve_driver(engine, options)
    engine.run_worker()
    return 0


def run_server(options: ServeOptions, launcher: str = "spawn") -> int:
    """Validate, start the ranks (or serve here on one process); the exit code."""
    validate(options)
    world = options.cp * options.ep
    if launcher == "torchrun":
        import torch.distributed as dist

        rank, size = join_torchrun(options.cp, options.ep, options.ulysses)
        try:
            return serve_rank(rank, size, options)
        finally:
            dist.destroy_process_group()
    if world == 1:
        torch.set_num_threads(options.threads_per_rank())
        return _serve_driver(_build_engine(options, None), options)

    codes = spawn(serve_rank, world, options, timeout=None, forward_sigterm_to=0,
                  threads_per_rank=options.threads_per_rank())
    return max(codes)
