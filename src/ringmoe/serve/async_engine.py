"""The engine behind an asyncio server: one thread steps it, callers await per-request output queues.

The engine is not thread-safe, so one thread owns it: it takes new requests and aborts from
thread-safe inboxes between steps, steps while there is work (sleeping on an event otherwise), and
hands every ``RequestOutput`` to the asyncio loop of the request's caller.  The event loop never
waits for a model step.  If a step fails (a rank died, a collective broke), every open request gets
the error, ``failed`` is set (``/health`` reports it), and ``on_failure`` is called once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from typing import Callable

from .engine import Engine
from .engine_client import EngineFailed, EngineInfo, EngineLoad, OutputStreams, QueueFull
from .sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineFailed", "QueueFull"]


class AsyncEngine:
    """An ``EngineClient`` over an engine of this process, stepped by its own thread."""

    def __init__(self, engine: Engine, max_waiting: int = 1024, on_step: Callable | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine, self.max_waiting = engine, max_waiting
        self.on_step, self.on_failure = on_step, on_failure
        self.info = EngineInfo.of(engine)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()
        self._streams = OutputStreams(threadsafe=True)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending = 0  # submitted, not yet taken by the engine thread
        self._pending_lock = threading.Lock()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="ringmoe-engine", daemon=True)

    def start(self) -> "AsyncEngine":
        self.thread.start()
        return self

    async def ready(self) -> None:
        """The engine is built before this object: nothing to wait for."""

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.failed is None and self.thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._pending + sum(len(g.waiting) for g in self.engine.groups)

    @property
    def last_stats(self):
        return self.engine.last_stats

    async def status(self) -> EngineLoad:
        """Read from the event loop without a lock: counters and lengths the engine thread updates."""
        return EngineLoad.of(self.engine)

    # -- called from the event loop ------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               outputs: asyncio.Queue | None = None) -> tuple[str, asyncio.Queue]:
        """Queue a validated request; returns its id and the queue its outputs arrive on (``outputs`` when
        given: several requests may share one).  Every sample (n) of it arrives there, tagged by group_id
        (the id returned) and index."""
        request_id, queue_ = self._streams.admit(self, params.n, outputs)
        with self._pending_lock:
            self._pending += 1
        self._inbox.put((request_id, prompt_ids, params))
        self._wake.set()
        return request_id, queue_

    def abort(self, request_id: str) -> None:
        """Free a request's KV as soon as the engine thread gets to it (a client went away)."""
        self._aborts.put(request_id)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------------
    def _take_requests(self) -> None:
        engine = self.engine
        while True:
            try:
                request_id, prompt_ids, params = self._inbox.get_nowait()
            except queue.Empty:
                break
            with self._pending_lock:
                self._pending -= 1
            try:
                engine.add_request(prompt_ids, params, request_id=request_id)
            except Exception as error:  # this request is refused; the engine goes on
                self._streams.refuse(request_id, error if isinstance(error, (ValueError, TypeError))
                                     else ValueError(f"the request could not be admitted: {error}"))
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                break
            engine.abort(request_id)
            self._streams.close(request_id)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._take_requests()
                if not engine.has_unfinished:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                for out in outputs:
                    self._streams.deliver_output(out)
                if self.on_step is not None:
                    self.on_step(engine.last_stats, outputs)
        except BaseException as error:  # a rank died or a collective broke: fail every open request
            self.failed = error
            self._streams.fail_all(EngineFailed(f"the engine stopped: {error}\n{traceback.format_exc()}"))
            if self.on_failure is not None:
                self.on_failure(error)

    def shutdown_mesh(self) -> None:
        """After the thread has stopped: release the worker ranks (mesh engines)."""
        if self.failed is None:
            self.engine.shutdown()
