"""Every limit the HTTP server puts on its input, in one frozen object (``ringmoe serve`` flags of the same names).

Sizes bound memory, times bound how long a client can hold a connection or a worker: a request past a
limit is answered (413 for the body, 400 naming the field otherwise) and harms nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ServerLimits"]


@dataclass(frozen=True)
class ServerLimits:
    """max_body_bytes: request body (413 past it, checked from Content-Length and while reading);
    max_messages: chat messages per request; max_stop_strings / max_stop_chars: stop strings and the
    length of each; max_stop_token_ids: stop_token_ids entries (each sampled token is looked up among them);
    header_timeout_s: a connection must send its request headers within this (slowloris);
    body_timeout_s: and its whole body within this; keep_alive_s: idle keep-alive connections close;
    limit_concurrency: connections + in-flight requests before uvicorn answers 503;
    template_timeout_s / template_workers: chat-template rendering processes and their time limit;
    tokenizer_threads: threads that tokenize prompts (the tokenizer releases the GIL);
    graceful_s: on SIGTERM in-flight requests get this long, then streams end with an error event;
    max_log_len: characters of a prompt printed per request (with log_requests); max_choices: prompts x n
    of one request; max_tools: tool definitions; max_logit_bias: logit_bias entries; grammar_timeout_s: the
    time a structured-output grammar may take to compile (400 past it); max_grammar_bytes: a compiled grammar's
    serialized size, where it travels to an engine-core process (400 past it: loading it back stalls that engine's
    steps, ~1 s per 48 MB); log_stats_s: seconds between the
    throughput lines logged while requests run (0: none)."""

    max_body_bytes: int = 8 * 2**20
    max_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    limit_concurrency: int = 4096
    template_timeout_s: float = 5.0
    template_workers: int = 2
    tokenizer_threads: int = 2
    graceful_s: float = 30.0
    log_requests: bool = False
    max_log_len: int = 120
    max_choices: int = 128
    max_tools: int = 128
    max_logit_bias: int = 1024
    grammar_timeout_s: float = 10.0
    max_grammar_bytes: int = 16 * 2**20
    log_stats_s: float = 10.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"--{field.name.replace('_', '-')} must be a bool, got {value!r}")
                continue
            positive = value > 0 if field.name not in ("max_log_len", "log_stats_s") else value >= 0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not positive:
                raise ValueError(f"--{field.name.replace('_', '-')} must be a positive number, got {value!r}")
