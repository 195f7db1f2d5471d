"""The periodic throughput line a server logs while it has work (vLLM's "Avg prompt throughput ..." line).

Every ``every_s`` seconds, if requests ran since the last line: prompt and generation tokens per second over
the interval, running and waiting requests, KV-cache usage, and the prefix-cache hit rate.  It reads the
engine's counters from the event loop (plain integers: no lock, no step waits for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

__all__ = ["ThroughputLog"]

log = logging.getLogger("ringmoe.serve")


class ThroughputLog:
    def __init__(self, every_s: float, engine=None):
        self.engine, self.every_s = engine, every_s
        self.task: asyncio.Task | None = None
        self.prompt_tokens = self.generated_tokens = 0  # the server's step hook adds to these

    def on_step(self, stats, outputs) -> None:
        """Called by the engine thread after each step (``AsyncEngine(on_step=...)``)."""
        self.generated_tokens += stats.generated_tokens
        self.prompt_tokens += max(0, stats.batch_tokens - stats.num_sequences)

    def start(self, engine) -> None:
        self.engine = engine
        if self.every_s > 0:
            self.task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _loop(self) -> None:
        last, prompt, generated = time.monotonic(), self.prompt_tokens, self.generated_tokens
        while True:
            await asyncio.sleep(self.every_s)
            now = time.monotonic()
            if self.prompt_tokens == prompt and self.generated_tokens == generated:
                last = now
                continue  # idle: no line
            seconds = max(now - last, 1e-9)
            stats = self.engine.last_stats
            with contextlib.suppress(ZeroDivisionError):
                log.info("avg prompt throughput: %.1f tokens/s, avg generation throughput: %.1f tokens/s, running: %d "
                         "reqs, waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                         (self.prompt_tokens - prompt) / seconds, (self.generated_tokens - generated) / seconds,
                         stats.running, stats.waiting, 100 * stats.kv_usage,
                         100 * stats.prefix_hit_tokens / max(stats.prefix_query_tokens, 1))
            last, prompt, generated = now, self.prompt_tokens, self.generated_tokens
