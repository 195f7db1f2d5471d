"""A front end's ``EngineClient`` over the engine-core process: ZMQ (a DEALER socket) on the event loop.

Requests go out as they are submitted (the socket's queue is unbounded: a send never waits); one reader task
takes the engine core's messages (each step's outputs for this front end, refusals, status answers) and puts
every output on its request's queue.  Nothing here waits for a model step.  When the engine core fails (its
``failed`` message, or its process found gone while the socket is quiet) every open request gets
``EngineFailed`` and ``on_failure`` is called once.

``num_waiting`` is the engine's waiting count at its last step plus what this front end sent since: the
``max_waiting`` check is per front end and one step behind (the engine never refuses for it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

from ..parallel.launch import process_alive
from .engine import StepStats
from .engine_client import EngineFailed, EngineInfo, EngineLoad, OutputStreams
from .sampling import SamplingParams
from .wire import decode, encode, info_from_wire, load_from_wire, output_from_wire, params_to_wire, stats_from_wire

__all__ = ["RemoteEngine"]

log = logging.getLogger("ringmoe.serve")

_POLL_MS = 200  # how often an idle reader looks whether the engine process is still there


class RemoteEngine:
    sends_grammars = True  # a request's compiled grammar travels to the engine core serialized (``wire``)

    def __init__(self, address: str, max_waiting: int = 1024, engine_pid: int | None = None,
                 on_step: Callable | None = None,
                 on_failure: Callable[[BaseException], None] | None = None, status_timeout_s: float = 10.0):
        self.address, self.max_waiting, self.engine_pid = address, max_waiting, engine_pid
        self.on_step, self.on_failure, self.status_timeout_s = on_step, on_failure, status_timeout_s
        self.info: EngineInfo | None = None
        self.failed: BaseException | None = None
        self.last_stats = StepStats()
        self._streams = OutputStreams(threadsafe=False)
        self._sent_since_step = 0
        self._status: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._socket = self._context = self._reader = None

    # -- the connection ---------------------------------------------------------------------------
    async def ready(self) -> None:
        """Connect, announce this front end and wait for the engine's ``info`` (the engine may still be loading
        its checkpoint); EngineFailed if the engine core dies first."""
        import zmq
        import zmq.asyncio

        self._context = zmq.asyncio.Context()
        socket = self._socket = self._context.socket(zmq.DEALER)
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
            socket.setsockopt(option, value)
        socket.connect(self.address)
        await socket.send_multipart([b"hello"])
        while self.info is None:
            if await socket.poll(_POLL_MS):
                frames = await socket.recv_multipart()
                if frames[0] == b"info":
                    self.info = info_from_wire(decode(frames[1]))
            elif self._engine_gone():
                raise EngineFailed("the engine core process stopped before it was ready")
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()

    def _engine_gone(self) -> bool:
        return self.engine_pid is not None and not process_alive(self.engine_pid)

    @property
    def alive(self) -> bool:
        return self.failed is None and self.info is not None

    @property
    def num_waiting(self) -> int:
        return self.last_stats.waiting + self._sent_since_step

    # -- called from the event loop ---------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               outputs: asyncio.Queue | None = None) -> tuple[str, asyncio.Queue]:
        request_id, queue = self._streams.admit(self, params.n, outputs)
        self._send(b"add", [request_id, prompt_ids, params_to_wire(params)])
        self._sent_since_step += 1
        return request_id, queue

    def abort(self, request_id: str) -> None:
        self._streams.close(request_id)
        if self.alive:
            self._send(b"abort", request_id)

    async def status(self) -> EngineLoad:
        if not self.alive:
            raise EngineFailed(f"the engine stopped: {self.failed!r}")
        token = next(self._tokens)
        answer = self._status[token] = asyncio.get_running_loop().create_future()
        self._send(b"status", token)
        try:
            return await asyncio.wait_for(answer, self.status_timeout_s)
        finally:
            self._status.pop(token, None)

    def _send(self, kind: bytes, payload) -> None:
        sent = self._socket.send_multipart([kind, encode(payload)])
        sent.add_done_callback(_log_send_error)

    # -- the reader task --------------------------------------------------------------------------
    async def _read(self) -> None:
        socket = self._socket
        try:
            while True:
                if not await socket.poll(_POLL_MS):
                    if self._engine_gone():
                        raise EngineFailed("the engine core process stopped")
                    continue
                self._take(await socket.recv_multipart())
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._fail(error if isinstance(error, EngineFailed) else EngineFailed(f"the engine connection broke: "
                                                                                  f"{error!r}"))

    def _take(self, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind == b"step":
            outputs = [output_from_wire(values) for values in decode(frames[1])]
            self.last_stats, self._sent_since_step = stats_from_wire(decode(frames[2])), 0
            for out in outputs:
                self._streams.deliver_output(out)
            if self.on_step is not None:
                self.on_step(self.last_stats, outputs)
        elif kind == b"refused":
            request_id, message = decode(frames[1])
            self._streams.refuse(request_id, ValueError(message))
        elif kind == b"status":
            token, load = decode(frames[1])
            future = self._status.get(token)
            if future is not None and not future.done():
                future.set_result(load_from_wire(load))
        elif kind == b"failed":
            raise EngineFailed(f"the engine stopped: {decode(frames[1])}")

    def _fail(self, error: EngineFailed) -> None:
        if self.failed is not None:
            return
        self.failed = error
        self._streams.fail_all(error)
        for future in self._status.values():
            if not future.done():
                future.set_exception(error)
        if self.on_failure is not None:
            self.on_failure(error)


def _log_send_error(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a message to the engine core was not sent: %r", future.exception())
