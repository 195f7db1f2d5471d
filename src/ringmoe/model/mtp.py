"""DeepSeek-V3's multi-token prediction (MTP) module: one more transformer block that predicts a token further ahead.

Module k (k = 1 .. D, ``config.mtp_layers`` = D; checkpoint layer num_layers + k - 1) at position i combines the
representation of token t_i one depth down, h_i^{k-1} (k = 1: the main model's final-norm hidden state, the one
its head reads), with the embedding of the token k places ahead, t_{i+k}:

    h'_i^k = W_eh [RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h_i^{k-1})]        (eh_proj: (hidden, 2 hidden))
    h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})                                       (one causal decoder block)
    P^k_{i+k+1} = softmax(Head(RMSNorm_s(h_i^k)))                          (shared_head.norm, the shared head)

so module k predicts t_{i+k+1}.  The embedding and the output head are the main model's (DeepSeek-V3 shares
them; its checkpoint stores copies under ``model.layers.{L}.embed_tokens`` / ``shared_head.head``).  As the
depth-k input, the next module takes module k's normed output (what the head reads), as the first takes the
main model's: every depth reads a normed state.  The concatenation order (embedding first) is the published
checkpoints' (vLLM's and SGLang's ``eh_proj`` inputs).

Training adds lambda / D * sum_k CE(P^k, t_{i+k+1}) to the loss (DeepSeek-V3: lambda 0.3, then 0.1); serving
uses module 1 (repeated for more than one draft) to draft tokens that the main model verifies
(``serve/mtp_drafter.py``).  The block is the family's ``DecoderLayer`` (MLA, MoE) with layer index
num_layers + k - 1: it has a KV cache of its own in the engine and attention options of its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..batch_invariant import InvariantLinear
from .config import ModelConfig
from .decoder_layer import DecoderLayer
from .norms import RMSNorm

__all__ = ["MultiTokenPredictor"]


class SharedHeadNorm(nn.Module):
    """``shared_head``: the checkpoint's name for the norm before the shared output head (the head itself is the
    main model's ``lm_head``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)


class MultiTokenPredictor(DecoderLayer):
    """MTP module k as layer ``index`` = num_layers + k - 1: the family's decoder layer (its attention and MLP under
    the checkpoint's names for that layer) with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``."""

    def __init__(self, config: ModelConfig, index: int, ep_group):
        super().__init__(config, index, ep_group)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_eps)
        self.hnorm = RMSNorm(h, config.rms_eps)
        self.eh_proj = InvariantLinear(2 * h, h, bias=False)
        self.shared_head = SharedHeadNorm(config)

    def predict(self, previous: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention) -> torch.Tensor:
        """previous h^{k-1} (B, S, hidden) (normed), embedded Emb(t_{i+k}) (B, S, hidden) -> the normed state
        (B, S, hidden) that the shared head turns into the logits of t_{i+k+1}."""
        return self.shared_head.norm(self(self._joined(previous, embedded), cos, sin, attention))

    def predict_static(self, previous: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       attention) -> tuple[torch.Tensor, object]:
        """``predict`` in the decoder layer's fixed-shape ops (``forward_static``, what a compiled decode graph
        traces): (the normed state (B, S, hidden), the MoE block's routing or None)."""
        x, routing = self.forward_static(self._joined(previous, embedded), cos, sin, attention)
        return self.shared_head.norm(x), routing

    def _joined(self, previous: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """h' = W_eh [RMSNorm_e(embedded) ; RMSNorm_h(previous)] (B, S, hidden): the block's input."""
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
