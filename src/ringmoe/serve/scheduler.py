"""Which requests compute how many tokens in the next step.

One token budget per step (``max_num_batched_tokens``) and at most ``max_num_seqs`` running
requests.  Running requests come first, oldest first (decodes, and the rest of a prompt that was
split into chunks), then waiting requests in arrival order, their prompts cut to what the
budget leaves (chunked prefill), so decodes keep flowing while a long prompt is prefilled.
With ``chunked_prefill=False`` (ring prefill under context parallelism) a prompt runs whole:
it waits for a step with room, or runs alone over the budget.

A request that writes into a block it shares with a parallel sample of its prompt first gets a
copy of its own (``BlockManager.copy_on_write``); the step's ``copies`` list those block copies.

When the cache has no block for a running request, the newest running request is preempted:
its blocks are released and it goes back to the front of the queue with ``num_computed = 0``,
to be recomputed (prompt and generated tokens) when there is room.  No request is lost.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockManager, NoFreeBlocks
from .request import Request, Status

__all__ = ["Scheduler", "ScheduledBatch", "admission_error"]


@dataclass
class ScheduledBatch:
    """(request, number of new tokens to compute) in the order they are packed; preempted request ids;
    copies: request id -> (source, destination) block copies to make before its tokens are written."""

    items: list[tuple[Request, int]]
    preempted: list[str]
    copies: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


def admission_error(prompt_len: int, max_tokens: int, max_model_len: int, capacity: int) -> str | None:
    """Why a request of ``prompt_len`` tokens and up to ``max_tokens`` new ones can never run (None: it can)."""
    if prompt_len < 1:
        return "prompt must hold at least one token"
    total = prompt_len + max_tokens
    if prompt_len > max_model_len:
        return f"the prompt ({prompt_len} tokens) exceeds the context limit of {max_model_len} tokens"
    if total > max_model_len:
        return (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context limit of "
                f"{max_model_len} tokens")
    if total > capacity:
        return (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the KV cache "
                f"({capacity} tokens)")
    return None


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, chunked_prefill: bool = True):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.capacity = getattr(blocks, "capacity_tokens", blocks.num_blocks * blocks.block_size)
        self.max_model_len = max_model_len or self.capacity
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def check_admissible(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError for a request that could never run (the engine calls it before queueing)."""
        message = admission_error(prompt_len, max_tokens, self.max_model_len, self.capacity)
        if message is not None:
            raise ValueError(message)

    def add(self, request: Request) -> None:
        self.check_admissible(len(request.prompt_ids), request.params.max_tokens)
        self.waiting.append(request)

    def add_fork(self, child: Request, parent: Request) -> None:
        """A parallel sample of ``parent``'s prompt, computed as far as the parent: it shares the parent's
        blocks and runs from the next step (cp > 1, where blocks cannot be shared: it queues first and
        recomputes the prompt)."""
        if hasattr(self.blocks, "fork"):
            self.blocks.fork(parent.request_id, child.request_id)
            child.num_computed = parent.num_computed
            child.status = Status.RUNNING
            child.first_scheduled = parent.first_scheduled
            self.running.append(child)
        else:
            self.waiting.appendleft(child)

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.release(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        items: list[tuple[Request, int]] = []
        preempted: list[str] = []
        copies: dict[str, list[tuple[int, int]]] = {}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.remaining + len(request.draft_ids), budget)
            del request.draft_ids[max(0, count - request.remaining):]  # drafts beyond the budget are dropped
            try:
                if hasattr(self.blocks, "copy_on_write"):
                    copy = self.blocks.copy_on_write(request.request_id, request.num_computed)
                    if copy:
                        copies[request.request_id] = copy
                self.blocks.grow(request.request_id, request.num_computed + count)
            except NoFreeBlocks:
                victim = self.running[-1]  # the newest
                self._preempt(victim)
                preempted.append(victim.request_id)
                copies.pop(victim.request_id, None)
                continue  # retry this request (unless it was the victim: then the loop ends)
            items.append((request, count))
            budget -= count
            index += 1
        if not preempted:  # admit only when nothing had to make room
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                if request.request_id not in self.blocks.owned:
                    request.num_computed = self.blocks.admit(request.request_id, request.all_ids,
                                                             use_cache=not request.needs_prompt_logprobs)
                    if request.preemptions == 0 and not request.output_ids:
                        request.num_cached_prompt = request.num_computed
                count = min(request.remaining, budget)
                if not self.chunked_prefill and count < request.remaining:
                    if items:  # a whole prompt only: wait for a step with room for it
                        self.blocks.release(request.request_id)
                        request.num_computed = 0
                        break
                    count = request.remaining  # alone in the step: over the budget rather than never
                try:
                    self.blocks.grow(request.request_id, request.num_computed + count)
                except NoFreeBlocks:
                    self.blocks.release(request.request_id)  # give back its prefix hits; try next step
                    request.num_computed = 0
                    break
                self.waiting.popleft()
                request.status = Status.RUNNING
                if request.first_scheduled is None:
                    request.first_scheduled = time.monotonic()
                self.running.append(request)
                items.append((request, count))
                budget -= count
        return ScheduledBatch(items, preempted, copies)

    def _preempt(self, request: Request) -> None:
        request.draft_ids.clear()
        self.running.remove(request)
        self.blocks.release(request.request_id)
        request.num_computed = 0
        request.status = Status.WAITING
        request.preemptions += 1
        self.waiting.appendleft(request)
