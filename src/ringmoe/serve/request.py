"""One request's state: its tokens, how many are computed, how it ends.

Two counters are the single source of truth: ``num_tokens`` (prompt + generated tokens known)
and ``num_computed`` (tokens whose K/V sit in the cache).  A step computes some of the difference;
when it reaches every known token, the last position's logits give the next token.  Preemption
sets ``num_computed`` back to 0 (the blocks are freed) and the same counters drive the recompute.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, TokenChoice

__all__ = ["Request", "Status", "RequestOutput"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request (the engine's ``step`` returns a list of them)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    logprobs: list[TokenChoice] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    timings: dict = field(default_factory=dict)
    logits: torch.Tensor | None = None  # (vocab,) float32 the token came from (Engine(return_logits=True))
    error: str | None = None  # finish_reason "error": what went wrong (this request alone)
    error_type: str | None = None  # and whose fault: "invalid_request_error" (its constraints) or "server_error"
    group_id: str = ""  # the id the caller gave: parallel samples (n > 1) of one prompt share it
    index: int = 0  # which of the n samples
    prompt_logprobs: list[TokenChoice | None] | None = None  # on a request's first output, when asked for


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenChoice] = field(default_factory=list)
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    detokenizer: object | None = None
    text: str = ""
    emitted: int = 0  # characters of ``text`` already returned (held back while a stop string may form)
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    group_id: str = ""  # the caller's id; sample ``index`` of n has request_id f"{group_id}#{index}" (0: the id)
    index: int = 0
    prompt_logprobs: list[TokenChoice | None] = field(default_factory=list)  # [None, then one per prompt token]
    matcher: object | None = None  # the grammar's state (structured outputs)
    reported_prompt: bool = False  # the prompt logprobs went out with a first output
    draft_ids: list[int] = field(default_factory=list)  # speculative tokens the next step verifies (never output)
    mtp_drafts: list[int] = field(default_factory=list)  # what the MTP module proposed for the next step

    def __post_init__(self):
        self.group_id = self.group_id or self.request_id

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still missing (then no prefix-cache hit is taken)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, stop: int) -> list[int]:
        """(prompt_ids + output_ids + draft_ids)[start:stop] (0 <= start <= stop), without copying the whole
        context (a decode step asks each request for its last token and drafts)."""
        ids, offset = [], 0
        for part in (self.prompt_ids, self.output_ids, self.draft_ids):
            if start < offset + len(part) and stop > offset:
                ids += part[max(0, start - offset):stop - offset]
            offset += len(part)
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Known tokens whose K/V are not computed yet."""
        return self.num_tokens - self.num_computed

    def timings(self) -> dict:
        """Seconds: queue (arrival -> first scheduled), ttft (arrival -> first token), e2e (arrival -> end)."""
        out = {}
        if self.first_scheduled is not None:
            out["queue_s"] = self.first_scheduled - self.arrival
        if self.first_token is not None:
            out["ttft_s"] = self.first_token - self.arrival
        if self.finished_at is not None:
            out["e2e_s"] = self.finished_at - self.arrival
        return out
