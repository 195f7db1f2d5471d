"""The serving engine: requests in, tokens and text out, continuous batching over a paged KV cache.

    engine = Engine(load_checkpoint(path), tokenizer=Tokenizer(path), kv_cache_tokens=65536)
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=32, temperature=0.8, seed=1))
    while engine.has_unfinished:
        for out in engine.step():       # RequestOutput per request that advanced this step
            print(out.text_delta, end="")

Each ``step`` schedules (running requests first, then waiting prompts in chunks, under one token
budget), runs one packed model step, samples a token for every request whose known tokens are all
computed, and applies the stop rules (EOS, stop ids, stop strings, max_tokens).  ``generate`` does
the same loop for an offline batch.  This engine runs on one process (mesh 1 x 1).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from ..model.transformer import MoETransformer
from .kv_cache import BlockManager
from .request import Request, RequestOutput, Status
from .runner import ModelRunner, SequenceChunk
from .sampling import SamplingParams, next_token
from .scheduler import Scheduler

__all__ = ["Engine", "StepStats"]


@dataclass
class StepStats:
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


class Engine:
    """Continuous batching for a ``MoETransformer`` on one process.

    kv_cache_tokens: KV cache size in tokens, rounded up to whole blocks of ``block_size``
    (bytes: ``runner.bytes_per_token`` each).  tokenizer: a ``serve.Tokenizer`` (needed for text
    prompts, text output and stop strings).
    """

    def __init__(self, model: MoETransformer, tokenizer=None, kv_cache_tokens: int = 32768, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 prefix_caching: bool = True, seed: int = 0, backend: str = "auto"):
        if not isinstance(model, MoETransformer):
            raise TypeError(f"model must be a MoETransformer, got {type(model).__name__}")
        if model.mesh.size != 1:
            raise ValueError("this engine runs on one process (mesh 1 x 1); meshes are not supported yet")
        if not isinstance(kv_cache_tokens, int) or isinstance(kv_cache_tokens, bool) or kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be a positive int, got {kv_cache_tokens!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.model, self.tokenizer = model, tokenizer
        num_blocks = -(-kv_cache_tokens // block_size)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.runner = ModelRunner(model, num_blocks, block_size, backend)
        self.requests: dict[str, Request] = {}
        self.eos_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(seed)
        self.last_stats = StepStats()

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
        self.scheduler.check_admissible(len(ids), params.max_tokens)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id must be a new string, got {request_id!r}")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seeds))
        request = Request(request_id, ids, params, torch.Generator().manual_seed(seed))
        if self.tokenizer is not None:
            from .tokenizer import IncrementalDetokenizer

            request.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request_id

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
        """Stop a request now and free its KV blocks (no-op for unknown or finished ids)."""
        request = self.requests.get(request_id)
        if request is None or request.status == Status.FINISHED:
            return
        self._finish(request, "abort")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if batch.items:
            chunks = [SequenceChunk(r.all_ids[r.num_computed:r.num_computed + n], r.num_computed,
                                    self.blocks.block_table(r.request_id)) for r, n in batch.items]
            logits = self.runner.step(chunks)
            for row, (request, count) in enumerate(batch.items):
                request.num_computed += count
                self.blocks.register_full_blocks(request.request_id, request.all_ids, request.num_computed)
                if request.remaining == 0:  # every known token computed: the next one is due
                    outputs.append(self._advance(request, logits[row]))
        self.last_stats = self._stats(batch, time.perf_counter() - start)
        return outputs

    def _advance(self, request: Request, logits: torch.Tensor) -> RequestOutput:
        params = request.params
        banned = []
        if len(request.output_ids) < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))
        choice = next_token(logits, params, request.prompt_ids, request.output_ids, request.generator, banned)
        request.output_ids.append(choice.token)
        if params.logprobs is not None:
            request.logprobs.append(choice)
        if request.first_token is None:
            request.first_token = time.monotonic()
        reason = None
        stop_id = choice.token in params.stop_token_ids or (not params.ignore_eos and choice.token in self.eos_ids)
        if stop_id:
            reason = "stop"
        elif request.detokenizer is not None:
            request.text += request.detokenizer.add(choice.token)
            reason = self._stop_string(request)
        if reason is None and len(request.output_ids) >= params.max_tokens:
            reason = "length"
        emitted_before = request.emitted
        if reason is not None:
            if request.detokenizer is not None and reason == "length":
                request.text += request.detokenizer.flush()
            self._finish(request, reason)
            request.emitted = len(request.text)
        else:  # hold back what could still become the start of a stop string
            hold = max((len(s) - 1 for s in params.stop), default=0)
            request.emitted = max(request.emitted, len(request.text) - hold)
        return RequestOutput(request.request_id, [choice.token], request.text[emitted_before:request.emitted],
                             reason is not None, reason, [choice] if params.logprobs is not None else [],
                             list(request.output_ids), request.text[:request.emitted], request.timings())

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
        self.scheduler.remove(request)
        request.status, request.finish_reason = Status.FINISHED, reason
        request.finished_at = time.monotonic()

    def _stats(self, batch, seconds: float) -> StepStats:
        moe = [layer.mlp.last_stats for layer in self.model.layers if layer.mlp.last_stats is not None]
        per_expert = sum(s.tokens_per_expert for s in moe).tolist() if moe and batch.items else []
        return StepStats(batch.num_tokens, len(batch.items), len(self.scheduler.running), len(self.scheduler.waiting),
                         self.blocks.num_blocks - self.blocks.num_free, self.blocks.usage, self.blocks.hit_tokens,
                         len(batch.preempted), seconds, per_expert)

    # -- offline ----------------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run a whole batch (strings or token-id lists, any lengths); the final output of each, in order."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params ({len(params)}) must match prompts ({len(prompts)})")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while any(i not in final for i in ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
