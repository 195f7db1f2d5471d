"""Greedy generation of a fixed batch, through the serving engine (the project's one decode path).

``generate`` is collective: every rank of the model's mesh calls it with the same prompt and
gets the same ``Generation``.  It builds an ``Engine`` sized for the batch, queues one greedy
request per row on the driver (rank 0), prefills every prompt in one step (ring attention over
each cp group, the KV cache sharded), decodes until each row has its tokens or meets an
end-of-sequence id, and shares the result with every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..model.transformer import MoETransformer
from ..parallel.ring import RingStats
from .engine import Engine
from .sampling import SamplingParams

__all__ = ["generate", "Generation"]


@dataclass
class Generation:
    """tokens (B, new) int64 and, if asked, logits (B, new, vocab) float32 of every step (all rows, every rank);
    new < max_new_tokens when every row ended early at an end-of-sequence token (a finished row is padded with
    the first end-of-sequence id, its logits with zeros).

    Timings are this rank's (prefill: the first engine step; decode: the others); ring holds the
    prefill's ring statistics on this rank; moe the prefill's MoEStats per layer on this rank.
    """

    tokens: torch.Tensor
    logits: torch.Tensor | None
    prefill_s: float
    decode_s: float
    ring: RingStats = field(default_factory=RingStats)
    moe: list = field(default_factory=list)


def _eos_ids(eos_token_id, vocab_size: int) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"eos_token_id must be a token id (or a list of them) in [0, {vocab_size}), got {eos_token_id!r}")
    return tuple(ids)


@torch.no_grad()
def generate(model: MoETransformer, prompt: torch.Tensor, max_new_tokens: int, return_logits: bool = False,
             progress=None, eos_token_id: int | list[int] | None = None) -> Generation:
    """Greedy decoding of ``max_new_tokens`` tokens after each row of ``prompt``.

    prompt (B, S) int64, the same full tensor on every rank, S >= 1, B divisible by the mesh's ep.
    Equal to single-device greedy decoding (float32 / float64).  eos_token_id: a row that produces one
    of these ids is finished.  progress(phase, done, total) is called on the driver after the prefill
    step ("prefill", 1, 1) and each decoding step ("decode", step, max_new_tokens - 1).
    """
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype != torch.int64:
        raise ValueError(f"prompt must be an int64 tensor (batch, seqlen), got {getattr(prompt, 'shape', prompt)!r}")
    if prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must hold at least one token per row, got shape {tuple(prompt.shape)}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    vocab = model.config.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:  # every rank checks, before any collective
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got values in "
                         f"[{int(prompt.min())}, {int(prompt.max())}]")
    eos = _eos_ids(eos_token_id, vocab)
    mesh = model.mesh
    batch, seqlen = prompt.shape
    mesh.batch_rows(batch)  # ValueError unless the ep groups split the batch evenly
    per_group = batch // mesh.ep
    block = 16
    engine = Engine(model, kv_cache_tokens=per_group * (-(-(seqlen + max_new_tokens) // block) + 1) * block,
                    block_size=block, max_num_seqs=per_group, max_num_batched_tokens=per_group * seqlen,
                    prefix_caching=False, record_steps=True, return_logits=return_logits)
    report = progress or (lambda phase, done, total: None)
    result = None
    if engine.is_driver:
        params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True, stop_token_ids=eos)
        ids = [engine.add_request(row.tolist(), params) for row in prompt]
        logits: dict[str, list[torch.Tensor]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        step = 0
        while engine.has_unfinished:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if return_logits:
                    logits[out.request_id].append(out.logits)
            report("prefill", 1, 1) if step == 0 else report("decode", step, max_new_tokens - 1)
            step += 1
        engine.shutdown()
        width = max(len(t) for t in tokens.values())
        result = (torch.tensor([t + [eos[0] if eos else 0] * (width - len(t)) for t in tokens.values()]),
                  torch.stack([torch.stack(rows + [torch.zeros_like(rows[0])] * (width - len(rows)))
                               for rows in logits.values()]) if return_logits else None)
    else:
        engine.run_worker()
    if mesh.size > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    history = engine.runner.history
    prefill, decode = history[:1], history[1:]
    return Generation(result[0], result[1], sum(h["seconds"] for h in prefill), sum(h["seconds"] for h in decode),
                      prefill[0]["ring"] if prefill else RingStats(), prefill[0]["moe"] if prefill else [])
