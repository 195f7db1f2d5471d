"""The contract between a layer's attention and whoever runs the model: ``AttentionBackend``.

A layer computes its q, k, v (projections, norms, RoPE) and hands them to the backend it was given:

    out = backend.attend(layer, q, k, v)     # q (B, S, heads, D), k / v (B, S, kv_heads, D) -> out like q

The backend decides where the keys come from and how they are reached: the whole local sequence
(``DenseAttention``), the cp group's ring (``RingAttention``), packed documents (``PackedAttention``,
flash varlen or the varlen ring) for training, Ulysses or the Ulysses x ring hybrid over the cp group
(``UlyssesAttention``, dense or packed), or the serving engine's paged KV cache
(``serve/step_attention.py``: prompt chunks, batched decodes, ring prefill, the cp-decode merge).

Multi-head latent attention (DeepSeek-V3) asks two more things of a backend:
- ``absorbed``: True when the backend's cache holds MLA latents (one "K/V head" of kv_lora_rank + rope);
  the layer then attends in the latent space and never expands K/V (the engine's latent cache);
- ``latent_ring``: True when the backend carries latents and RoPE keys around the ring instead of
  expanded K/V; the layer then calls ``attend_latent(layer, q, latent, k_rope, w_kvb, v_dim)``.

Every backend here takes the layer's window and sinks from the model (``attention_options``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..attention import flash_attn_func, flash_attn_varlen_func
from ..parallel.ring import RingStats, ring_flash_attn_func
from ..parallel.ring_mla import ring_mla_attn_func
from ..parallel.ulysses import usp_attn_func, usp_attn_varlen_func, usp_mla_attn_func
from ..parallel.varlen import ring_flash_attn_varlen_func

__all__ = ["AttentionBackend", "DenseAttention", "RingAttention", "PackedAttention", "UlyssesAttention"]


@runtime_checkable
class AttentionBackend(Protocol):
    """What a layer's attention calls.  ``absorbed`` and ``latent_ring`` matter to MLA layers only."""

    absorbed: bool
    latent_ring: bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of layer ``layer``: q (B, S, H, D), k, v (B, S, Hkv, D) -> (B, S, H, D)."""
        ...


class DenseAttention:
    """Causal flash attention over the whole local sequence (one process, or cp = 1)."""

    absorbed = latent_ring = False

    def __init__(self, model):
        self.model = model

    def attend(self, layer, q, k, v):
        return flash_attn_func(q, k, v, causal=True, backend=self.model.backend, **self.model.attention_options(layer))


class RingAttention:
    """Causal ring attention over the model's cp group: each rank holds its layout shard of every sequence.

    latent: MLA layers send their latents and RoPE keys around the ring (``attend_latent``) instead of K/V."""

    absorbed = False

    def __init__(self, model, stats: RingStats | None = None, latent: bool = False):
        self.model, self.stats, self.latent_ring = model, stats, latent

    def attend(self, layer, q, k, v):
        model = self.model
        return ring_flash_attn_func(q, k, v, group=model.mesh.cp_group, causal=True, layout=model.layout,
                                    backend=model.backend, stats=self.stats, **model.attention_options(layer))

    def attend_latent(self, layer, q, latent, k_rope, w_kvb, v_dim):
        model = self.model
        return ring_mla_attn_func(q, latent, k_rope, w_kvb, v_dim, group=model.mesh.cp_group, layout=model.layout,
                                  backend=model.backend, stats=self.stats)


class PackedAttention:
    """Causal attention within packed documents of one (1, tokens) row: int32 ``cu_seqlens`` (global, the same on
    every rank).  cp = 1: flash varlen; cp > 1: the varlen ring over this rank's ``shard_varlen`` rows."""

    absorbed = False

    def __init__(self, model, cu_seqlens: torch.Tensor, max_seqlen: int, stats: RingStats | None = None,
                 latent: bool = False):
        self.model, self.cu_seqlens, self.max_seqlen, self.stats = model, cu_seqlens, max_seqlen, stats
        self.latent_ring = latent and model.mesh.cp > 1

    def attend(self, layer, q, k, v):
        model, cu, longest = self.model, self.cu_seqlens, self.max_seqlen
        options = model.attention_options(layer)
        if model.mesh.cp == 1:
            return flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, longest, longest, causal=True,
                                          backend=model.backend, **options)[None]
        return ring_flash_attn_varlen_func(q[0], k[0], v[0], cu, longest, group=model.mesh.cp_group, causal=True,
                                           layout=model.layout, backend=model.backend, stats=self.stats,
                                           **options)[None]

    def attend_latent(self, layer, q, latent, k_rope, w_kvb, v_dim):
        model = self.model
        return ring_mla_attn_func(q[0], latent[0], k_rope[0], w_kvb, v_dim, group=model.mesh.cp_group,
                                  layout=model.layout, backend=model.backend, stats=self.stats,
                                  cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen)[None]


class UlyssesAttention:
    """Causal attention over the cp group by Ulysses, with the ring across when the mesh factors cp as
    ulysses x ring (USP).  The ranks hold the same layout shards as under the ring (positions unchanged);
    with ``cu_seqlens`` the input is one packed (1, tokens) row of documents (``shard_varlen`` rows).
    MLA layers send latents (``latent``: gathered in the Ulysses group, each rank expanding its heads) or
    expanded K/V (Ulysses splits the expanded heads)."""

    absorbed = False

    def __init__(self, model, stats: RingStats | None = None, cu_seqlens: torch.Tensor | None = None,
                 max_seqlen: int | None = None, latent: bool = False):
        self.model, self.stats, self.cu_seqlens, self.max_seqlen = model, stats, cu_seqlens, max_seqlen
        self.latent_ring = latent

    def attend(self, layer, q, k, v):
        model, mesh = self.model, self.model.mesh
        options = dict(causal=True, layout=model.layout, backend=model.backend, stats=self.stats,
                       **model.attention_options(layer))
        if self.cu_seqlens is None:
            return usp_attn_func(q, k, v, mesh.ulysses_group, mesh.ring_group, **options)
        return usp_attn_varlen_func(q[0], k[0], v[0], self.cu_seqlens, self.max_seqlen, mesh.ulysses_group,
                                    mesh.ring_group, **options)[None]

    def attend_latent(self, layer, q, latent, k_rope, w_kvb, v_dim):
        model, mesh = self.model, self.model.mesh
        options = dict(layout=model.layout, backend=model.backend, stats=self.stats)
        if self.cu_seqlens is None:
            return usp_mla_attn_func(q, latent, k_rope, w_kvb, v_dim, mesh.ulysses_group, mesh.ring_group, **options)
        return usp_mla_attn_func(q[0], latent[0], k_rope[0], w_kvb, v_dim, mesh.ulysses_group, mesh.ring_group,
                                 cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen, **options)[None]
