"""Cross entropy of the language-model head without the (tokens, vocab) logits kept for backward.

``linear_cross_entropy(hidden, weight, labels)`` equals
``F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE, reduction="sum")``, value and gradients.
It walks the tokens in chunks; for each chunk it forms the logits, their logsumexp and the loss, and
at once the gradient of the loss with respect to the logits,

    d loss / d logits[i, v] = softmax(logits[i])[v] - [v == label_i]      (0 for ignored rows)

which it turns into the chunk's gradients of ``hidden`` (g @ weight) and of ``weight`` (g^T @ hidden)
before the next chunk.  The logits never exist for all tokens at once, nothing of their size is saved
for backward, and the log-softmax's backward pass (a second sweep over tokens x vocabulary) and its
zero-filled gradient buffer disappear.  Backward only scales the saved gradients by the incoming one
(the loss is a scalar).  Under autocast the products run in the autocast dtype and the softmax in float32,
as ``F.cross_entropy`` would see them.
"""

from __future__ import annotations

import torch

from .data import IGNORE

__all__ = ["linear_cross_entropy"]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h, y = hidden[rows], labels[rows]
            logits = (h @ weight.t()).to(acc)  # (chunk, vocab)
            lse = torch.logsumexp(logits, dim=-1)
            valid = y != IGNORE
            target = y.clamp(min=0)
            picked = logits.gather(1, target[:, None])[:, 0]
            total += torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if need_h or need_w:
                grad = torch.exp(logits.sub_(lse[:, None]))                  # softmax, in place of the logits
                grad.scatter_add_(1, target[:, None], -torch.ones_like(lse)[:, None])
                grad.mul_(valid[:, None].to(acc))
                g = grad.to(h.dtype) if h.dtype == weight.dtype else grad
                if need_h:
                    grad_h[rows] = g @ weight.to(g.dtype)
                if need_w:
                    grad_w += (g.t() @ h.to(g.dtype)).to(acc)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.need = (need_h, need_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.need
        grad_h = (saved.pop(0) * grad_out).to(ctx.dtypes[0]) if need_h else None
        grad_w = (saved.pop(0) * grad_out).to(ctx.dtypes[1]) if need_w else None
        return grad_h, grad_w, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int = 1024) -> torch.Tensor:
    """Summed next-token cross entropy of ``hidden @ weight.T`` against ``labels``.

    hidden (tokens, hidden_size), weight (vocab, hidden_size), labels (tokens,) int64 with IGNORE (-100)
    for tokens without a target.  Returns a scalar in float32 (float64 for float64 inputs).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (tokens, h) and weight (vocab, h) expected, got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be ({hidden.shape[0]},), got {tuple(labels.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk)
