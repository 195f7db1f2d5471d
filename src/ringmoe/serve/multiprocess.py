"""`ringmoe serve --engine-core process`: the engine in one process, N HTTP front ends in others.

Processes (forked where the platform can, else spawned; each dies with its parent):

- the supervisor (the command's own process) binds the HTTP port once, starts the rest, and watches them;
- the engine process: the engine core loop (``engine_core.py``) on one rank, or, on a cp x ep mesh, the
  launcher of the ranks (``parallel.launch.spawn``), rank 0 running the engine core;
- ``--api-server-count`` front ends: FastAPI + uvicorn on the shared listening socket (the kernel spreads the
  connections), each with its own tokenizer threads, chat-template workers, grammar compiler, response
  building (SSE) and metrics; an ``EngineClient`` over ZMQ (``remote_engine.py``) in place of the engine.

Failure and shutdown: the engine process dying ends the server (every open request gets an error, the
supervisor names the exit code or signal and exits 1); a front end dying stops the engine and the others
(exit 1).  SIGTERM / SIGINT drain: the front ends stop accepting and finish their requests (the grace period
of ``--graceful-s``), then the engine stops; exit 0.  A second signal stops everything at once.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch

from ..parallel import make_mesh
from ..parallel.launch import die_with_parent, name_process, spawn
from ..text.tokenizer import Tokenizer
from .engine_core import EngineCore
from .options import ServeOptions, banner, build_engine, build_frontend, step_observers
from .remote_engine import RemoteEngine
from .server import serve_app

__all__ = ["run_engine_processes"]

_POLL_S = 0.2
_FRONTEND_EXIT_S = 10.0  # front ends given this long to answer their open requests once the engine is gone


def run_engine_processes(options: ServeOptions) -> int:
    """Serve with the engine and the front ends in processes of their own (options validated); the exit code."""
    import uvicorn

    # fork: the children start at once, with this process's imports (it has run no torch op and started no
    # thread: nothing that forking could break); spawn where fork does not exist
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    folder = tempfile.mkdtemp(prefix="ringmoe-serve-")  # mode 0700: only this user reaches the engine's socket
    address = f"ipc://{folder}/engine"
    listener = uvicorn.Config(None, host=options.host, port=options.port, log_level="warning").bind_socket()
    me = os.getpid()
    engine = context.Process(target=_engine_main, args=(options, address, me), name="ringmoe-engine")
    frontends = []
    # several front ends: prometheus_client's multiprocess mode sums their figures (kept in files there)
    metrics = tempfile.mkdtemp(prefix="ringmoe-metrics-") if options.api_server_count > 1 else None
    signals = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: signals.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        engine.start()
        for index in range(options.api_server_count):
            frontends.append(context.Process(target=_frontend_main, name=f"ringmoe-api-{index}",
                                             args=(options, address, listener, index, engine.pid, me, metrics)))
            frontends[-1].start()
        listener.close()  # the front ends hold their own descriptors of it
        return _watch(engine, frontends, signals)
    finally:
        for process in [*frontends, engine]:
            _stop(process, signal.SIGKILL, 0)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        shutil.rmtree(folder, ignore_errors=True)
        if metrics is not None:
            shutil.rmtree(metrics, ignore_errors=True)


def _watch(engine, frontends: list, signals: list) -> int:
    draining = False
    while True:
        if signals and not draining:  # drain: the front ends finish what they have, then the engine stops
            draining = True
            for frontend in frontends:
                _signal(frontend, signal.SIGTERM)
        if len(signals) > 1:
            print("ringmoe serve: stopping at once (second signal)", file=sys.stderr, flush=True)
            return 1
        running = [p.sentinel for p in [engine, *frontends] if p.exitcode is None]
        multiprocessing.connection.wait(running, timeout=_POLL_S)
        if engine.exitcode is not None:
            print(f"ringmoe serve: the engine core process {_ended(engine.exitcode)}: stopping the server",
                  file=sys.stderr, flush=True)
            for frontend in frontends:
                _stop(frontend, signal.SIGTERM, _FRONTEND_EXIT_S)
            return 1
        ended = [(index, p) for index, p in enumerate(frontends) if p.exitcode is not None]
        if ended and not draining:
            index, frontend = ended[0]
            print(f"ringmoe serve: API server {index} {_ended(frontend.exitcode)}: stopping the server",
                  file=sys.stderr, flush=True)
            for other in frontends:
                _stop(other, signal.SIGTERM, _FRONTEND_EXIT_S)
            _stop(engine, signal.SIGTERM, 30)
            return 1
        if draining and len(ended) == len(frontends):
            _stop(engine, signal.SIGTERM, 60)
            codes = [p.exitcode for p in [engine, *frontends]]
            return 0 if all(code == 0 for code in codes) else 1


def _ended(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _signal(process, sig) -> None:
    if process.exitcode is None and process.pid is not None:
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            pass


def _stop(process, sig, wait_s: float) -> None:
    """Send ``sig`` and wait up to ``wait_s``; SIGKILL what is still there."""
    if process.pid is None:
        return
    _signal(process, sig)
    process.join(wait_s)
    if process.exitcode is None:
        _signal(process, signal.SIGKILL)
        process.join(5)


# -- the engine process ---------------------------------------------------------------------------
def _engine_main(options: ServeOptions, address: str, parent: int) -> None:
    die_with_parent(parent)
    name_process("ringmoe-engine")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the supervisor's handler (a forked child inherits it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides what a Ctrl-C does
    world = options.cp * options.ep
    try:
        if world == 1:
            torch.set_num_threads(options.threads_per_rank())
            _serve_core(build_engine(options, None), options, address)
        else:
            spawn(_core_rank, world, options, address, timeout=None, forward_sigterm_to=0,
                  threads_per_rank=options.threads_per_rank())
    except BaseException as error:
        print(f"ringmoe serve: the engine stopped: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


def _core_rank(rank: int, world: int, options: ServeOptions, address: str) -> int:
    engine = build_engine(options, make_mesh(options.cp, options.ep, ulysses=options.ulysses))
    if rank == 0:
        _serve_core(engine, options, address)
    else:
        engine.run_worker()
    return 0


def _serve_core(engine, options: ServeOptions, address: str) -> None:
    if engine.compile_seconds:
        print(f"ringmoe serve: decode step compiled in {engine.compile_seconds:.1f} s", file=sys.stderr, flush=True)
    core = EngineCore(engine, address, options.json_any_whitespace, frontends=options.api_server_count)
    core.stop_on_sigterm()
    try:
        core.run()
    finally:
        core.close()
    engine.shutdown()  # a mesh's workers leave their loop


# -- a front-end process --------------------------------------------------------------------------
def _frontend_main(options: ServeOptions, address: str, listener, index: int, engine_pid: int, parent: int,
                   metrics_dir: str | None) -> None:
    die_with_parent(parent)
    name_process(f"ringmoe-api-{index}")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # sampling and the model live in the engine process
    tokenizer = Tokenizer(options.model) if (Path(options.model) / "tokenizer.json").is_file() else None
    # one front end records the engine's step figures; each its own requests (summed by /metrics over them all)
    metrics, throughput, on_step = step_observers(options, engine_figures=index == 0, multiprocess_dir=metrics_dir)
    app = None

    def failed(error):  # the engine is gone: the open requests got the error; stop serving, exit non-zero
        app.state.exit_code = 1
        if getattr(app.state, "server", None) is not None:
            app.state.server.should_exit = True

    client = RemoteEngine(address, options.max_waiting, engine_pid, on_step=on_step, on_failure=failed)
    app = build_frontend(options, client, tokenizer, metrics, throughput)

    def started():
        if index == 0:
            print(banner(options, client.info.cp, client.info.ep,
                         f"engine core process, {options.api_server_count} API server(s)"), flush=True)

    try:
        code = serve_app(app, options.host, options.port, options.limits, on_started=started, sock=listener)
    finally:
        client.close()
    sys.exit(code)
