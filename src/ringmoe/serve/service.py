"""`ringmoe serve`: the server on one process or on a cp x ep mesh of local ranks (or torchrun's).

By default (``--engine-core process``) the engine runs in a process of its own and the HTTP front ends in
others (``multiprocess.py``).  With ``--engine-core thread`` (and under torchrun) rank 0 runs the HTTP front
end and the engine's driver (a thread of its process); every other rank runs the step loop
(``Engine.run_worker``).  On one process (cp = ep = 1) everything then runs here.  SIGTERM drains: the
server stops accepting, finishes in-flight requests, releases the workers and exits 0 (the local
launcher forwards the signal to rank 0).  A rank that dies ends the job at once with the rank named
(exit 1): the launcher watches every rank.
"""

from __future__ import annotations

import sys

import torch

from ..parallel import make_mesh
from ..parallel.launch import join_torchrun, spawn
from .async_engine import AsyncEngine
from .multiprocess import run_engine_processes
from .options import ServeOptions, banner, build_engine, build_frontend, check_fits, step_observers, validate
from .server import serve_app

__all__ = ["ServeOptions", "run_server", "serve_rank", "validate", "check_fits"]


def _serve_driver(engine, options: ServeOptions) -> int:
    metrics, throughput, on_step = step_observers(options)
    app = None
    if engine.compile_seconds:
        print(f"ringmoe serve: decode step compiled in {engine.compile_seconds:.1f} s", file=sys.stderr, flush=True)

    def failed(error):  # the engine thread died (a collective broke): stop serving, exit non-zero
        print(f"ringmoe serve: the engine stopped: {error}", file=sys.stderr, flush=True)
        app.state.exit_code = 1
        app.state.server.should_exit = True

    async_engine = AsyncEngine(engine, options.max_waiting, on_step=on_step, on_failure=failed).start()
    app = build_frontend(options, async_engine, engine.tokenizer, metrics, throughput)

    def started():
        print(banner(options, engine.mesh.cp, engine.mesh.ep, "engine in the server's process"), flush=True)

    try:
        code = serve_app(app, options.host, options.port, options.limits, on_started=started)
    finally:
        async_engine.stop()
        async_engine.shutdown_mesh()
    return code


def serve_rank(rank: int, world: int, options: ServeOptions) -> int:
    """One rank of a mesh server (the process group is up)."""

    engine = build_engine(options, make_mesh(options.cp, options.ep, ulysses=options.ulysses))
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

        if options.api_server_count > 1:
            raise ValueError("--api-server-count > 1 needs --launcher spawn (under torchrun each rank is one process)")
        rank, size = join_torchrun(options.cp, options.ep, options.ulysses)
        try:
            return serve_rank(rank, size, options)
        finally:
            dist.destroy_process_group()
    if options.engine_core == "process":
        return run_engine_processes(options)
    if world == 1:
        torch.set_num_threads(options.threads_per_rank())
        return _serve_driver(build_engine(options, None), options)

    codes = spawn(serve_rank, world, options, timeout=None, forward_sigterm_to=0,
                  threads_per_rank=options.threads_per_rank())
    return max(codes)
