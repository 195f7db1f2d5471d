"""The all-to-all exchange of expert parallelism, differentiable.

Forward sends ``send_splits[p]`` rows to rank p and receives ``recv_splits[p]``
rows from it; backward sends the gradients back the same way reversed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "exchange_counts"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Rows of x (N, ...) split by ``send_splits`` go to ranks 0..P-1; returns the received rows (M, ...)."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """send_counts (P, E_local) int64: rows for each rank's local experts -> the (P, E_local) this rank receives."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv
