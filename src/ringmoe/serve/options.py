"""`ringmoe serve`'s options: validated before any process starts, and what they build (the engine, the app).

Shared by the in-process server (``service.py``) and the engine-core and front-end processes
(``multiprocess.py``).
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
from ..parallel.layout import LAYOUTS
from ..parallel.ulysses import check_heads
from ..resources import PROCESS_OVERHEAD_BYTES, require_memory
from .engine import Engine
from .kv_scales import kv_cache_is_fp8
from .limits import ServerLimits
from .metrics import ServerMetrics
from .server import build_app
from .speculative import SpeculativeConfig
from .stats_log import ThroughputLog

__all__ = ["ServeOptions", "validate", "check_fits", "build_engine", "build_frontend", "banner", "step_observers",
           "DTYPES"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ENGINE_CORES = ("process", "thread")
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
    prepack_weights: bool = True  # float32: a oneDNN copy of the weights for the eager products (ringmoe.prepacked)
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
    engine_core: str = "process"  # "process": the engine in its own process, front ends over ZMQ; "thread": here
    api_server_count: int = 1  # HTTP front-end processes sharing the port (engine_core "process")

    def threads_per_rank(self) -> int:
        """The cores shared out among the ranks; with the engine in the HTTP server's process (engine_core
        "thread") less one for the HTTP loop (busy OpenMP workers starve the event loop).  With the engine in a
        process of its own it takes every core: measured on 2 cores with ``ringmoe bench serve`` on the demo
        checkpoint, 2 engine threads beside the front-end process served one client 1.15x and four 1.3x faster
        than 1."""
        if self.threads is not None:
            return self.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        spare = 0 if self.engine_core == "process" else 1
        return max(1, (cores - spare) // (self.cp * self.ep))

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
    if options.engine_core not in ENGINE_CORES:
        raise ValueError(f"--engine-core must be one of {ENGINE_CORES}, got {options.engine_core!r}")
    if not isinstance(options.api_server_count, int) or options.api_server_count < 1:
        raise ValueError(f"--api-server-count must be a positive int, got {options.api_server_count!r}")
    if options.api_server_count > 1 and options.engine_core != "process":
        raise ValueError("--api-server-count > 1 needs --engine-core process (front ends share one engine process)")
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
    ranks share this machine's memory.  With float32 weights (not --deterministic, not --no-prepack-weights) the
    engine keeps a second, prepacked copy of its float matrices: counted too."""

    width = DTYPES[options.dtype].itemsize
    kv_width = 1 if kv_cache_is_fp8(options.kv_cache_dtype) else width
    per_token = config.kv_values_per_token
    ranks = options.cp * options.ep
    parts = {"weights": ranks * config.weight_bytes(config.num_experts // options.ep, width),
             "KV cache": ranks * options.kv_cache_tokens * per_token * kv_width,
             "processes": ranks * PROCESS_OVERHEAD_BYTES}
    if prepacks(options):
        parts["prepacked weights"] = ranks * config.prepacked_bytes(config.num_experts // options.ep, width)
    return require_memory(f"serving {Path(options.model).name} on {ranks} rank(s)", parts, available,
                          advice="lower --kv-cache-tokens, raise --ep, pick a smaller --dtype or "
                                 "--kv-cache-dtype fp8" + (", or --no-prepack-weights" if prepacks(options) else ""))


def prepacks(options: ServeOptions) -> bool:
    """Will the engine keep prepacked copies of its weights (``Engine(prepack_weights=...)``'s rule)."""
    return options.prepack_weights and options.dtype == "float32" and not options.deterministic


def build_engine(options: ServeOptions, mesh):
    """The engine the options describe, on ``mesh`` (None: one process)."""
    return Engine.from_checkpoint(
        options.model, mesh, dtype=DTYPES[options.dtype], layout=options.layout, quantization=options.quantization,
        kv_cache_tokens=options.kv_cache_tokens, kv_cache_dtype=options.kv_cache_dtype, block_size=options.block_size,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens, max_model_len=options.max_model_len,
        deterministic=options.deterministic, decode_graph="off" if options.enforce_eager else "compiled",
        prepack_weights=options.prepack_weights, prefill_graph=not options.enforce_eager,
        speculative_config=options.speculative_config,
    )



def step_observers(options: ServeOptions, engine_figures: bool = True, multiprocess_dir: str | None = None):
    """The server's metrics (``ServerMetrics``' arguments), its throughput log line, and the hook that feeds both
    after every engine step."""
    metrics = ServerMetrics(options.name, engine_figures, multiprocess_dir)
    throughput = ThroughputLog(options.limits.log_stats_s)

    def on_step(stats, outputs):
        metrics.on_step(stats, outputs)
        throughput.on_step(stats, outputs)

    return metrics, throughput, on_step


def build_frontend(options: ServeOptions, client, tokenizer, metrics: ServerMetrics, throughput: ThroughputLog):
    """The HTTP app over ``client`` (an ``EngineClient``)."""
    return build_app(client, tokenizer, options.name, metrics, options.max_tokens_default, options.limits,
                     options.api_key, options.tool_parser(), options.json_any_whitespace, options.allowed_origins,
                     throughput)


def banner(options: ServeOptions, cp: int, ep: int, how: str) -> str:
    """The line a server prints once it answers: what it serves, where, on which mesh."""
    kv = f", KV cache {options.kv_cache_dtype}" if options.kv_cache_dtype != "auto" else ""
    return f"ringmoe serve: {options.name} on http://{options.host}:{options.port} (cp={cp} x ep={ep}, " \
           f"{options.dtype}{kv}; {how})"
