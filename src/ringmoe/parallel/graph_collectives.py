"""The collectives of a compiled decode step on a mesh, as operators of its graph (``ringmoe::gather_rows``,
``ringmoe::sum_rows``, ``ringmoe::merge_over_group``).

A decode step on a cp x ep mesh needs three exchanges, all of fixed shapes: the cp group merges each layer's
partial attention (each rank attends to the keys it keeps: ``merge_over_group``), and under expert parallelism
each MoE layer gathers every rank's rows with their routing (``gather_rows``) and sends each rank's rows home
summed over the ranks' experts (``sum_rows``).  Declared as operators (``ringmoe.operators``), each is one node of
the compiled graph that runs the collective eagerly when reached: the step stays one graph, compiled with
inductor's C++ wrapper (which calls these kernels through the dispatcher), on every rank.  The other ways were
measured on this machine (2 gloo ranks, 2 CPU threads) and not kept: torch's functional collectives inside the
graph (the C++ wrapper cannot call them, and from inductor's Python wrapper each cost ~1 ms where the eager
collective costs ~0.3-0.7 ms), and graph breaks at the collectives (each break starts a frame that torch.compile
guards and compiles per layer).  The graph's data dependencies order the collectives (each one's input comes from
the one before), so every rank runs them in the same order.

An operator takes tensors and numbers, not process groups: a group is registered here under an int key
(``group_key``) and the graph calls the operators with it.  Each function also serves the eager steps directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..attention.merge import merge_attention
from ..operators import LIBRARY

__all__ = ["group_key", "gather_rows", "sum_rows", "merge_over_group"]

_GROUPS: list = []  # a group's key is its place here


def group_key(group) -> int:
    """The int under which the operators find ``group`` (a process group; registered once, for the process: a
    process holds a few)."""
    for key, known in enumerate(_GROUPS):
        if known is group:
            return key
    _GROUPS.append(group)
    return len(_GROUPS) - 1


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x (n, ...) (the same n on each) stacked in rank order: (P * n, ...)."""
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def sum_rows(y: torch.Tensor, group) -> torch.Tensor:
    """y (P * n, ...): this rank's part of every rank's rows (rank p's n rows at p * n) -> (n, ...): the sum over
    the group of every rank's part of this rank's rows, added in rank order (one all-to-all, then the sum here: the
    same order on every rank, where a reduce-scatter adds in the collective's order)."""
    received = torch.empty_like(y)
    dist.all_to_all_single(received, y.contiguous(), group=group)
    return received.view(dist.get_world_size(group), -1, *y.shape[1:]).sum(0)


def merge_over_group(group, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention (out (n, heads, D), lse (n, heads)) over every rank's keys from each rank's partial result
    (a rank that holds none of a row's keys: lse -inf, its output ignored); out in the promoted float dtype (at least
    float32).  One all-gather carries both: the lse as one more column of the output, in the wider of their dtypes;
    the parts merge in rank order on every rank (identical results)."""
    if group is None:
        return out, lse
    wide = torch.promote_types(out.dtype, lse.dtype)
    packed = torch.cat([out.to(wide), lse.to(wide)[..., None]], dim=-1)
    every = gather_rows(packed[None], group)
    merged, merged_lse = every[0, ..., :-1].to(out.dtype), every[0, ..., -1].to(lse.dtype)
    for part in every[1:]:
        merged, merged_lse = merge_attention(merged[None], merged_lse.T[None], part[None, ..., :-1],
                                             part[..., -1].to(lse.dtype).T[None])
        merged, merged_lse = merged[0], merged_lse[0].T
    return merged, merged_lse


# the operators' kernels and shapes (their schemas: ``ringmoe.operators``)

def _gather_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    return gather_rows(x, _GROUPS[group])


def _gather_rows_shape(x, group):
    return x.new_empty(dist.get_world_size(_GROUPS[group]) * x.shape[0], *x.shape[1:])


def _sum_rows(y: torch.Tensor, group: int) -> torch.Tensor:
    return sum_rows(y, _GROUPS[group])


def _sum_rows_shape(y, group):
    return y.new_empty(y.shape[0] // dist.get_world_size(_GROUPS[group]), *y.shape[1:])


def _merge(out: torch.Tensor, lse: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    merged, merged_lse = merge_over_group(_GROUPS[group], out, lse)
    return merged.to(torch.promote_types(out.dtype, torch.float32)), merged_lse.contiguous()


def _merge_shape(out, lse, group):
    return out.new_empty(out.shape, dtype=torch.promote_types(out.dtype, torch.float32)), torch.empty_like(lse)


for _name, _kernel, _shape in (("gather_rows", _gather_rows, _gather_rows_shape),
                               ("sum_rows", _sum_rows, _sum_rows_shape), ("merge_over_group", _merge, _merge_shape)):
    LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ringmoe::{_name}", _shape, lib=LIBRARY)
gather_rows_op = torch.ops.ringmoe.gather_rows.default
sum_rows_op = torch.ops.ringmoe.sum_rows.default
merge_over_group_op = torch.ops.ringmoe.merge_over_group.default
