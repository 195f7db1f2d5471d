"""One optimizer step of the MoE transformer on a cp x ep mesh, equal to the same step on one process.

A step takes ``rows`` packed sequences; each ep group takes its rows (``mesh.batch_rows``) as one
packed row of documents, and each cp rank its ``shard_varlen`` part of it (attention stays inside
documents, positions restart at each document).  The loss is a sum over this rank's tokens divided by
the number of labelled tokens of the *whole* batch, so gradients summed over ranks are the one-process
gradients:

    loss = CE_sum_local / N  +  aux_coef * aux  +  z_coef * z

The balancing losses are defined over the whole batch: per layer, aux = E * sum_e f_e * P_e with f_e
the share of assignments and P_e the mean router probability over all N tokens (Switch), and z the
mean squared logsumexp of the router logits (ST-MoE).  Each rank adds the others' (detached) sums to
its own, so the value is global and the gradient reaches exactly its own tokens.  With
``balance="bias"`` the aux term is off and every router's selection bias moves against the global
load (DeepSeek-V3's auxiliary-loss-free balancing).

Gradients: ``reduce_gradients`` sums replicas; the global norm counts every parameter once (replicated
ones on any rank, experts summed over the ep group); clipping scales every gradient by
min(1, clip / norm).  The cross entropy is fused with the LM head (``fused_loss``).  AdamW with linear warmup and cosine decay to ``min_lr_ratio``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..model.transformer import MoETransformer
from ..moe.router import update_correction_bias
from ..parallel.varlen import shard_varlen
from .data import IGNORE, PackedStream, next_token_labels
from .fused_loss import linear_cross_entropy

__all__ = ["TrainConfig", "Trainer"]


@dataclass(frozen=True)
class TrainConfig:
    rows: int = 8                # sequences per step (the whole mesh)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    steps: int = 200             # for the cosine schedule
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    balance: str = "aux"         # "aux" | "bias" | "none"
    aux_coef: float = 1e-2
    z_coef: float = 1e-3
    bias_rate: float = 1e-3
    bf16: bool = False           # autocast matrix products to bfloat16; weights and optimizer stay float32
    activation_checkpointing: bool = False

    def __post_init__(self):
        if self.balance not in ("aux", "bias", "none"):
            raise ValueError(f"balance must be 'aux', 'bias' or 'none', got {self.balance!r}")
        for name in ("rows", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.clip > 0:
            raise ValueError("lr and clip must be > 0")

    def lr_at(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warmup, then cosine."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _global(local: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over ranks as a value, with the gradient of this rank's own part only."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return local + (total - local.detach())


class Trainer:
    def __init__(self, model: MoETransformer, config: TrainConfig, stream: PackedStream):
        self.model, self.config, self.stream = model, config, stream
        if config.rows % model.mesh.ep:
            raise ValueError(f"rows ({config.rows}) must be divisible by ep ({model.mesh.ep})")
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=config.lr, betas=config.betas, eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.lr_at)
        self.position = 0  # sequences consumed
        self.step_count = 0
        model.activation_checkpointing = config.activation_checkpointing
        if config.bf16 and model.embed_tokens.weight.dtype != torch.float32:
            raise ValueError("bf16 autocast keeps float32 master weights: build the model in float32")

    def _local_batch(self):
        """This rank's ids (1, local), labels (local,), positions, the group's cu_seqlens, and N (global labels)."""
        mesh, model = self.model.mesh, self.model
        batch = self.stream.batch(self.position, self.config.rows)
        rows = range(batch.ids.shape[0])[mesh.batch_rows(batch.ids.shape[0])]
        seqlen = batch.ids.shape[1]
        ids = torch.cat([batch.ids[r] for r in rows])
        labels = torch.cat([next_token_labels(batch.ids[r], batch.cu_seqlens[r]) for r in rows])
        cu = torch.cat([batch.cu_seqlens[rows[0]]] + [c[1:] + i * seqlen for i, c in
                                                       enumerate((batch.cu_seqlens[r] for r in rows[1:]), 1)])
        valid = sum(int((next_token_labels(batch.ids[r], batch.cu_seqlens[r]) != IGNORE).sum())
                    for r in range(batch.ids.shape[0]))
        longest = int((cu[1:] - cu[:-1]).max())
        if mesh.cp > 1:
            ids = shard_varlen(ids, cu, mesh.cp, mesh.cp_rank, model.layout)
            labels = shard_varlen(labels, cu, mesh.cp, mesh.cp_rank, model.layout)
        return ids[None], labels, model.packed_positions(cu), cu, longest, valid, batch.ids.numel()

    def _balance_losses(self, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(aux, z) averaged over layers, each over the whole batch; and each layer's global assignments."""
        aux, z, loads = 0.0, 0.0, []
        experts = self.model.config.num_experts
        moe_layers = self.model.moe_layers()
        for _, layer in moe_layers:
            sums = layer.mlp.last_stats.router_sums
            counts = sums.assignments.detach().clone()
            if dist.is_initialized() and self.model.mesh.size > 1:
                dist.all_reduce(counts)
            prob = _global(sums.prob_sum) if self.model.mesh.size > 1 else sums.prob_sum
            z_sum = _global(sums.z_sum) if self.model.mesh.size > 1 else sums.z_sum
            aux = aux + experts * torch.sum(counts / total_tokens * prob / total_tokens)
            z = z + z_sum / total_tokens
            loads.append(counts)
        layers = max(1, len(moe_layers))
        return aux / layers, z / layers, loads

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients, each parameter counted once over the mesh."""
        experts = self.model.expert_parameters()
        replicated = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            square = param.grad.detach().double().pow(2).sum().cpu()
            if name in experts:
                expert += square
            else:
                replicated += square
        if self.model.mesh.ep_group is not None:
            dist.all_reduce(expert, group=self.model.mesh.ep_group)
        return float((replicated + expert).sqrt())

    def step(self) -> dict:
        """One optimizer step on the next ``rows`` sequences; the global figures of the step."""
        config, model = self.config, self.model
        ids, labels, positions, cu, longest, valid, total_tokens = self._local_batch()
        device = model.embed_tokens.weight.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=config.bf16):
            hidden = model.hidden_states(ids, positions.to(ids.device), model.packed_attention(cu, longest))
            ce_sum = linear_cross_entropy(hidden[0], model.lm_head.weight, labels)  # no logits kept
        lm = ce_sum / valid
        aux, z, loads = self._balance_losses(total_tokens)
        loss = lm + config.z_coef * z + (config.aux_coef * aux if config.balance == "aux" else 0.0)
        loss.backward()
        model.reduce_gradients()
        norm = self.grad_norm()
        if norm > config.clip:
            scale = config.clip / (norm + 1e-12)
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if config.balance == "bias":
            for (_, layer), load in zip(model.moe_layers(), loads):
                update_correction_bias(layer.mlp.router, load, config.bias_rate)
        lm_total = _global(lm.detach()) if model.mesh.size > 1 else lm.detach()
        self.position += config.rows
        self.step_count += 1
        imbalance = max(float(load.max() / load.mean()) for load in loads)
        return {"step": self.step_count, "loss": float(lm_total), "aux": float(aux.detach()), "z": float(z.detach()),
                "grad_norm": norm, "lr": lr, "tokens": total_tokens, "router_imbalance": imbalance}

    @torch.no_grad()
    def evaluate(self, stream: PackedStream, sequences: int) -> float:
        """Mean next-token loss over the first ``sequences`` of ``stream`` (global over the mesh)."""
        saved, self.stream, position = self.stream, stream, self.position
        total, count = 0.0, 0
        try:
            for start in range(0, sequences, self.config.rows):
                self.position = start
                ids, labels, positions, cu, longest, valid, _ = self._local_batch()
                hidden = self.model.hidden_states(ids, positions, self.model.packed_attention(cu, longest))
                logits = self.model.lm_head(hidden[0]).float()
                ce = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum").double()
                if self.model.mesh.size > 1:
                    dist.all_reduce(ce)
                total += float(ce)
                count += valid
        finally:
            self.stream, self.position = saved, position
        return total / max(1, count)
