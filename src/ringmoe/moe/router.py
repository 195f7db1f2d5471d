"""Routers: which experts each token goes to, with what weight, and the balancing losses.

* ``softmax_topk`` (Mixtral, Qwen3-MoE): probabilities = softmax(logits) in
  float32; the top-k experts are chosen; their weights are the probabilities,
  renormalised to sum to 1 when ``normalize_topk`` (Mixtral always, Qwen3-MoE
  by ``norm_topk_prob``).
* ``topk_softmax`` (gpt-oss): the top-k logits are chosen first and their weights are the softmax over
  those k only (probs, for the balancing losses, stay the softmax over all experts).
* ``sigmoid_bias`` (DeepSeek-V3): scores = sigmoid(logits); a correction bias
  is added for *choosing* only; experts are split into ``n_group`` groups, a
  group scores the sum of its two best biased scores, the best ``topk_group``
  groups are kept, and top-k is taken within them; weights are the unbiased
  scores, renormalised when ``normalize_topk``, times ``routed_scaling_factor``.

Losses (tensors with gradients): the load-balancing loss in the Switch/GShard
form as transformers computes it, ``E * sum_e f_e P_e`` with f_e the routed
assignments of expert e per token (summing to k) and P_e the mean router
probability (its minimum, for a uniform router, is k), and the router z-loss
``mean_t logsumexp(logits_t)^2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..batch_invariant import linear, rowwise
from ..prepacked import module_state

__all__ = ["Router", "Routing", "ROUTERS", "load_balancing_loss", "router_z_loss", "update_correction_bias"]

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_bias")


@dataclass
class Routing:
    """logits, probs (T, E) float32 (float64 for float64 input); topk_idx (T, k) int64; topk_weight (T, k)."""

    logits: torch.Tensor
    probs: torch.Tensor
    topk_idx: torch.Tensor
    topk_weight: torch.Tensor


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e (assignments_e / T) * mean_t probs[t, e]; differentiable through probs."""
    tokens = probs.shape[0]
    if tokens == 0:
        return probs.sum() * 0.0
    counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).to(probs.dtype)
    return num_experts * torch.sum(counts / tokens * probs.mean(dim=0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE): keeps router logits small."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()


class Router(nn.Module):
    """Linear gate (E, H) (plus a bias (E,) with ``bias``) and the top-k rule of ``kind``.  forward(x (T, H)) -> Routing."""

    decode_panels: torch.Tensor | None = None  # the gate's panel copy for a compiled decode step (``prepacked``)

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        kind: str = "softmax_topk",
        normalize_topk: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        bias: bool = False,
    ):
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {kind!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group ({n_group}) must divide num_experts ({num_experts})")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if kind == "sigmoid_bias" and top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"top_k ({top_k}) exceeds the experts in the kept groups")
        self.kind, self.num_experts, self.top_k = kind, num_experts, top_k
        self.normalize_topk, self.n_group, self.topk_group = normalize_topk, n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        self.register_buffer("correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def prepack_weights(self) -> tuple[torch.Tensor, ...]:
        """The gate ``prepacked.prepack_module`` may pack (``linear`` uses the copy where it applies)."""
        return (self.weight,)

    def __getstate__(self) -> dict:
        return module_state(self)

    def forward(self, x: torch.Tensor) -> Routing:
        dtype = torch.promote_types(x.dtype, torch.float32)  # float32 at least, float64 stays
        logits = linear(x.to(dtype), self.weight.to(dtype), panels=self.decode_panels)
        if self.bias is not None:
            logits = logits + self.bias.to(dtype)
        if self.kind == "topk_softmax":
            probs = torch.softmax(logits, dim=-1)
            # the bias steers the choice only; a zero bias (the default) adds exact zeros: the same choice
            idx = torch.topk(logits.detach() + self.correction_bias, self.top_k, dim=-1).indices
            return Routing(logits, probs, idx, torch.softmax(logits.gather(1, idx), dim=-1))
        if self.kind == "softmax_topk":
            probs = torch.softmax(logits, dim=-1)
            # auxiliary-loss-free balancing: the bias steers the choice only (a zero bias: the plain top-k)
            idx = torch.topk(probs.detach() + self.correction_bias, self.top_k, dim=-1).indices
            weight = probs.gather(1, idx)
            if self.normalize_topk:
                weight = weight / weight.sum(dim=-1, keepdim=True)
            return Routing(logits, probs, idx, weight)
        scores = rowwise(torch.sigmoid, logits)
        idx = self._grouped_topk(scores.detach() + self.correction_bias)
        weight = scores.gather(1, idx)
        if self.normalize_topk:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(logits, scores, idx, weight * self.routed_scaling_factor)

    def _grouped_topk(self, choice: torch.Tensor) -> torch.Tensor:
        """Top-k of ``choice`` (T, E) restricted to the best ``topk_group`` groups."""
        tokens = choice.shape[0]
        if self.n_group > 1:
            per_group = choice.view(tokens, self.n_group, choice.shape[1] // self.n_group)  # also for 0 tokens
            group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, choice.shape[1])
        return torch.topk(choice, self.top_k, dim=-1).indices


@torch.no_grad()
def update_correction_bias(router: Router, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
    load = tokens_per_expert.float()
    router.correction_bias += rate * torch.sign(load.mean() - load)
