"""Differentiable, asynchronous all-to-all exchanges (expert parallelism's dispatch and combine, Ulysses).

``start_all_to_all`` sends ``send_splits[p]`` rows to rank p, receives
``recv_splits[p]`` rows from it, and returns at once with a ``Pending``
handle, so compute can run while the rows travel.  Backward sends the
gradients back the same way reversed (synchronously).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Pending", "start_all_to_all", "exchange_counts"]


class _AsyncAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, handle):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        x = x.contiguous()
        handle.append(dist.all_to_all_single(out, x, recv_splits, send_splits, group=group, async_op=True))
        handle.append(x)  # keep the send buffer alive until the exchange completes
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return back, None, None, None, None


class Pending:
    """An exchange in flight: ``result()`` waits for it and returns the received rows (M, ...)."""

    def __init__(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group):
        self._handle: list = []
        self._out = _AsyncAllToAll.apply(x, send_splits, recv_splits, group, self._handle)

    def result(self) -> torch.Tensor:
        self._handle[0].wait()
        return self._out


def start_all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> Pending:
    """Start sending the rows of x (N, ...) split by ``send_splits`` to ranks 0..P-1."""
    return Pending(x, send_splits, recv_splits, group)


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """send_counts (P, E_local) int64: rows for each rank's local experts -> the (P, E_local) this rank receives."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv
