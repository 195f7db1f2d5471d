"""Prometheus metrics of the server (``prometheus_client``, one registry per server).

Names follow vLLM's (``vllm:`` becomes ``ringmoe:``) where one exists, so existing dashboards map
over; the MoE and ring figures are ringmoe's own: tokens per expert and per ep rank, the ep rank
imbalance, dropped tokens, and the exposed share of ring communication.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from .engine import StepStats
from .request import RequestOutput

__all__ = ["ServerMetrics"]

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """engine_figures: this front end records the engine's step figures (gauges, expert / ep / dropped / prefix /
    speculation counters); every front end records its own requests (latencies, finish reasons, prompt and
    generated tokens).  multiprocess_dir: a folder for prometheus_client's multiprocess mode (every front end
    keeps its values in files there): /metrics then sums every front end's figures, and exactly one front end
    takes the engine's."""

    def __init__(self, model_name: str, engine_figures: bool = True, multiprocess_dir: str | None = None):
        if multiprocess_dir is not None:
            # every value from now on lives in a file of that folder (set here, not read from the environment at
            # import: a forked front end imported prometheus_client before it knew the folder)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiprocess_dir
            values.ValueClass = values.MultiProcessValue()
        self.registry = CollectorRegistry()
        self.engine_figures, self.multiprocess_dir = engine_figures, multiprocess_dir
        r, labels = self.registry, ["model_name"]
        self.model = model_name
        self.success = Counter("ringmoe:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("ringmoe:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("ringmoe:inter_token_latency_seconds", "Time between two tokens of a request", labels,
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("ringmoe:e2e_request_latency_seconds", "Arrival to last token", labels,
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("ringmoe:request_queue_time_seconds", "Arrival to first scheduling", labels,
                               buckets=_LATENCY, registry=r)
        self.running = Gauge("ringmoe:num_requests_running", "Requests in the running batch", labels, registry=r,
                             multiprocess_mode="max")
        self.waiting = Gauge("ringmoe:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r,
                             multiprocess_mode="max")
        self.kv_usage = Gauge("ringmoe:kv_cache_usage_perc", "Fraction of KV blocks in use (worst ep group)",
                              labels, registry=r, multiprocess_mode="max")
        self.prefix_queries = Counter("ringmoe:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("ringmoe:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   labels, registry=r)
        self.prompt_tokens = Counter("ringmoe:prompt_tokens", "Prompt tokens of admitted requests", labels,
                                     registry=r)
        self.generation_tokens = Counter("ringmoe:generation_tokens", "Generated tokens", labels, registry=r)
        self.preemptions = Counter("ringmoe:num_preemptions", "Requests preempted (recomputed later)", labels,
                                   registry=r)
        self.expert_tokens = Counter("ringmoe:expert_tokens", "Token assignments computed per expert (all layers)",
                                     labels + ["expert"], registry=r)
        self.ep_rank_tokens = Counter("ringmoe:ep_rank_tokens", "Token assignments computed per ep rank",
                                      labels + ["ep_rank"], registry=r)
        self.ep_imbalance = Gauge("ringmoe:ep_rank_imbalance", "Max / mean assignments over ep ranks, last step",
                                  labels, registry=r, multiprocess_mode="max")
        self.dropped = Counter("ringmoe:dropped_tokens", "Tokens dropped by expert capacity", labels, registry=r)
        self.ring_exposed = Gauge("ringmoe:ring_exposed_comm_ratio",
                                  "Share of ring attention time blocked on K/V transfers, last ring step", labels,
                                  registry=r, multiprocess_mode="max")
        # speculative decoding, vLLM's spec_decode counters
        self.spec_drafts = Counter("ringmoe:spec_decode_num_drafts", "Requests x steps that carried drafts", labels,
                                   registry=r)
        self.spec_draft_tokens = Counter("ringmoe:spec_decode_num_draft_tokens", "Draft tokens proposed", labels,
                                         registry=r)
        self.spec_accepted = Counter("ringmoe:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels,
                                     registry=r)
        self.spec_accepted_per_pos = Counter("ringmoe:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position", labels + ["position"],
                                             registry=r)
        self._hits_seen = self._queries_seen = 0

    def on_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        if not self.engine_figures:
            return
        m = self.model
        self.generation_tokens.labels(m).inc(stats.generated_tokens)
        self.running.labels(m).set(stats.running)
        self.waiting.labels(m).set(stats.waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        if stats.preempted:
            self.preemptions.labels(m).inc(stats.preempted)
        for expert, count in enumerate(stats.tokens_per_expert):
            if count:
                self.expert_tokens.labels(m, str(expert)).inc(count)
        for rank, count in enumerate(stats.tokens_per_ep_rank):
            if count:
                self.ep_rank_tokens.labels(m, str(rank)).inc(count)
        if stats.tokens_per_ep_rank and sum(stats.tokens_per_ep_rank):
            load = stats.tokens_per_ep_rank
            self.ep_imbalance.labels(m).set(max(load) / (sum(load) / len(load)))
        if stats.dropped_tokens:
            self.dropped.labels(m).inc(stats.dropped_tokens)
        if stats.ring_exposed_comm:
            self.ring_exposed.labels(m).set(stats.ring_exposed_comm)
        hits, queries = stats.prefix_hit_tokens, stats.prefix_query_tokens
        if hits > self._hits_seen:
            self.prefix_hits.labels(m).inc(hits - self._hits_seen)
        if queries > self._queries_seen:
            self.prefix_queries.labels(m).inc(queries - self._queries_seen)
        self._hits_seen, self._queries_seen = hits, queries
        spec = stats.speculation
        if spec.num_drafts:
            self.spec_drafts.labels(m).inc(spec.num_drafts)
            self.spec_draft_tokens.labels(m).inc(spec.num_draft_tokens)
            self.spec_accepted.labels(m).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_pos.labels(m, str(position)).inc(count)

    def on_finish(self, out: RequestOutput, inter_token: list[float]) -> None:
        m = self.model
        self.success.labels(m, out.finish_reason or "unknown").inc()
        t = out.timings
        if "ttft_s" in t:
            self.ttft.labels(m).observe(t["ttft_s"])
        if "e2e_s" in t:
            self.e2e.labels(m).observe(t["e2e_s"])
        if "queue_s" in t:
            self.queue.labels(m).observe(t["queue_s"])
        for gap in inter_token:
            self.itl.labels(m).observe(gap)

    def on_admit(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)

    def refresh(self, load) -> None:
        """Set the gauges from the engine's state now (an ``EngineLoad``: it may have changed since the last
        step, by aborts)."""
        if not self.engine_figures:
            return
        m = self.model
        self.running.labels(m).set(load.running)
        self.waiting.labels(m).set(load.waiting)
        self.kv_usage.labels(m).set(load.kv_usage)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        combined = CollectorRegistry()
        MultiProcessCollector(combined, path=self.multiprocess_dir)
        return generate_latest(combined)
