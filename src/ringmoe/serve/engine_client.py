"""The contract between the HTTP front end and the engine it talks to, and what both implementations share.

The front end (``server.py``) sees an ``EngineClient``: ``submit`` a validated request and read its
``RequestOutput``s from an asyncio queue, ``abort`` it, ask ``status()``, read ``info`` (the engine's fixed
facts: vocabulary, context, end-of-sequence ids) and ``last_stats``.  Two implementations:
``AsyncEngine`` (the engine stepped by a thread of this process) and ``RemoteEngine`` (an engine-core process
reached over ZMQ, ``engine_core.py``).  ``OutputStreams`` routes outputs to the callers' queues for both.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from .engine import StepStats
from .sampling import SamplingParams
from .scheduler import admission_error

__all__ = ["EngineClient", "EngineInfo", "EngineFailed", "QueueFull", "OutputStreams", "EngineLoad"]


class EngineFailed(RuntimeError):
    """The engine stopped on an error; no request can be served."""


class QueueFull(RuntimeError):
    """More requests are waiting than the server accepts (``max_waiting``)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs to know of the engine, fixed once it is built.  capacity: tokens of KV cache of
    one ep group (per cp rank group); eos_ids: the end-of-sequence ids that can end a request."""

    vocab_size: int
    max_model_len: int
    capacity: int
    eos_ids: tuple[int, ...]
    block_size: int
    cp: int
    ep: int
    compile_seconds: float = 0.0

    @property
    def context(self) -> int:
        return min(self.max_model_len, self.capacity)

    def check_admissible(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError for a request the engine could never run (before it is sent)."""
        message = admission_error(prompt_len, max_tokens, self.max_model_len, self.capacity)
        if message is not None:
            raise ValueError(message)

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        scheduler = engine.groups[0]
        return cls(engine.model.config.vocab_size, scheduler.max_model_len, scheduler.capacity, tuple(engine.eos_ids),
                   engine.runner.block_size, engine.mesh.cp, engine.mesh.ep, engine.compile_seconds)


@dataclass
class EngineLoad:
    """The engine's state now: requests running and waiting, KV usage (worst ep group), and per rank since the
    start: requests of its ep group, peak KV blocks, expert rows, ring seconds."""

    running: int
    waiting: int
    kv_usage: float
    ranks: list[dict]

    @classmethod
    def of(cls, engine) -> "EngineLoad":
        groups = engine.groups
        return cls(sum(len(g.running) for g in groups), sum(len(g.waiting) for g in groups),
                   max(g.blocks.usage for g in groups), [dict(row) for row in engine.rank_report])


class EngineClient(Protocol):
    info: EngineInfo
    failed: BaseException | None
    last_stats: StepStats

    async def ready(self) -> None:
        """Return once the engine can take requests (``info`` is then set)."""

    @property
    def alive(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               outputs: asyncio.Queue | None = None) -> tuple[str, asyncio.Queue]:
        """Queue a validated request (from the event loop); its id and the queue its outputs (every sample,
        tagged by group_id and index) or its error arrive on.  Raises QueueFull or EngineFailed."""

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away) and free its KV."""

    async def status(self) -> EngineLoad: ...


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    open_samples: int = 1  # samples (n) not finished yet


class OutputStreams:
    """Each open request's asyncio queue; safe to deliver from another thread (``threadsafe=True``)."""

    def __init__(self, threadsafe: bool):
        self.threadsafe = threadsafe
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def admit(self, client, samples: int, outputs: asyncio.Queue | None) -> tuple[str, asyncio.Queue]:
        """A new request id and its open queue, if ``client`` can take one more request: EngineFailed once it has
        stopped, QueueFull with ``max_waiting`` requests waiting."""
        if not client.alive:
            raise EngineFailed(f"the engine stopped: {client.failed!r}")
        if client.num_waiting >= client.max_waiting:
            raise QueueFull(f"{client.num_waiting} requests are waiting (max_waiting={client.max_waiting})")
        request_id = uuid.uuid4().hex
        return request_id, self.open(request_id, samples, outputs)

    def open(self, request_id: str, samples: int, outputs: asyncio.Queue | None) -> asyncio.Queue:
        stream = _Stream(asyncio.get_running_loop(), outputs if outputs is not None else asyncio.Queue(),
                         time.monotonic(), samples)
        self._streams[request_id] = stream
        return stream.queue

    def deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if self.threadsafe:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        else:
            stream.queue.put_nowait(item)

    def deliver_output(self, out) -> None:
        """A RequestOutput to its request's queue; the stream closes with the last sample's last output."""
        self.deliver(out.group_id, out)
        if out.finished:
            stream = self._streams.get(out.group_id)
            if stream is not None:
                stream.open_samples -= 1
                if stream.open_samples <= 0:
                    del self._streams[out.group_id]

    def refuse(self, request_id: str, error: Exception) -> None:
        """The request was not admitted: its caller gets ``error`` and the stream closes."""
        self.deliver(request_id, error)
        self._streams.pop(request_id, None)

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self.deliver(request_id, error)
        self._streams.clear()
