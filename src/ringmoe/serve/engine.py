"""The serving engine: requests in, tokens and text out, continuous batching over a paged KV cache.

    engine = Engine(load_checkpoint(path), tokenizer=Tokenizer(path), kv_cache_tokens=65536)
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=32, temperature=0.8, seed=1))
    while engine.has_unfinished:
        for out in engine.step():       # RequestOutput per request that advanced this step
            print(out.text_delta, end="")

Each ``step`` schedules (running requests first, then waiting prompts in chunks, under one token
budget), runs one packed model step, samples a token for every request whose known tokens are all
computed, and applies the stop rules (EOS, stop ids, stop strings, max_tokens).  ``generate`` does
the same loop for an offline batch.

On a cp x ep mesh every rank builds the Engine; rank 0 is the driver (it takes requests, schedules
and samples) and every other rank calls ``run_worker()``.  Each ep group (the ranks with one
ep_rank) is a data-parallel replica for attention with its own requests and KV cache; new requests
go to the least-loaded group.  Each step the driver broadcasts the plan, every rank runs its group's
items (an empty batch if it has none: it still joins the MoE all-to-all), and the ranks send the
last hidden states of the requests due a token back to the driver.  Under cp > 1 a prompt is
prefilled whole by ring attention over its cp group and its KV stays sharded (``placement``).
``shutdown()`` on the driver releases the workers.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..batch_invariant import batch_invariant
from ..model import load_checkpoint
from ..model.transformer import MoETransformer
from ..parallel.ring import RingStats
from ..text import IncrementalDetokenizer, Tokenizer
from .kv_cache import BlockManager
from .kv_scales import kv_cache_is_fp8
from .placement import ShardedBlocks
from .request import Request, RequestOutput, Status
from .decode_graph import LOGITS, PREFILL_ROWS, HeadOutput
from .runner import ModelRunner, WorkItem
from .sampling import (NoAllowedToken, SamplingParams, TokenChoice, check_bans, next_token, plain_batch,
                       prompt_choices)
from .scheduler import Scheduler
from .mtp_drafter import MTPDrafter
from .draft_budget import GoodputBudget
from .speculative import SpeculationStats, SpeculativeConfig, can_speculate, check_finite, draw
from .structured import grammar_masks

__all__ = ["Engine", "StepStats"]

log = logging.getLogger("ringmoe.serve")


@dataclass
class StepStats:
    """What the last step did (the driver's view of the whole mesh)."""

    batch_tokens: int = 0
    num_sequences: int = 0
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    prefix_hit_tokens: int = 0
    preempted: int = 0
    step_s: float = 0.0
    tokens_per_expert: list = field(default_factory=list)
    tokens_per_ep_rank: list = field(default_factory=list)
    ring_exposed_comm: float = 0.0
    dropped_tokens: int = 0
    prefix_query_tokens: int = 0
    generated_tokens: int = 0  # new tokens the step's outputs carry (every request of every front end)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)  # this step's drafts and acceptances


class Engine:
    """Continuous batching for a ``MoETransformer`` on one process or a cp x ep mesh.

    kv_cache_tokens: KV cache size per rank in tokens, rounded up to whole blocks of ``block_size``
    (bytes: ``runner.bytes_per_token`` each); or kv_cache_bytes: a memory budget per rank, converted
    to tokens (kv_cache_tokens is then ignored).  max_num_seqs and max_num_batched_tokens apply per ep
    group.  tokenizer: a ``serve.Tokenizer`` (needed for text prompts, text output and stop strings).
    Prefix caching is used at cp = 1 (ring prefill computes whole sequences).  record_steps: keep each
    step's seconds, ring statistics and MoE statistics on every rank (``runner.history``).

    Under sliding-window attention on every layer, blocks that fall out of the window are freed.

    deterministic: a request's tokens and logprobs are bitwise the same whether it runs alone or among
    others, with any chunk size, with or without a prefix hit (same mesh and dtype).  Every matrix
    product runs on fixed row tiles (``batch_invariant``) and attention on fixed key tiles
    (``attention.paged.invariant_causal_attention``); needs dropless experts (a capacity makes a
    token's experts depend on the others).

    ``requests`` holds the unfinished requests only: a request that finishes (or is aborted) leaves the
    engine with its last output, so memory stays flat however many requests pass.  return_logits: each
    RequestOutput carries the (vocab,) float32 logits its token was drawn from (exactness checks).
    A request whose sampling fails (NaN logits, say) ends alone with finish_reason "error".
    kv_cache_dtype: "auto" (K/V cached in the model's dtype) or "fp8" / "fp8_e4m3": one byte per cached value,
    e4m3 codes with per-layer scales measured on a probe at start-up (``kv_scales.py``), decoded as attention reads
    them (MLA's latent cache too); ``runner.bytes_per_token`` counts the bytes.
    prepack_weights: on a CPU, float32, outside the deterministic mode, the projections the steps run eagerly
    (attention, experts, LM head) keep a second copy of their weights in oneDNN's blocked layout
    (``ringmoe.prepacked``): products of few rows ~2x faster, at the weights' bytes again
    (``runner.prepacked_bytes``); False packs none (copies an earlier engine made of the same weights, unchanged
    since, stay in use: they belong to the weights).
    decode_graph: how the decode-only steps run (``decode_graph.py``): "off" (the general eager step),
    "static" (padded to a bucket, fixed-shape ops, eager), "compiled" (the same under torch.compile,
    compiled here, before the first request: ``compile_seconds``).  The graph serves models with dropless
    experts (every family, MLA included; one process or a cp x ep mesh) outside the deterministic mode; other steps
    and models run eagerly.
    prefill_graph: prompt chunks run as graphs of the decode graph too (``DecodeGraph.prefill``: up to
    ``PREFILL_ROWS`` rows a call, compiled at start-up with the decode steps; one process on a CPU, not with MTP
    drafting: a GPU's graphs would record a CUDA graph per chunk length); False: they run eagerly.  Needs
    ``decode_graph`` "static" or "compiled".

    Parallel samples (``params.n > 1``): the prompt is computed once; when its first token is drawn the
    request forks into n (ids ``rid``, ``rid#1`` ... ``rid#{n-1}``, sharing the prompt's KV blocks with copy
    on write; at cp > 1 the samples recompute the prompt), each drawing from its own generator (seed + i).
    Every output carries ``group_id`` (the id add_request returned) and ``index``.  ``abort`` takes the group.
    Prompt logprobs (``params.prompt_logprobs``) come from the prefill's hidden states, chunk by chunk (no
    prefix-cache hit skips them), on the request's first output.  A grammar (``params.grammar``) masks the
    logits of its request each step; when the grammar is complete the request ends with "stop".
    """

    def __init__(self, model: MoETransformer, tokenizer=None, kv_cache_tokens: int | None = 32768, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 prefix_caching: bool = True, seed: int = 0, backend: str = "auto", record_steps: bool = False,
                 deterministic: bool = False, kv_cache_bytes: int | None = None, return_logits: bool = False,
                 decode_graph: str = "off", speculative_config=None, kv_cache_dtype: str = "auto",
                 prepack_weights: bool = True, prefill_graph: bool = False):
        if not isinstance(model, MoETransformer):
            raise TypeError(f"model must be a MoETransformer, got {type(model).__name__}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(prepack_weights, bool):
            raise TypeError(f"prepack_weights must be a bool, got {prepack_weights!r}")
        if not isinstance(prefill_graph, bool):
            raise TypeError(f"prefill_graph must be a bool, got {prefill_graph!r}")
        if prefill_graph and decode_graph == "off":
            raise ValueError("prefill_graph=True runs prompt chunks in the decode graph: needs decode_graph 'static' "
                             "or 'compiled', got 'off'")
        if kv_cache_bytes is not None:
            kv_cache_tokens = _tokens_in(kv_cache_bytes, model, kv_cache_is_fp8(kv_cache_dtype), block_size)
        if not isinstance(kv_cache_tokens, int) or isinstance(kv_cache_tokens, bool) or kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be a positive int, got {kv_cache_tokens!r}")
        if deterministic and model.config.capacity_factor is not None:
            raise ValueError("deterministic=True needs dropless experts (capacity_factor=None): under a capacity a "
                             "token's experts depend on the other tokens of the step")
        self.model, self.tokenizer, self.mesh = model, tokenizer, model.mesh
        self.deterministic, self.return_logits = deterministic, return_logits
        self._speculation(speculative_config)
        # every layer windowed (Mixtral / Qwen with sliding windows everywhere): a request's blocks wholly
        # before its window are given back as it advances (on every cp rank); one full layer keeps them all
        reach = [model.config.window(i)[0] for i in range(model.config.num_layers)]
        self.window_reach = max(reach) if all(r >= 0 for r in reach) else None
        num_blocks = -(-kv_cache_tokens // block_size)
        self.runner = ModelRunner(model, num_blocks, block_size, backend, deterministic, decode_graph, kv_cache_dtype,
                                  prepack_weights)
        self.compile_seconds = 0.0
        # with speculation a step verifies up to 1 + k tokens of every running request
        per_request = 1 + (self.speculative_config.num_speculative_tokens if self.drafter is not None else 0)
        if self.runner.decode_graph is not None:
            self.runner.decode_graph.band = per_request
            self.runner.decode_graph.mtp = self.mtp is not None  # the module's passes through graphs too
            if prefill_graph and self.mesh.size == 1 and self.mtp is None and self.runner.device.type == "cpu":
                self.runner.decode_graph.prefill_rows = min(PREFILL_ROWS, max_num_batched_tokens)
        if decode_graph == "compiled" and self.runner.decode_graph is not None and not deterministic:
            self.compile_seconds = self.runner.decode_graph.warm_up(max_num_seqs * per_request)
            log.info("decode step compiled in %.1f s", self.compile_seconds)
        self.record_steps = record_steps
        self.is_driver = self.mesh.size == 1 or dist.get_rank() == 0
        cp, ep = self.mesh.cp, self.mesh.ep

        def blocks():
            if cp == 1:
                return BlockManager(num_blocks, block_size, prefix_caching)
            return ShardedBlocks(num_blocks, block_size, cp, model.layout)

        self.groups = [Scheduler(blocks(), max_num_seqs, max_num_batched_tokens, max_model_len,
                                 chunked_prefill=cp == 1) for _ in range(ep)]
        self.blocks = self.groups[0].blocks  # one process: the block manager
        self.scheduler = self.groups[0]
        self.requests: dict[str, Request] = {}
        # an end-of-sequence id the model cannot produce (a tokenizer larger than the model) is dropped
        self.eos_ids = tuple(t for t in (tokenizer.eos_token_ids if tokenizer is not None else ())
                             if 0 <= t < model.config.vocab_size)
        self.num_preemptions = 0  # since the start, every group
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(seed)
        self._group_of: dict[str, int] = {}
        self._members: dict[str, list[str]] = {}  # group id -> its unfinished request ids (n > 1: the samples)
        self.last_stats = StepStats()
        # per rank, since the start: requests of its ep group, peak KV blocks, expert rows, ring seconds
        self.rank_report = [{"rank": r, "cp_rank": r // ep, "ep_rank": r % ep, "requests": 0, "kv_blocks_peak": 0,
                             "expert_rows": 0, "ring_compute_s": 0.0, "ring_wait_s": 0.0} for r in range(cp * ep)]

    def _speculation(self, speculative_config) -> None:
        """The drafter of the next steps' drafts: prompt lookup, or the model's MTP module (``mtp_drafter.py``, run
        after each step), and the counters of drafts and acceptances."""
        spec = self.speculative_config = SpeculativeConfig.parse(speculative_config)
        if spec is not None and spec.method == "mtp" and not self.model.config.mtp_layers:
            raise ValueError("speculative_config method 'mtp' needs a model with a multi-token prediction module "
                             "(load_checkpoint(..., mtp=True); Engine.from_checkpoint loads it for this method)")
        self.mtp = MTPDrafter(self, spec.num_speculative_tokens) if spec is not None and spec.method == "mtp" else None
        self.drafter = self.mtp if self.mtp is not None else spec.drafter() if spec is not None else None
        self.spec_stats = SpeculationStats()  # since the start
        self._step_spec = SpeculationStats()  # this step
        # draft_length "goodput": the drafts each step keeps, from the acceptance and step times measured here
        self.draft_budget = GoodputBudget() if spec is not None and spec.draft_length == "goodput" else None

    @classmethod
    def from_checkpoint(cls, path, mesh=None, dtype: torch.dtype | None = None, layout: str = "zigzag",
                        quantization: str | None = None, **options) -> "Engine":
        """The engine for a transformers checkpoint folder: weights (this rank's experts only) and, when the
        folder has a tokenizer.json, its tokenizer, chat template and end-of-sequence ids.  quantization:
        "fp8" / "mxfp4" quantizes a float checkpoint's weights once loaded (``load_checkpoint``).  With
        ``speculative_config`` method "mtp" the checkpoint's multi-token prediction layer is loaded too."""
        spec = SpeculativeConfig.parse(options.get("speculative_config"))
        options["speculative_config"] = spec
        model = load_checkpoint(path, mesh, layout, dtype=dtype, quantization=quantization,
                                mtp=spec is not None and spec.method == "mtp")
        tokenizer = Tokenizer(path) if (Path(path) / "tokenizer.json").is_file() else None
        return cls(model, tokenizer=tokenizer, **options)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text or token ids); returns its id.  ValueError on bad input, nothing queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        if (params.stop or ids is None) and self.tokenizer is None:
            raise ValueError("text prompts and stop strings need a tokenizer (Engine(..., tokenizer=...))")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {bad[:5]}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids must lie in [0, {vocab}), got {bad[:5]}")
        check_bans(params, self.eos_ids, vocab)
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab}), got {bad[:5]}")
        if params.prompt_logprobs is not None and self.mesh.cp > 1:
            raise ValueError("prompt_logprobs needs cp = 1 (a ring prefill keeps only the last position's state)")
        if not self.is_driver:
            raise RuntimeError("requests go to the driver (rank 0); other ranks call run_worker()")
        group = min(range(len(self.groups)), key=lambda g: (len(self.groups[g].running) + len(self.groups[g].waiting),
                                                            sum(r.remaining for r in self.groups[g].running)))
        self.groups[group].check_admissible(len(ids), params.max_tokens)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id must be a new string, got {request_id!r}")
        request = self._new_request(request_id, ids, params, 0)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.groups[group].add(request)
        self.requests[request_id] = request
        self._group_of[request_id] = group
        self._members[request_id] = [request_id]
        for row in self.rank_report:
            row["requests"] += row["ep_rank"] == group
        return request_id

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams, index: int,
                     group_id: str = "") -> Request:
        """Sample ``index`` of a request: its generator (seed + index when seeded), detokenizer and grammar state."""
        if params.seed is not None:
            seed = (params.seed + index + 2**63) % 2**64 - 2**63  # stays a signed 64-bit seed
        else:
            seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        request = Request(request_id, ids, params, torch.Generator().manual_seed(seed), group_id=group_id, index=index)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        if params.grammar is not None:
            request.matcher = params.grammar.matcher()
        return request

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (Engine(..., tokenizer=...))")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must hold at least one token")
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request (every sample of it) now and free its KV blocks (no-op for unknown or finished ids)."""
        for member in self._members.get(request_id, [request_id]):
            request = self.requests.get(member)
            if request is None or request.status == Status.FINISHED:
                continue
            self._finish(request, "abort")
            del self.requests[member]

    @property
    def has_unfinished(self) -> bool:
        return any(g.has_work for g in self.groups)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of the whole mesh (driver only); outputs of the requests that advanced."""
        start = time.perf_counter()
        self._step_spec = SpeculationStats()
        if self.drafter is not None:
            self._propose_drafts()
        batches = [g.schedule() for g in self.groups]
        plan = [[self._work_item(g, request, count, batch.copies) for request, count in batch.items]
                for g, batch in enumerate(batches)]
        outputs: list[RequestOutput] = []
        decode_rows = self._decode_rows(batches) if self.draft_budget is not None else 0
        reports, rank_stats = self.run_plan(plan) if any(plan) else ({}, [])
        for g, batch in enumerate(batches):
            for request, count in batch.items:
                request.num_computed += count - len(request.draft_ids)  # drafts count once accepted
                blocks = self.groups[g].blocks
                self._register_full_blocks(blocks, request)
                if self.window_reach is not None:
                    # the next query sits at num_computed and sees keys from num_computed - reach on
                    blocks.drop_before(request.request_id,
                                       max(0, request.num_computed - self.window_reach) // blocks.block_size)
        for g, batch in enumerate(batches):
            for request, count in batch.items:
                if ("all", request.request_id) in reports and request.needs_prompt_logprobs:
                    self._prompt_logprobs(request, request.num_computed - count, reports[("all", request.request_id)])
        due = [r for batch in batches for r, _ in batch.items if r.remaining == 0]
        prompt_only = [r for r in due if r.params.max_tokens == 0]
        drafted = [r for r in due if r.draft_ids]
        due = [r for r in due if r.params.max_tokens > 0 and not r.draft_ids]
        outputs = [out for r in prompt_only for out in self._prompt_only(r)]
        # a compiled step that applied the LM head itself (``decode_graph.HeadOutput``): to the rows of its items (a
        # step admitting a prompt ran the other items eagerly: ``ModelRunner.step``)
        head = reports.get(LOGITS)
        outputs += [out for r in drafted for out in self._verify(r, reports[("all", r.request_id)], head)]
        if due:
            logits, greedy = self._due_logits(due, reports, head)
            masks = grammar_masks([r.matcher for r in due], logits.shape[1])
            chosen = self._plain_rows(due, logits, masks, greedy)
            # each row's logits where a row still draws its token or the engine returns them (else no views made)
            rows = logits.unbind() if self.return_logits or len(chosen) < len(due) else [None] * len(due)
            outputs += [out for i, (r, row, mask) in enumerate(zip(due, rows, masks))
                        for out in self._advance(r, row, mask, chosen.get(i))]
        for out in outputs:  # a finished request leaves the engine: nothing of it stays behind
            if out.finished:
                self.requests.pop(out.request_id, None)
                members = self._members.get(out.group_id)
                if members is not None and out.request_id in members:
                    members.remove(out.request_id)
                    if not members:
                        del self._members[out.group_id]
        if self.mtp is not None:  # the MTP module reads what this step computed and drafts for the next one
            self.mtp.after_step(plan, reports)
        seconds = time.perf_counter() - start
        if decode_rows:
            self.draft_budget.observe_step(decode_rows, seconds)
        self.last_stats = self._stats(batches, rank_stats, seconds)
        self.last_stats.speculation = self._step_spec
        self.last_stats.generated_tokens = sum(len(out.new_token_ids) for out in outputs)
        self.num_preemptions += self.last_stats.preempted
        return outputs

    def _propose_drafts(self) -> None:
        """Drafts for every running request about to decode one token (``can_speculate``), as many as its
        max_tokens and the context limit leave after the token the step yields anyway (draft_length "goodput":
        then as many of them as raise the step's expected tokens per second, over every ep group's requests)."""
        k = self.speculative_config.num_speculative_tokens
        limit = self.speculative_config.disable_by_batch_size
        for group in self.groups:
            busy = limit is not None and len(group.running) >= limit
            for request in group.running:
                request.draft_ids = []
                if busy or request.remaining != 1 or not request.output_ids or not can_speculate(
                        request.params, len(request.output_ids)):
                    continue
                room = min(k, self.draft_room(request, self.groups.index(group)))
                if room > 0:
                    request.draft_ids = (self.mtp.propose(request, room) if self.mtp is not None
                                         else self.drafter.propose(request.all_ids, room))
        if self.draft_budget is not None:  # the drafts that raise the step's expected tokens per second
            running = [request for group in self.groups for request in group.running]
            drafted = [request for request in running if request.draft_ids]
            kept = self.draft_budget.lengths([len(r.draft_ids) for r in drafted], len(running),
                                             [r.request_id for r in drafted])
            for request, count in zip(drafted, kept):
                request.draft_ids = request.draft_ids[:count]

    @staticmethod
    def _decode_rows(batches) -> int:
        """The rows of a decode-only step (every item one generated token and its drafts); 0 for any other."""
        items = [(request, count) for batch in batches for request, count in batch.items]
        if not items or not all(count == 1 + len(request.draft_ids) and request.output_ids
                                and request.num_computed == request.num_tokens - 1 for request, count in items):
            return 0
        return sum(count for _, count in items)

    def draft_room(self, request: Request, group: int) -> int:
        """How many drafts ``request`` may carry: its max_tokens and the context limit, after the token the step
        yields anyway."""
        return min(request.params.max_tokens - len(request.output_ids) - 1,
                   self.groups[group].max_model_len - request.num_tokens - 1)

    def _verify(self, request: Request, hidden: torch.Tensor, head: HeadOutput | None = None) -> list[RequestOutput]:
        """Check ``request``'s drafts against the step's logits (hidden (1 + drafts, hidden), or the rows of ``head``
        where the compiled step applied the LM head), row by row: each row's token is drawn as decoding would draw it
        (``draw``; under a grammar, masked by the grammar's state after the rows before) and goes through the usual
        stop rules; the next row is used while the draw is the draft.  The cache keeps only accepted positions."""
        drafts, request.draft_ids = request.draft_ids, []
        logits = choices = None  # choices: per row, the graph's greedy choice, where it is the row's draw
        if head is not None and request.request_id in head.spans:  # the compiled step applied the LM head to its rows
            first, count = head.spans[request.request_id]
            logits, rows = head.logits[first:first + count], range(first, first + count)
            # a greedy request without a grammar draws each row's argmax, unless a row has none (its log-probability
            # NaN: the row holds a NaN or +inf, which the check below turns into this request's error)
            if (request.params.greedy and request.matcher is None
                    and not any(math.isnan(head.logprobs[row]) for row in rows)):
                choices = [TokenChoice(head.tokens[row], head.logprobs[row]) for row in rows]
        if choices is None:
            try:
                logits = self._head(hidden) if logits is None else logits
                check_finite(logits)
            except Exception as error:  # this request alone ends
                return [self._failed(request, error, request.emitted)]
            logprobs = torch.log_softmax(logits, dim=-1)
        outputs, accepted = [], 0
        for i in range(len(drafts) + 1):
            if choices is not None:
                choice = choices[i]
            else:
                try:
                    mask = grammar_masks([request.matcher], logits.shape[1])[0]
                    token = draw(logits[i], request.params, request.generator, mask)
                except Exception as error:
                    outputs.append(self._failed(request, error, request.emitted))
                    break
                choice = TokenChoice(token, float(logprobs[i, token]))
            token = choice.token  # (the row's logits only for an engine that returns them: an index op per row)
            outputs.append(self._sample_safely(request, logits[i] if self.return_logits else None, None, choice))
            if request.status == Status.FINISHED or i == len(drafts) or token != drafts[i]:
                break
            request.num_computed += 1  # an accepted draft: its K/V (computed this step) now count
            accepted += 1
        for stats in (self.spec_stats, self._step_spec):
            stats.record(len(drafts), accepted)
        if self.draft_budget is not None:
            self.draft_budget.observe_acceptance(  # a finished request's counts are gone with it
                len(drafts), accepted, request.request_id if request.status != Status.FINISHED else None)
        if request.status != Status.FINISHED:
            self._register_full_blocks(self.groups[self._group_of[request.request_id]].blocks, request)
        return _merged(outputs)

    @staticmethod
    def _register_full_blocks(blocks, request: Request) -> None:
        """Enter ``request``'s newly full blocks into the prefix cache; its token list (a copy of its whole
        context) is made only when a block filled since (``hashes_due``), not at every step."""
        if blocks.hashes_due(request.request_id, request.num_computed):
            blocks.register_full_blocks(request.request_id, request.all_ids, request.num_computed)

    def _work_item(self, group: int, request: Request, count: int, copies: dict) -> WorkItem:
        blocks = self.groups[group].blocks
        due = request.num_computed + count == request.num_tokens + len(request.draft_ids)
        tokens = request.ids_between(request.num_computed, request.num_computed + count)
        mtp = self.mtp is not None and self.mtp.tracks(request)  # the MTP module reads every computed position
        if isinstance(blocks, ShardedBlocks):
            kind = "ring" if request.num_computed == 0 else "decode"
            return WorkItem(request.request_id, tokens, request.num_computed, blocks.block_table(request.request_id),
                            kind, blocks.ring_len[request.request_id], due, report_all=bool(request.draft_ids) or mtp,
                            drafts=len(request.draft_ids), keep_hidden=mtp and kind == "ring")
        # deterministic mode: a lone generated token may take the fast decode kernel (its shapes never change);
        # with speculation a position is sometimes a draft row, so every row runs on the fixed tiles
        generated = count == 1 and request.num_computed >= len(request.prompt_ids) and not (
            self.deterministic and self.drafter is not None)
        report_all = request.needs_prompt_logprobs or bool(request.draft_ids) or mtp
        return WorkItem(request.request_id, tokens, request.num_computed, [blocks.block_table(request.request_id)],
                        "paged", 0, due, generated, report_all=report_all,
                        copies=copies.get(request.request_id), drafts=len(request.draft_ids))

    def run_plan(self, plan: list[list[WorkItem]], mtp: bool = False) -> tuple[dict, list[dict]]:
        """Driver: every rank runs its ep group's part of ``plan`` (the model's step, or with ``mtp`` its
        multi-token prediction module: ``ModelRunner.mtp_step``); (every reported hidden state, each rank's
        figures (none for an MTP plan))."""
        if self.mesh.size > 1:
            dist.broadcast_object_list([(plan, mtp)], src=0)
        reports, mine = self._run(plan, mtp)
        if self.mesh.size == 1:
            return reports, [mine] if mine else []
        gathered = [None] * self.mesh.size
        dist.gather_object((reports, mine), gathered, dst=0)
        return {k: v for part, _ in gathered for k, v in part.items()}, [s for _, s in gathered if s]

    def _run(self, plan: list[list[WorkItem]], mtp: bool = False) -> tuple[dict, dict]:
        """This rank's part of a plan: (reported hidden states, this rank's MoE and ring figures ({} for mtp))."""
        self.runner.ring_stats = RingStats()
        start = time.perf_counter()
        if mtp:
            reports = self.runner.mtp_step(plan[self.mesh.ep_rank], plan if self.mesh.size > 1 else None)
            return {key: value.cpu() for key, value in reports.items()} if self.mesh.size > 1 else reports, {}
        with self._invariance():
            reports = self.runner.step(plan[self.mesh.ep_rank], plan if self.mesh.size > 1 else None)
        if self.mesh.size > 1:  # they travel pickled to the driver: host memory, not this rank's GPU
            reports = {key: value.cpu() for key, value in reports.items()}
        ring = self.runner.ring_stats.totals("forward") if self.runner.ring_stats.forward else None
        if self.record_steps:
            self.runner.history.append({"seconds": time.perf_counter() - start, "ring": self.runner.ring_stats,
                                        "moe": [stats for stats in self.model.moe_stats() if stats is not None]})
        stats = {"ep_rank": self.mesh.ep_rank, "ring_exposed_comm": ring["exposed_comm_fraction"] if ring else 0.0,
                 "ring_compute_s": ring["compute_s"] if ring else 0.0, "ring_wait_s": ring["wait_s"] if ring else 0.0}
        return reports, stats | self._moe_figures()

    def _moe_figures(self) -> dict:
        """This rank's MoE figures of the step it ran: assignments per expert and per rank, tokens dropped, and the
        rows its experts computed."""
        counts = self.runner.expert_counts
        if counts is not None:  # a decode graph's step (dropless): its counts of every layer at once
            per_expert = counts.sum(0).tolist()
            figures = {"tokens_per_expert": per_expert, "tokens_per_rank": [], "dropped_tokens": 0,
                       "expert_rows": sum(per_expert)}
            if self.mesh.size > 1:  # of this rank's rows only: the driver adds every rank's (``_rows_to_experts``)
                figures |= {"expert_rows": 0, "own_rows": True}
            return figures
        moe = [stats for stats in self.model.moe_stats() if stats is not None]
        per_expert = sum(s.tokens_per_expert for s in moe).tolist() if moe else []
        by_rank = moe and moe[0].tokens_per_rank is not None
        return {"tokens_per_expert": per_expert,
                "tokens_per_rank": sum(s.tokens_per_rank for s in moe).tolist() if by_rank else [],
                "dropped_tokens": sum(s.dropped_tokens for s in moe),
                "expert_rows": sum(int(s.tokens_per_rank[self.mesh.ep_rank]) for s in moe) if by_rank
                else sum(per_expert)}

    def _invariance(self):
        return batch_invariant() if self.deterministic else contextlib.nullcontext()

    def run_worker(self) -> None:
        """On every rank but the driver: run the driver's plans until it calls ``shutdown``."""
        if self.is_driver:
            raise RuntimeError("the driver (rank 0) steps the engine; run_worker is for the other ranks")
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            reports, stats = self._run(*box[0])
            dist.gather_object((reports, stats), None, dst=0)

    def shutdown(self) -> None:
        """Driver: release the workers (their run_worker returns).  One process: nothing to do."""
        if self.is_driver and self.mesh.size > 1:
            dist.broadcast_object_list([None], src=0)

    def _due_logits(self, due: list[Request], reports: dict,
                    head: HeadOutput | None) -> tuple[torch.Tensor, list[tuple[int, float]] | None]:
        """float32 logits (len(due), vocab) of the due requests' last rows, and the graph's greedy choices where the
        graph's head has every row (else None): its head where it has a row, else the LM head on the reported hidden
        state (a step admitting a prompt ran those items eagerly)."""
        graphed = [r.request_id for r in due if head is not None and r.request_id in head.spans]
        if len(graphed) == len(due):
            return head.last_rows(graphed)
        rows = dict(zip(graphed, head.last_rows(graphed)[0])) if graphed else {}
        eager = [r.request_id for r in due if r.request_id not in rows]
        rows |= zip(eager, self._head(torch.stack([reports[request_id] for request_id in eager])))
        return torch.stack([rows[r.request_id] for r in due]), None

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits (..., vocab) of hidden states (..., hidden) an eager step reported."""
        with torch.no_grad(), self._invariance():
            return self.model.lm_head(hidden.to(self.runner.device)).float()

    @staticmethod
    def _plain_rows(due: list[Request], logits: torch.Tensor, masks: list,
                    greedy: list[tuple[int, float]] | None = None) -> dict[int, TokenChoice]:
        """The tokens of the plain rows (``SamplingParams.plain``, no grammar, nothing banned), chosen
        together: {row: choice}.  greedy: per row the (token, log-probability) a compiled step chose by argmax
        (``decode_graph.HeadOutput``): a greedy row takes it (no choice where the log-probability is NaN)."""
        rows = [i for i, (r, mask) in enumerate(zip(due, masks)) if mask is None and r.params.plain
                and r.params.n == 1 and len(r.output_ids) >= r.params.min_tokens]
        if greedy is not None:
            chosen = {i: TokenChoice(*greedy[i]) for i in rows if due[i].params.greedy and not math.isnan(greedy[i][1])}
            rows = [i for i in rows if not due[i].params.greedy]
        else:
            chosen = {}
        if not rows:
            return chosen
        choices = plain_batch(logits[rows] if len(rows) < len(due) else logits, [due[i].params for i in rows],
                              [due[i].generator for i in rows])
        return chosen | {i: c for i, c in zip(rows, choices) if c is not None}

    def _advance(self, request: Request, logits: torch.Tensor | None, mask: torch.Tensor | None,
                 choice: TokenChoice | None = None) -> list[RequestOutput]:
        """Sample ``request``'s next token (``choice`` when it was chosen already; and, at its first token under
        n > 1, fork the other samples, which draw theirs from the same logits); the outputs."""
        forks = self._fork(request) if request.params.n > 1 and request.index == 0 and not request.output_ids else []
        return [self._sample_safely(r, logits, mask, choice) for r in [request, *forks]]

    def _fork(self, parent: Request) -> list[Request]:
        """The other n - 1 samples of ``parent``'s prompt, computed as far as it (sharing its blocks)."""
        group = self._group_of[parent.request_id]
        children = []
        for index in range(1, parent.params.n):
            child = self._new_request(f"{parent.request_id}#{index}", parent.prompt_ids, parent.params, index,
                                      parent.group_id)
            child.prompt_logprobs, child.arrival = parent.prompt_logprobs, parent.arrival
            self.groups[group].add_fork(child, parent)
            self.requests[child.request_id] = child
            self._group_of[child.request_id] = group
            self._members[parent.group_id].append(child.request_id)
            children.append(child)
        return children

    def _sample_safely(self, request: Request, logits: torch.Tensor | None, mask: torch.Tensor | None,
                       choice: TokenChoice | None = None) -> RequestOutput:
        """Sample and apply the stop rules; if anything of that fails (NaN logits, a token its detokenizer
        cannot take...), the request ends alone with finish_reason "error"."""
        emitted_before = request.emitted
        try:
            return self._sample(request, logits, mask, choice)
        except Exception as error:
            return self._failed(request, error, emitted_before)

    def _failed(self, request: Request, error: Exception, emitted_before: int) -> RequestOutput:
        """``request`` ends alone with finish_reason "error" (its text so far goes out), the error's kind in OpenAI's
        terms: "invalid_request_error" where the request's own constraints left no token (``NoAllowedToken``), else
        "server_error"."""
        log.error("request %s ends with an error: %s", request.request_id, error)
        if request.status != Status.FINISHED:
            self._finish(request, "error")
        kind = "invalid_request_error" if isinstance(error, NoAllowedToken) else "server_error"
        return self._output(request, [], request.text[emitted_before:request.emitted], "error", [], error=str(error),
                            error_type=kind)

    def _output(self, request: Request, new_ids: list[int], delta: str, reason: str | None, logprobs: list,
                **extra) -> RequestOutput:
        """A RequestOutput of ``request``; its first one carries the prompt logprobs when they were asked for."""
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not request.reported_prompt:
            prompt_logprobs, request.reported_prompt = request.prompt_logprobs, True
        return RequestOutput(request.request_id, new_ids, delta, reason is not None, reason, logprobs,
                             list(request.output_ids), request.text[:request.emitted], request.timings(),
                             group_id=request.group_id, index=request.index, prompt_logprobs=prompt_logprobs,
                             **extra)

    def _prompt_logprobs(self, request: Request, start: int, hidden: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens that the rows ``hidden`` (n, hidden) at positions start ..
        start + n - 1 predict (row j predicts token start + j + 1) and that are not recorded yet."""
        first, last = len(request.prompt_logprobs), min(start + hidden.shape[0], len(request.prompt_ids) - 1)
        if first > last or first - 1 < start:
            return
        logits = self._head(hidden[first - 1 - start:last - start])
        request.prompt_logprobs += prompt_choices(logits, request.prompt_ids[first:last + 1],
                                                  request.params.prompt_logprobs)

    def _prompt_only(self, request: Request) -> list[RequestOutput]:
        """max_tokens 0: the prompt is computed (its logprobs recorded); every sample ends now with "length"."""
        self._finish(request, "length")
        outputs = [self._output(request, [], "", "length", [])]
        for index in range(1, request.params.n):
            twin = Request(f"{request.request_id}#{index}", request.prompt_ids, request.params,
                           group_id=request.group_id, index=index, prompt_logprobs=request.prompt_logprobs)
            twin.arrival, twin.finished_at = request.arrival, request.finished_at
            outputs.append(self._output(twin, [], "", "length", []))
        return outputs

    def _sample(self, request: Request, logits: torch.Tensor | None, mask: torch.Tensor | None,
                choice: TokenChoice | None = None) -> RequestOutput:
        """``request``'s token (``choice``, or drawn from logits (V,)), the stop rules, its output; logits may be
        None where ``choice`` is given and the engine returns no logits."""
        params = request.params
        if choice is None:
            banned = []
            if len(request.output_ids) < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))
            choice = next_token(logits, params, request.prompt_ids, request.output_ids, request.generator, banned,
                                mask)
        request.output_ids.append(choice.token)
        if params.logprobs is not None:
            request.logprobs.append(choice)
        if request.first_token is None:
            request.first_token = time.monotonic()
        reason, stop_string = None, False
        stop_id = choice.token in params.stop_token_ids or (not params.ignore_eos and choice.token in self.eos_ids)
        grammar_done = request.matcher is not None and request.matcher.advance(choice.token)
        if stop_id:
            reason = "stop"
        elif request.detokenizer is not None:
            request.text += request.detokenizer.add(choice.token)
            reason = self._stop_string(request)
            stop_string = reason is not None
        if reason is None and grammar_done:
            reason = "stop"
        if reason is None and len(request.output_ids) >= params.max_tokens:
            reason = "length"
        emitted_before = request.emitted
        if reason is not None:
            if request.detokenizer is not None and not (stop_id or stop_string):  # the text ends whole
                request.text += request.detokenizer.flush()
            self._finish(request, reason)
            request.emitted = len(request.text)
        else:  # hold back what could still become the start of a stop string
            hold = max((len(s) - 1 for s in params.stop), default=0)
            request.emitted = max(request.emitted, len(request.text) - hold)
        return self._output(request, [choice.token], request.text[emitted_before:request.emitted], reason,
                            [choice] if params.logprobs is not None else [],
                            logits=logits if self.return_logits else None)

    @staticmethod
    def _stop_string(request: Request) -> str | None:
        """Cut the text at the first stop string (searching only where a new one can start)."""
        stops = request.params.stop
        if not stops:
            return None
        window = max(len(s) for s in stops) + 8
        since = max(0, request.emitted - window)
        hits = [i for i in (request.text.find(s, since) for s in stops) if i >= 0]
        if not hits:
            return None
        request.text = request.text[:min(hits)]
        return "stop"

    def _finish(self, request: Request, reason: str) -> None:
        self.groups[self._group_of.pop(request.request_id)].remove(request)
        request.status, request.finish_reason = Status.FINISHED, reason
        request.finished_at = time.monotonic()
        if self.draft_budget is not None:
            self.draft_budget.forget(request.request_id)

    def _stats(self, batches, rank_stats: list[dict], seconds: float) -> StepStats:
        groups = self.groups
        if any(s.get("own_rows") for s in rank_stats):
            rank_stats = self._rows_to_experts(rank_stats)
        for row, mine in zip(self.rank_report, rank_stats if len(rank_stats) == len(self.rank_report) else []):
            blocks = groups[row["ep_rank"]].blocks
            blocks = blocks.ranks[row["cp_rank"]] if isinstance(blocks, ShardedBlocks) else blocks
            row["kv_blocks_peak"] = max(row["kv_blocks_peak"], blocks.num_blocks - blocks.num_free)
            row["expert_rows"] += mine["expert_rows"]
            row["ring_compute_s"] += mine["ring_compute_s"]
            row["ring_wait_s"] += mine["ring_wait_s"]
        ep_rank0 = [s for s in rank_stats if s["ep_rank"] == 0 and s["tokens_per_expert"]]
        per_expert = [sum(col) for col in zip(*(s["tokens_per_expert"] for s in ep_rank0))] if ep_rank0 else []
        per_rank = [sum(col) for col in zip(*(s["tokens_per_rank"] for s in ep_rank0 if s["tokens_per_rank"]))]
        return StepStats(
            batch_tokens=sum(b.num_tokens for b in batches), num_sequences=sum(len(b.items) for b in batches),
            running=sum(len(g.running) for g in groups), waiting=sum(len(g.waiting) for g in groups),
            kv_blocks_used=sum(g.blocks.num_blocks - g.blocks.num_free for g in groups),
            kv_usage=max(g.blocks.usage for g in groups), prefix_hit_tokens=sum(g.blocks.hit_tokens for g in groups),
            preempted=sum(len(b.preempted) for b in batches), step_s=seconds, tokens_per_expert=per_expert,
            tokens_per_ep_rank=per_rank,
            ring_exposed_comm=max((s["ring_exposed_comm"] for s in rank_stats), default=0.0),
            dropped_tokens=sum(s["dropped_tokens"] for s in rank_stats),
            prefix_query_tokens=sum(g.blocks.queried_tokens for g in groups),
        )

    def _rows_to_experts(self, rank_stats: list[dict]) -> list[dict]:
        """The figures of a decode graph's step on a mesh, where each rank counted its own rows' assignments per
        expert, as an eager step reports them: on every rank with ep rank 0 its ep group's counts (its rows and its
        peers'), on every rank the assignments its experts computed (``expert_rows``), per ep rank ``tokens_per_rank``
        (rank stats in rank order: rank r is cp rank r // ep, ep rank r % ep)."""
        ep = self.mesh.ep
        local = len(rank_stats[0]["tokens_per_expert"]) // ep
        mended = []
        for rank, mine in enumerate(rank_stats):
            peers = rank_stats[rank - rank % ep:rank - rank % ep + ep]  # its ep group: the same cp rank
            group = [sum(column) for column in zip(*(peer["tokens_per_expert"] for peer in peers))]
            per_rank = [sum(group[e * local:(e + 1) * local]) for e in range(ep)]
            mended.append(mine | {"tokens_per_expert": group, "tokens_per_rank": per_rank if ep > 1 else [],
                                  "expert_rows": per_rank[rank % ep]})
        return mended

    # -- offline ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run a whole batch (strings or token-id lists, any lengths); the final output of every sample, in order
        (prompt by prompt, then sample index; n > 1 gives n per prompt), each with its prompt logprobs."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params ({len(params)}) must match prompts ({len(prompts)})")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        want = [(rid, index) for rid, sp in zip(ids, params) for index in range((sp or SamplingParams()).n)]
        final: dict[tuple[str, int], RequestOutput] = {}
        prompt_logprobs: dict[str, list] = {}
        while len(final) < len(want):
            for out in self.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.group_id] = out.prompt_logprobs
                if out.finished:
                    final[(out.group_id, out.index)] = out
        for (rid, _), out in final.items():
            out.prompt_logprobs = prompt_logprobs.get(rid, out.prompt_logprobs)
        return [final[key] for key in want]


def _tokens_in(kv_cache_bytes: int, model: MoETransformer, fp8: bool, block_size: int) -> int:
    """The tokens a KV cache of ``kv_cache_bytes`` holds (every layer's K and V, or MLA's latent and RoPE key, the
    MTP modules' layers included; one byte per value for an FP8 cache); ValueError below one block."""
    if not isinstance(kv_cache_bytes, int) or isinstance(kv_cache_bytes, bool) or kv_cache_bytes < 1:
        raise ValueError(f"kv_cache_bytes must be a positive int, got {kv_cache_bytes!r}")
    per_token = model.config.kv_values_per_token * (1 if fp8 else model.embed_tokens.weight.element_size())
    tokens = kv_cache_bytes // per_token
    if tokens < block_size:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds {tokens} tokens ({per_token} bytes each): less "
                         f"than one block of {block_size}")
    return tokens


def _merged(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One request's outputs of one step (its accepted drafts and the next token) as one output."""
    if len(outputs) <= 1:
        return outputs
    last = outputs[-1]
    last.new_token_ids = [t for out in outputs for t in out.new_token_ids]
    last.text_delta = "".join(out.text_delta for out in outputs)
    last.logprobs = [c for out in outputs for c in out.logprobs]
    last.prompt_logprobs = next((out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None), None)
    return [last]
