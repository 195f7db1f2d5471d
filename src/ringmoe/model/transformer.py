"""A decoder-only MoE transformer that runs on a context-parallel x expert-parallel mesh.

Each layer: x + Attention(RMSNorm(x)), then h + MoE(RMSNorm(h)), as Mixtral and
Qwen3-MoE.  Attention is GQA with RoPE; under context parallelism every rank
holds a shard of each sequence (``parallel.shard`` layout), its RoPE angles
come from the global positions of that shard, and attention is
``ring_flash_attn_func`` over the cp group (``flash_attn_func`` when cp = 1).
The MoE MLP is a ``MoELayer`` over the ep group.

How attention gets its keys is a parameter, an ``AttentionBackend`` (``attention_backend.py``): the
full causal ring for prefill, packed documents for training, the serving engine's paged cache.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

from ..batch_invariant import InvariantLinear
from ..parallel.layout import check_layout
from ..parallel.ulysses import check_heads
from ..parallel.layout import positions as layout_positions
from ..parallel.mesh import Mesh
from ..parallel.ring import RingStats
from ..parallel.varlen import varlen_positions
from ..parallel.watchdog import activity
from .attention_backend import AttentionBackend, DenseAttention, PackedAttention, RingAttention, UlyssesAttention
from .config import ModelConfig
from .decoder_layer import Attention, DecoderLayer
from .mtp import MultiTokenPredictor
from .norms import RMSNorm
from .rope import inv_freq, rope_tables

__all__ = ["MoETransformer", "Attention", "DecoderLayer"]

class MoETransformer(nn.Module):
    """The model on one rank of a ``Mesh`` (default: one device).

    input_ids (B_local, S_local) int64: this rank's rows of the batch (its ep
    coordinate's share, ``mesh.batch_rows``) and its shard of each sequence
    under ``layout`` (``parallel.shard(ids, mesh.cp, mesh.cp_rank, layout)``).
    forward -> logits (B_local, S_local, vocab) in the parameters' dtype, equal
    to the single-device model's logits for the same tokens.
    Parameters are replicated except the experts: each rank holds its ep
    coordinate's num_experts / ep of them.  After backward, ``reduce_gradients``
    sums gradients over the mesh so every replica holds the full gradient.
    """

    def __init__(self, config: ModelConfig, mesh: Mesh | None = None, layout: str = "zigzag", backend: str = "auto"):
        super().__init__()
        self.config = config
        self.mesh = mesh if mesh is not None else Mesh()
        self.layout, self.backend = layout, backend
        if self.mesh.ulysses > 1:  # Ulysses splits the query heads (and K/V heads, or repeats them) over its ranks
            check_heads(config.num_heads, config.num_heads if config.mla else config.num_kv_heads, self.mesh.ulysses)
        self.activation_checkpointing = False  # training: recompute each layer in backward (memory for compute)
        # MLA under cp > 1: the ring carries "latent"s (fewer bytes, every rank expands every block) or
        # "expanded" K/V (each block expanded once).  "auto": latent on GPUs, expanded on CPUs.  The rule: the
        # latent ring pays when the transfer time it saves exceeds the extra expansion, i.e. when the link's
        # bytes/s < (expanded - latent bytes per token) x flop/s / (2 rank heads (nope + v)); for
        # DeepSeek-V2-Lite in bf16 that is ~1 TB/s on an H100 (NVLink and InfiniBand are below it) and
        # ~0.2 GB/s on this CPU (gloo through shared memory is above it; benchmarks/bench_mla.py measures both)
        self.mla_ring = "auto"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.mesh.ep_group) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = InvariantLinear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # DeepSeek-V3's multi-token prediction modules (``mtp.py``), named by their layer index as the checkpoint
        # numbers them (num_layers, num_layers + 1, ...); built after the rest, so the seeded init of the other
        # weights does not depend on them
        self.mtp_layers = nn.ModuleDict({str(i): MultiTokenPredictor(config, i, self.mesh.ep_group)
                                         for i in range(config.num_layers, config.num_layers + config.mtp_layers)})

    def decoder_layer(self, index: int) -> DecoderLayer:
        """Layer ``index``: the main layers 0 .. L - 1, then the multi-token prediction modules L .. L + D - 1."""
        return self.layers[index] if index < len(self.layers) else self.mtp_layers[str(index)]

    def layer_name(self, index: int) -> str:
        """The module path of layer ``index`` (``decoder_layer``): "layers.{i}" or "mtp_layers.{i}"."""
        return f"layers.{index}" if index < len(self.layers) else f"mtp_layers.{index}"

    # -- forward -------------------------------------------------------------------------
    def local_positions(self, local_len: int) -> torch.Tensor:
        """Global positions (S_local,) of this rank's shard of a sequence."""
        if self.mesh.cp == 1:
            return torch.arange(local_len)
        seqlen = local_len * self.mesh.cp
        check_layout(seqlen, self.mesh.cp, self.layout)
        return layout_positions(seqlen, self.mesh.cp, self.mesh.cp_rank, self.layout)

    def attention_options(self, index: int) -> dict:
        """Layer ``index``'s window_size and sinks, as the attention functions take them."""
        return {"window_size": self.config.window(index), "sinks": self.decoder_layer(index).self_attn.sinks}

    def causal_attention(self, ring_stats: RingStats | None = None) -> AttentionBackend:
        """Causal self-attention over the whole (sharded) sequence: the ring, Ulysses or both when cp > 1."""
        if self.mesh.cp == 1:
            return DenseAttention(self)
        if self.mesh.ulysses > 1:
            return UlyssesAttention(self, ring_stats, latent=self.config.mla and self._latent_ring())
        return RingAttention(self, ring_stats, latent=self.config.mla and self._latent_ring())

    def packed_attention(self, cu_seqlens: torch.Tensor, max_seqlen: int,
                         ring_stats: RingStats | None = None) -> AttentionBackend:
        """Causal attention within packed documents (int32 ``cu_seqlens``, global, the same on every rank).

        The rank's input is its ``shard_varlen`` rows of the packed (1, total_tokens) row; under cp > 1 the
        ring carries K/V (or MLA latents) between the ranks, or Ulysses exchanges heads (mesh.ulysses > 1).
        """
        if self.mesh.ulysses > 1:
            return UlyssesAttention(self, ring_stats, cu_seqlens, max_seqlen, self.config.mla and self._latent_ring())
        return PackedAttention(self, cu_seqlens, max_seqlen, ring_stats, latent=self.config.mla and self._latent_ring())

    def _latent_ring(self) -> bool:
        if self.mla_ring not in ("auto", "latent", "expanded"):
            raise ValueError(f"mla_ring must be 'auto', 'latent' or 'expanded', got {self.mla_ring!r}")
        return self.mla_ring == "latent" or (self.mla_ring == "auto" and self.embed_tokens.weight.is_cuda)

    def packed_positions(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Positions within their documents (int64 (local_tokens,)) of this rank's rows of a packed row."""

        bounds = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
        rows = varlen_positions(bounds, self.mesh.cp, self.mesh.cp_rank, self.layout)
        document = torch.searchsorted(bounds, rows, right=True) - 1
        return rows - bounds[document]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention: AttentionBackend | None = None, ring_stats: RingStats | None = None) -> torch.Tensor:
        """Final-norm hidden states (B_local, S_local, hidden) of this rank's tokens.

        attention: how every layer attends (default: causal over the whole sequence, the ring when cp > 1)."""
        self._check_ids(input_ids)
        if positions is None:
            positions = self.local_positions(input_ids.shape[1]).to(input_ids.device)
        if attention is None:
            attention = self.causal_attention(ring_stats)
        x = self.embed_tokens(input_ids)
        cos, sin = self._rope_tables(positions, x.dtype)
        checkpointing = self.activation_checkpointing and torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            with activity(f"layer {index}"):
                if checkpointing:  # keep only the layer's input; recompute its inside during backward
                    x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, attention, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, attention)
        return self.norm(x)

    @property
    def static_ready(self) -> bool:
        """``hidden_states_static`` can run: every MoE block dropless (without replicas)."""
        return all(layer.mlp.static_ready for _, layer in self.moe_layers())

    def hidden_states_static(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                             rope_freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
        """``hidden_states`` of one packed row in fixed-shape ops, with no host synchronisation (no checks,
        no shape that depends on the data): what torch.compile traces into one graph for a decode step.

        input_ids, positions (T,) int64; rope_freqs: ``rope_frequencies()`` computed before, or None -> (hidden
        (T, hidden), the routing of every MoE layer, in order)."""
        x = self.embed_tokens(input_ids)[None]
        cos, sin = self._rope_tables(positions, x.dtype, rope_freqs)
        routings = []
        for layer in self.layers:
            x, routing = layer.forward_static(x, cos, sin, attention)
            if routing is not None:
                routings.append(routing)
        return self.norm(x)[0], routings

    def mtp_hidden_states(self, previous: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                          attention: AttentionBackend, depth: int = 1) -> torch.Tensor:
        """Multi-token prediction module ``depth`` (``mtp.py``) over this rank's tokens: previous (B, S, hidden), the
        normed states one depth down (depth 1: ``hidden_states``), next_ids (B, S) int64 the tokens ``depth``
        places ahead of each position, positions (S,) as for ``hidden_states``; attention attends with layer
        index num_layers + depth - 1.  Returns the normed states (B, S, hidden) whose ``lm_head`` logits predict
        the tokens depth + 1 places ahead."""
        if not 1 <= depth <= self.config.mtp_layers:
            raise ValueError(f"depth must lie in [1, {self.config.mtp_layers}] (the model's MTP modules), got {depth}")
        self._check_ids(next_ids)
        module = self.mtp_layers[str(self.config.num_layers + depth - 1)]
        embedded = self.embed_tokens(next_ids)
        cos, sin = self._rope_tables(positions, embedded.dtype)
        return module.predict(previous, embedded, cos, sin, attention)

    def mtp_hidden_states_static(self, previous: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                                 attention: AttentionBackend, rope_freqs: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, list]:
        """``mtp_hidden_states`` of the first module over one packed row in fixed-shape ops (what a compiled decode
        graph traces, as ``hidden_states_static``): previous (T, hidden), next_ids, positions (T,) int64 -> (the
        normed states (T, hidden), [the module's MoE routing] or [])."""
        module = self.mtp_layers[str(self.config.num_layers)]
        embedded = self.embed_tokens(next_ids)[None]
        cos, sin = self._rope_tables(positions, embedded.dtype, rope_freqs)
        states, routing = module.predict_static(previous[None], embedded, cos, sin, attention)
        return states[0], [] if routing is None else [routing]

    def rope_frequencies(self, device: torch.device | None = None) -> torch.Tensor:
        """RoPE's frequencies (rope dim / 2,) float32 (``rope.inv_freq``; MLA: of the RoPE part of the heads)."""
        rope_dim = self.config.qk_rope_head_dim if self.config.mla else self.config.head_dim
        return inv_freq(rope_dim, self.config.rope_theta, dict(self.config.rope_scaling), device)[0]

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype,
                     freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin at ``positions`` (MLA: over the RoPE part of the heads); freqs: ``rope_frequencies``."""
        rope_dim = self.config.qk_rope_head_dim if self.config.mla else self.config.head_dim
        return rope_tables(positions, rope_dim, self.config.rope_theta, dtype, dict(self.config.rope_scaling), freqs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention: AttentionBackend | None = None, ring_stats: RingStats | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, positions, attention, ring_stats))

    def _check_ids(self, input_ids):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            got = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an int64 tensor (batch, local_seqlen), got {got}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, vocab_size={self.config.vocab_size})")

    # -- parameters ------------------------------------------------------------------------
    def expert_parameters(self) -> set[str]:
        return {name for name, _ in self.named_parameters() if ".mlp.experts." in name}

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights that depend only on the seed, not on the mesh.

        Every tensor is drawn in full from one generator in a fixed order (experts
        as the whole (num_experts, ...) stack); each rank keeps its own experts.
        Norm weights are 1, everything else N(0, std).
        """
        gen = torch.Generator().manual_seed(seed)
        experts = self.expert_parameters()
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if name in experts:
                layer = self.decoder_layer(int(name.split(".")[1]))
                full = torch.randn((self.config.num_experts, *param.shape[1:]), generator=gen) * std
                param.copy_(full.index_select(0, torch.tensor(layer.mlp.slot_experts)))
                continue
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum each gradient over the ranks that hold a copy of its parameter.

        Replicated parameters saw only this rank's tokens: sum over the whole mesh.
        Experts already received every token of their ep group through the
        all-to-all: sum over the cp group only.
        """
        if self.mesh.size == 1:
            return
        experts = self.expert_parameters()
        for name, param in self.named_parameters():
            if param.grad is None:
                continue
            if name in experts:
                if self.mesh.cp_group is not None:
                    dist.all_reduce(param.grad, group=self.mesh.cp_group)
            else:
                dist.all_reduce(param.grad)

    def moe_layers(self, with_mtp: bool = False) -> list[tuple[int, DecoderLayer]]:
        """(index, layer) of the layers whose MLP is a MoE block (``with_mtp``: the MTP modules' too)."""
        layers = list(enumerate(self.layers)) + ([(int(i), m) for i, m in self.mtp_layers.items()] if with_mtp else [])
        return [(i, layer) for i, layer in layers if layer.is_moe]

    def moe_stats(self) -> list:
        """The MoEStats of every MoE layer's last forward."""
        return [layer.mlp.last_stats for _, layer in self.moe_layers()]
