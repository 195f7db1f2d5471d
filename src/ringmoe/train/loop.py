"""One optimizer step of the MoE transformer on a cp x ep mesh, equal to the same step on one process.

A step takes ``rows`` packed sequences; each ep group takes its rows (``mesh.batch_rows``) as one
packed row of documents, and each cp rank its ``shard_varlen`` part of it (attention stays inside
documents, positions restart at each document).  The loss is a sum over this rank's tokens divided by
the number of labelled tokens of the *whole* batch, so gradients summed over ranks are the one-process
gradients:

    loss = CE_sum_local / N  +  aux_coef * aux  +  z_coef * z  (+ mtp_lambda * MTP)

The balancing losses are defined over the whole batch: per layer, aux = E * sum_e f_e * P_e with f_e
the share of assignments and P_e the mean router probability over all N tokens (Switch), and z the
mean squared logsumexp of the router logits (ST-MoE).  Each rank adds the others' (detached) sums to
its own, so the value is global and the gradient reaches exactly its own tokens.  With
``balance="bias"`` the aux term is off and every router's selection bias moves against the global
load (DeepSeek-V3's auxiliary-loss-free balancing).

Gradients: ``reduce_gradients`` sums replicas; the global norm counts every parameter once (replicated
ones on any rank, experts summed over the ep group); clipping scales every gradient by
min(1, clip / norm).  The cross entropy is fused with the LM head (``fused_loss``).  A model with multi-token
prediction modules (``model/mtp.py``) adds DeepSeek-V3's MTP loss: mtp_lambda times the mean over depths k of the
cross entropy of module k's prediction of the token k + 1 places ahead (labels IGNORE'd past a document's end).
AdamW with linear warmup and cosine decay to ``min_lr_ratio``.
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
    mtp_lambda: float = 0.3      # weight of the multi-token prediction loss (DeepSeek-V3: 0.3, later 0.1)
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

    def _local_batch(self) -> "LocalBatch":
        """This rank's part of the next ``rows`` sequences (``LocalBatch``)."""
        mesh, model = self.model.mesh, self.model
        batch = self.stream.batch(self.position, self.config.rows)
        rows = range(batch.ids.shape[0])[mesh.batch_rows(batch.ids.shape[0])]
        seqlen = batch.ids.shape[1]
        ids = torch.cat([batch.ids[r] for r in rows])
        cu = torch.cat([batch.cu_seqlens[rows[0]]] + [c[1:] + i * seqlen for i, c in
                                                       enumerate((batch.cu_seqlens[r] for r in rows[1:]), 1)])
        # the tokens 1, 2, ..., D + 1 places ahead: the main model's labels, then each MTP depth's
        ahead = [torch.cat([next_token_labels(batch.ids[r], batch.cu_seqlens[r], k) for r in rows])
                 for k in range(1, model.config.mtp_layers + 2)]
        valid = [sum(int((next_token_labels(batch.ids[r], batch.cu_seqlens[r], k) != IGNORE).sum())
                     for r in range(batch.ids.shape[0])) for k in range(1, len(ahead) + 1)]
        longest = int((cu[1:] - cu[:-1]).max())
        if mesh.cp > 1:
            ids = shard_varlen(ids, cu, mesh.cp, mesh.cp_rank, model.layout)
            ahead = [shard_varlen(labels, cu, mesh.cp, mesh.cp_rank, model.layout) for labels in ahead]
        return LocalBatch(ids[None], ahead, model.packed_positions(cu), cu, longest, valid, batch.ids.numel())

    def _losses(self, batch: "LocalBatch") -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the next-token loss, the MTP loss averaged over depths or None) of this rank's part of the batch, each
        a sum over its tokens divided by the whole batch's labelled tokens."""
        model = self.model
        attention = model.packed_attention(batch.cu, batch.longest)
        positions = batch.positions.to(batch.ids.device)
        hidden = model.hidden_states(batch.ids, positions, attention)
        lm = linear_cross_entropy(hidden[0], model.lm_head.weight, batch.ahead[0]) / batch.valid[0]
        depths = model.config.mtp_layers
        if not depths:
            return lm, None
        mtp = 0.0
        for depth in range(1, depths + 1):  # depth k reads the token k places ahead and predicts the next one
            next_ids = batch.ahead[depth - 1].clamp(min=0)[None]  # past a document's end: any id (its loss is IGNORE'd)
            hidden = model.mtp_hidden_states(hidden, next_ids, positions, attention, depth)
            mtp = mtp + linear_cross_entropy(hidden[0], model.lm_head.weight, batch.ahead[depth]) / max(
                1, batch.valid[depth])
        return lm, mtp / depths

    def _balance_losses(self, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(aux, z) averaged over layers, each over the whole batch; and each layer's global assignments."""
        aux, z, loads = 0.0, 0.0, []
        experts = self.model.config.num_experts
        moe_layers = self.model.moe_layers(with_mtp=True)
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
        batch = self._local_batch()
        device = model.embed_tokens.weight.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=config.bf16):
            lm, mtp = self._losses(batch)  # the logits are never kept (fused with the head)
        aux, z, loads = self._balance_losses(batch.total_tokens)
        loss = lm + config.z_coef * z + (config.aux_coef * aux if config.balance == "aux" else 0.0)
        if mtp is not None:
            loss = loss + config.mtp_lambda * mtp
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
            for (_, layer), load in zip(model.moe_layers(with_mtp=True), loads):
                update_correction_bias(layer.mlp.router, load, config.bias_rate)
        lm_total = _global(lm.detach()) if model.mesh.size > 1 else lm.detach()
        self.position += config.rows
        self.step_count += 1
        imbalance = max(float(load.max() / load.mean()) for load in loads)
        row = {"step": self.step_count, "loss": float(lm_total), "aux": float(aux.detach()), "z": float(z.detach()),
               "grad_norm": norm, "lr": lr, "tokens": batch.total_tokens, "router_imbalance": imbalance}
        if mtp is not None:
            row["mtp_loss"] = float(_global(mtp.detach()) if model.mesh.size > 1 else mtp.detach())
        return row

    @torch.no_grad()
    def evaluate(self, stream: PackedStream, sequences: int) -> float:
        """Mean next-token loss over the first ``sequences`` of ``stream`` (global over the mesh)."""
        return self.evaluate_all(stream, sequences)["val_loss"]

    @torch.no_grad()
    def evaluate_all(self, stream: PackedStream, sequences: int) -> dict:
        """Over the first ``sequences`` of ``stream`` (global over the mesh): the mean next-token loss "val_loss";
        with MTP modules also "mtp_val_loss" (depth 1's loss on the token two places ahead) and
        "mtp_draft_acceptance": the share of positions whose depth-1 greedy draft (argmax of its logits at
        position i) equals the main model's greedy token at position i + 1 given the true token i + 1, i.e. how
        often a greedy speculative step on this text accepts the first draft."""
        saved, self.stream, position = self.stream, stream, self.position
        sums = torch.zeros(4, dtype=torch.float64)  # CE sum, MTP CE sum, accepted drafts, drafts
        count = mtp_count = 0
        model = self.model
        try:
            for start in range(0, sequences, self.config.rows):
                self.position = start
                batch = self._local_batch()
                attention = model.packed_attention(batch.cu, batch.longest)
                hidden = model.hidden_states(batch.ids, batch.positions, attention)
                logits = model.lm_head(hidden[0]).float()
                sums[0] += F.cross_entropy(logits, batch.ahead[0], ignore_index=IGNORE, reduction="sum").double()
                count += batch.valid[0]
                if model.config.mtp_layers:
                    mtp_hidden = model.mtp_hidden_states(hidden, batch.ahead[0].clamp(min=0)[None], batch.positions,
                                                         attention, 1)
                    mtp_logits = model.lm_head(mtp_hidden[0]).float()
                    sums[1] += F.cross_entropy(mtp_logits, batch.ahead[1], ignore_index=IGNORE,
                                               reduction="sum").double()
                    mtp_count += batch.valid[1]
                    sums[2:] += _draft_agreement(model, mtp_logits, logits, batch)
            if model.mesh.size > 1:
                dist.all_reduce(sums)
        finally:
            self.stream, self.position = saved, position
        result = {"val_loss": float(sums[0]) / max(1, count)}
        if model.config.mtp_layers:
            result["mtp_val_loss"] = float(sums[1]) / max(1, mtp_count)
            result["mtp_draft_acceptance"] = float(sums[2] / sums[3].clamp(min=1))
        return result


def _draft_agreement(model: MoETransformer, mtp_logits: torch.Tensor, logits: torch.Tensor,
                     batch: "LocalBatch") -> torch.Tensor:
    """(accepted, drafted) float64 (2,): positions i with a token two places ahead in their document where the
    MTP argmax at i equals the main argmax at i + 1.  On one rank (cp = 1) the next position is the next row; a
    sharded rank does not hold its rows' successors, so under cp > 1 every rank counts nothing."""
    if model.mesh.cp > 1:
        return torch.zeros(2, dtype=torch.float64)
    has_next = batch.ahead[1] != IGNORE  # position i + 1 is in the document and has a label
    draft = mtp_logits.argmax(-1)[:-1]
    target = logits.argmax(-1)[1:]
    mask = has_next[:-1]
    return torch.tensor([float(((draft == target) & mask).sum()), float(mask.sum())], dtype=torch.float64)


@dataclass
class LocalBatch:
    """A rank's part of a step: ids (1, local) int64; ahead[k - 1] (local,) the labels k places ahead (k = 1: the
    next token; k = 2 ..: the MTP depths'); positions (local,) within documents; cu the ep group's int32
    cu_seqlens; longest document; valid[k - 1] labels k places ahead in the whole batch; total_tokens."""

    ids: torch.Tensor
    ahead: list[torch.Tensor]
    positions: torch.Tensor
    cu: torch.Tensor
    longest: int
    valid: list[int]
    total_tokens: int
