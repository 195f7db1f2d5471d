"""The engine core: the step loop in a process of its own (rank 0's on a mesh), fed by front ends over ZMQ.

One ROUTER socket (an ipc path in a folder only this user can open) carries every front end's requests in
and its outputs out (``wire.py``).  The loop takes whatever messages arrived (waiting on the socket only when
no request is unfinished), steps, and sends each front end one message per step: its requests' outputs
and the step's statistics (every front end gets the statistics, so each one's /metrics has the engine's).
No tokenization, template or HTTP work happens here: only admission, the step, sampling and the output text
(the detokenizer and stop strings run with sampling: a stop string ends the request in the same step).

A request the engine refuses gets a ``refused`` message; a step that fails sends ``failed`` to every front
end and the error leaves ``run`` (the process then exits non-zero and the supervisor ends the server).
SIGTERM (from the supervisor, once every front end has drained) ends the loop between steps.  ``frontends``:
how many front ends will connect; once they have, the socket's path is removed from the disk.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import signal
from collections import defaultdict
from pathlib import Path

from .engine import Engine
from .engine_client import EngineInfo, EngineLoad
from .request import RequestOutput
from .structured import GrammarBackend, GrammarSpec
from .wire import decode, encode, info_to_wire, load_to_wire, output_to_wire, params_from_wire, stats_to_wire

__all__ = ["EngineCore"]

log = logging.getLogger("ringmoe.serve")

_IDLE_POLL_MS = 50  # an idle loop looks for messages (and SIGTERM's flag) this often


class EngineCore:
    def __init__(self, engine: Engine, address: str, any_whitespace: bool = False, frontends: int | None = None):
        import zmq

        self.engine, self.any_whitespace = engine, any_whitespace
        self.info = EngineInfo.of(engine)
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.ROUTER)
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
            self.socket.setsockopt(option, value)
        self.socket.bind(address)
        self.expected_frontends, self.address = frontends, address
        self.frontends: list[bytes] = []  # identities, in the order they said hello
        self.owner: dict[str, bytes] = {}  # request id -> the front end that sent it
        self.open_samples: dict[str, int] = {}
        self.grammars: GrammarBackend | None = None
        if engine.tokenizer is not None and importlib.util.find_spec("xgrammar") is not None:
            # now, not at the first grammar: importing xgrammar (~1-2 s) would stall every request (a tokenizer it
            # cannot serve is refused per request, as before)
            with contextlib.suppress(ValueError, ImportError):
                self._backend()
        self.stopping = False

    def stop_on_sigterm(self) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "stopping", True))

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()

    def run(self) -> None:
        """Serve until ``stopping``; a failed step is reported to every front end, then raised."""
        engine = self.engine
        while not self.stopping:
            self._receive(0 if engine.has_unfinished else _IDLE_POLL_MS)
            if not engine.has_unfinished:
                continue
            try:
                outputs = engine.step()
            except BaseException as error:
                for identity in self.frontends:
                    self.socket.send_multipart([identity, b"failed", encode(f"{type(error).__name__}: {error}")])
                raise
            self._publish(outputs)

    # -- messages in ------------------------------------------------------------------------------
    def _receive(self, wait_ms: int) -> None:
        import zmq

        if wait_ms and not self.socket.poll(wait_ms):
            return
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._take(frames)
            except Exception as error:  # a malformed message harms only itself
                log.error("engine core: a message was dropped: %r", error)

    def _take(self, frames: list[bytes]) -> None:
        identity, kind = frames[0], frames[1]
        if kind == b"hello":
            if identity not in self.frontends:
                self.frontends.append(identity)
                if len(self.frontends) == self.expected_frontends:
                    self._unlink()
            self.socket.send_multipart([identity, b"info", encode(info_to_wire(self.info))])
        elif kind == b"add":
            self._add(identity, *decode(frames[2]))
        elif kind == b"abort":
            request_id = decode(frames[2])
            self.engine.abort(request_id)
            self.owner.pop(request_id, None)
            self.open_samples.pop(request_id, None)
        elif kind == b"status":
            token = decode(frames[2])
            self.socket.send_multipart([identity, b"status", encode([token, load_to_wire(EngineLoad.of(self.engine))])])

    def _add(self, identity: bytes, request_id: str, prompt_ids: list[int], params) -> None:
        try:
            params = params_from_wire(params, self._load_grammar)
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except Exception as error:  # this request is refused; the engine goes on
            message = str(error) if isinstance(error, (ValueError, TypeError)) else \
                f"the request could not be admitted: {error}"
            self.socket.send_multipart([identity, b"refused", encode([request_id, message])])
            return
        self.owner[request_id], self.open_samples[request_id] = identity, params.n

    def _load_grammar(self, spec: GrammarSpec, compiled: str):
        return self._backend().load(spec, compiled)

    def _backend(self) -> GrammarBackend:
        if self.grammars is None:
            engine = self.engine
            self.grammars = GrammarBackend(engine.tokenizer, self.info.vocab_size, engine.eos_ids,
                                           any_whitespace=self.any_whitespace)
        return self.grammars

    def _unlink(self) -> None:
        """Every front end is connected: remove the socket's path (and its folder), so nothing else can connect
        and nothing is left on disk however the server ends."""
        if self.address.startswith("ipc://"):
            path = Path(self.address.removeprefix("ipc://"))
            with contextlib.suppress(OSError):
                path.unlink()
                path.parent.rmdir()

    # -- messages out -----------------------------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        mine: dict[bytes, list] = defaultdict(list)
        for out in outputs:
            identity = self.owner.get(out.group_id)
            if identity is None:
                continue  # aborted meanwhile
            mine[identity].append(output_to_wire(out))
            if out.finished:
                self.open_samples[out.group_id] -= 1
                if self.open_samples[out.group_id] <= 0:
                    del self.open_samples[out.group_id], self.owner[out.group_id]
        stats = encode(stats_to_wire(self.engine.last_stats))
        for identity in self.frontends:
            self.socket.send_multipart([identity, b"step", encode(mine.get(identity, [])), stats])
