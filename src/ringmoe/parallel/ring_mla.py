"""Ring attention for multi-head latent attention (DeepSeek-V2/V3) that passes the latent, not K and V.

Under MLA every token's keys and values come from one compressed latent c (kv_lora_rank numbers, already
normalised) and one RoPE key k_r (qk_rope_head_dim numbers, already rotated, shared by all heads):

    [k_nope_h | v_h] = W_kvb,h c           k_h = [k_nope_h | k_r]

so a block of L tokens is L x (rank + rope) numbers instead of L x heads x (qk + v) for expanded K/V
(DeepSeek-V3: 576 vs 40960 per token).  The ring carries (c, k_r); each rank expands the block it holds
with the replicated W_kvb and runs the usual block kernel.  Backward maps the block's dK, dV back to
the latent (dc = [dk_nope | dv] W_kvb, dk_r = sum over heads of dk_rope), which travels home like the
dense ring's dK/dV, and accumulates this rank's share of dW_kvb = sum over blocks [dk_nope | dv]^T c
(the replicated weight's gradients are summed over the ranks afterwards, like every replicated one).
Expanding costs L x rank x heads x (nope + v) multiply-adds per block per step: the price of the bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.api import make_spec
from ..attention.kernels import check_backend
from .layout import check_local_length
from .ring import RingStats, _Ring, check_same_shapes, dense_plan
from .varlen import varlen_plan
from .watchdog import activity

__all__ = ["ring_mla_attn_func", "LatentBlocks", "run_latent_ring", "check_mla_inputs"]


class LatentBlocks:
    """What travels is (batch, len, rank + rope): each token's latent and RoPE key."""

    length_dim = 1

    def __init__(self, kv_b_weight: torch.Tensor, heads: int, nope: int, v_dim: int):
        self.w, self.heads, self.nope, self.v_dim = kv_b_weight, heads, nope, v_dim
        self.rank = kv_b_weight.shape[1]
        self.grad_w = None

    def unpack(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head K (B, L, H, nope + rope) and V zero-padded to the same width."""
        batch, length, _ = block.shape
        latent, k_rope = block[..., :self.rank], block[..., self.rank:]
        kv = (latent @ self.w.t().to(latent.dtype)).view(batch, length, self.heads, self.nope + self.v_dim)
        rope = k_rope.shape[-1]
        k = torch.cat([kv[..., :self.nope], k_rope[:, :, None].expand(batch, length, self.heads, rope)], dim=-1)
        v = torch.nn.functional.pad(kv[..., self.nope:], (0, self.nope + rope - self.v_dim))
        return k, v

    def pack_grad(self, block: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        """The block's gradient (B, L, rank + rope) from per-head dK, dV; adds this block's dW_kvb."""
        batch, length, _ = block.shape
        acc = dk.dtype
        latent = block[..., :self.rank].to(acc)
        dkv = torch.cat([dk[..., :self.nope], dv[..., :self.v_dim]], dim=-1).reshape(batch, length, -1)
        d_latent = dkv @ self.w.to(acc)
        grad_w = dkv.reshape(-1, dkv.shape[-1]).t() @ latent.reshape(-1, self.rank)
        self.grad_w = grad_w if self.grad_w is None else self.grad_w + grad_w
        return torch.cat([d_latent, dk[..., self.nope:].sum(2)], dim=-1)


class _LatentRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, block, kv_b_weight, ring: _Ring):
        out, lse = ring.forward(q, block)
        ctx.save_for_backward(q, block, out, lse)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, block, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(q)
        ring = ctx.ring
        ring.blocks.grad_w = None
        with activity("latent ring attention backward"):
            dq, dblock = ring.backward(dout, q, block, None, out, lse, dlse)
        grad_w = ring.blocks.grad_w.to(ring.blocks.w.dtype) if ctx.needs_input_grad[2] else None
        return dq.to(q.dtype), dblock.to(block.dtype), grad_w, None


def ring_mla_attn_func(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, kv_b_weight: torch.Tensor,
                       v_head_dim: int, group: dist.ProcessGroup | None = None, causal: bool = True,
                       layout: str = "zigzag", softmax_scale: float | None = None, return_lse: bool = False,
                       backend: str = "auto", stats: RingStats | None = None, cu_seqlens: torch.Tensor | None = None,
                       max_seqlen: int | None = None):
    """MLA over the whole sharded sequence, the ring carrying latents.

    q (batch, local_len, heads, nope + rope): this rank's queries ([q_nope | q_rope], RoPE applied);
    latent (batch, local_len, kv_lora_rank): the normalised compressed KV of this rank's tokens;
    k_rope (batch, local_len, rope): their rotated RoPE keys; kv_b_weight (heads * (nope + v_head_dim),
    kv_lora_rank): W_kvb, the same on every rank.  Returns out (batch, local_len, heads, v_head_dim) (and
    lse (batch, heads, local_len)), equal to ``ring_flash_attn_func`` on the expanded K/V; differentiable
    in q, latent, k_rope and kv_b_weight.  softmax_scale defaults to 1/sqrt(nope + rope).
    Packed documents: with the *global* int32 ``cu_seqlens`` (and max_seqlen), the inputs are this rank's
    ``shard_varlen`` rows without the batch dimension (q (local_tokens, heads, nope + rope), latent
    (local_tokens, rank), k_rope (local_tokens, rope)) and attention stays inside each document.
    """
    if cu_seqlens is not None:
        if not all(isinstance(x, torch.Tensor) and x.dim() == d for x, d in ((q, 3), (latent, 2), (k_rope, 2))):
            raise ValueError("with cu_seqlens, q must be (tokens, heads, dim), latent and k_rope (tokens, width)")
        out, lse = _ring_mla(q[None], latent[None], k_rope[None], kv_b_weight, v_head_dim, group, causal, layout,
                             softmax_scale, True, backend, stats, (cu_seqlens, max_seqlen))
        return (out[0], lse[0]) if return_lse else out[0]
    return _ring_mla(q, latent, k_rope, kv_b_weight, v_head_dim, group, causal, layout, softmax_scale, return_lse,
                     backend, stats, None)


def check_mla_inputs(q, latent, k_rope, kv_b_weight, v_head_dim: int) -> tuple[int, int]:
    """ValueError naming the argument unless (batch, len, ...) MLA inputs fit together; (heads, nope width)."""
    for name, x, dims in (("q", q, 4), ("latent", latent, 3), ("k_rope", k_rope, 3), ("kv_b_weight", kv_b_weight, 2)):
        if not isinstance(x, torch.Tensor) or x.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    batch, length, heads, qk = q.shape
    rope = k_rope.shape[-1]
    nope = qk - rope
    if latent.shape[:2] != (batch, length) or k_rope.shape[:2] != (batch, length):
        raise ValueError(f"latent {tuple(latent.shape)} and k_rope {tuple(k_rope.shape)} must hold q's "
                         f"(batch, local_len) = {(batch, length)}")
    if nope < 0 or not 1 <= v_head_dim <= qk:
        raise ValueError(f"k_rope's width {rope} and v_head_dim {v_head_dim} do not fit q's head_dim {qk}")
    if tuple(kv_b_weight.shape) != (heads * (nope + v_head_dim), latent.shape[-1]):
        raise ValueError(f"kv_b_weight must be (heads * (nope + v_head_dim), kv_lora_rank) = "
                         f"{(heads * (nope + v_head_dim), latent.shape[-1])}, got {tuple(kv_b_weight.shape)}")
    if not (q.dtype == latent.dtype == k_rope.dtype):
        raise ValueError(f"q, latent, k_rope must share a dtype, got {q.dtype}, {latent.dtype}, {k_rope.dtype}")
    return heads, nope


def _ring_mla(q, latent, k_rope, kv_b_weight, v_head_dim, group, causal, layout, softmax_scale, return_lse, backend,
              stats, documents):
    """ring_mla_attn_func on (batch, len, ...) inputs; ``documents`` = (cu_seqlens, max_seqlen) or None."""
    check_mla_inputs(q, latent, k_rope, kv_b_weight, v_head_dim)
    length, qk = q.shape[1], q.shape[3]
    check_backend(backend)
    spec = make_spec(qk, softmax_scale, causal, (-1, -1), 0.0)
    block = torch.cat([latent, k_rope], dim=-1)
    if documents is not None:

        plan = varlen_plan(group, documents[0], documents[1], length, layout, causal, (-1, -1), q[0])
    else:
        check_local_length(length, layout)
        if not dist.is_initialized():
            raise RuntimeError("ring_mla_attn_func needs an initialized torch.distributed process group")
        check_same_shapes(group, q, block[:, :, None])
        plan = dense_plan(length, dist.get_world_size(group), layout, causal)
    out, lse = run_latent_ring(q, block, kv_b_weight, v_head_dim, group, plan, spec, backend, stats)
    return (out, lse) if return_lse else out


def run_latent_ring(q, block, kv_b_weight, v_head_dim, group, plan, spec, backend, stats):
    """The ring over ``group`` carrying ``block`` (B, L, rank + rope) under ``plan``: (out (B, L, H, v), lse)."""
    heads, qk = q.shape[2], q.shape[3]
    nope = qk - (block.shape[-1] - kv_b_weight.shape[1])
    ring = _Ring(group, plan, spec, backend, stats, LatentBlocks(kv_b_weight, heads, nope, v_head_dim))
    with activity("latent ring attention"):
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, block, kv_b_weight)):
            out, lse = _LatentRingAttention.apply(q, block, kv_b_weight, ring)
        else:
            out, lse = ring.forward(q, block)
            out = out.to(q.dtype)
    return out[..., :v_head_dim], lse
