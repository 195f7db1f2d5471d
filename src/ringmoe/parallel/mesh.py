"""The 2-D mesh of ranks the model runs on: context parallel x expert parallel.

Rank r sits at (cp_rank, ep_rank) = divmod(r, ep): ranks of one expert-parallel
group are neighbours (the all-to-all is the heavier traffic, so it gets the
closest links), ranks of one context-parallel group are ``ep`` apart.

The ep dimension also splits the batch, as data parallelism does: ranks of an
EP group hold different sequences (the same positions of them), so the tokens
they exchange are distinct.  The cp dimension splits each sequence by a shard
layout.  cp = ep = 1 is one device with no process group.

Sequence parallelism inside the cp group is the ring, Ulysses, or both (USP): the cp group factors as
ulysses x ring, cp_rank = ring_rank * ulysses + ulysses_rank, so a Ulysses group is ``ulysses``
consecutive cp ranks (``ulysses * ep`` consecutive global ranks: one node's links when they fit in it)
and a ring group is the ranks that share ulysses_rank.  ulysses = 1 is the plain ring, ulysses = cp
Ulysses alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Mesh", "make_mesh"]


@dataclass(frozen=True)
class Mesh:
    """cp_group / ep_group: process groups (None when that degree is 1)."""

    cp: int = 1
    ep: int = 1
    cp_rank: int = 0
    ep_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    device_mesh: object | None = None
    ulysses: int = 1
    ulysses_rank: int = 0
    ulysses_group: dist.ProcessGroup | None = None
    ring_group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return self.cp * self.ep

    @property
    def ring(self) -> int:
        """Ranks of the ring dimension of the cp group (cp / ulysses)."""
        return self.cp // self.ulysses

    @property
    def sp_mode(self) -> str:
        """How the cp group attends: "none" (cp = 1), "ring", "ulysses", or "usp" (both)."""
        if self.cp == 1:
            return "none"
        return "ring" if self.ulysses == 1 else ("ulysses" if self.ulysses == self.cp else "usp")

    def batch_rows(self, batch: int) -> slice:
        """The rows of a global batch this rank's EP coordinate holds."""
        if batch % self.ep:
            raise ValueError(f"batch ({batch}) must be divisible by the expert-parallel degree ep={self.ep}")
        per = batch // self.ep
        return slice(self.ep_rank * per, (self.ep_rank + 1) * per)


def make_mesh(cp: int = 1, ep: int = 1, device_type: str = "cpu", ulysses: int = 1) -> Mesh:
    """Build the cp x ep mesh over the default process group (world size must be cp * ep).

    Uses ``torch.distributed.device_mesh.init_device_mesh`` with dimension names
    ("cp", "ep").  Every rank must call it (it creates the subgroups).
    ulysses: the Ulysses degree inside the cp group (must divide cp); the rest of cp is the ring.
    """
    for name, value in (("cp", cp), ("ep", ep), ("ulysses", ulysses)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if cp % ulysses:
        raise ValueError(f"the ulysses degree ({ulysses}) must divide cp ({cp})")
    if cp * ep == 1:
        return Mesh()
    if not dist.is_initialized():
        raise RuntimeError(f"cp={cp} x ep={ep} needs an initialized torch.distributed process group")
    world = dist.get_world_size()
    if world != cp * ep:
        raise ValueError(f"world size {world} must equal cp * ep = {cp} * {ep}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (cp, ep), mesh_dim_names=("cp", "ep"))
    cp_rank, ep_rank = divmod(dist.get_rank(), ep)
    cp_group = mesh.get_group("cp") if cp > 1 else None
    ulysses_group, ring_group = _sequence_groups(cp, ep, ulysses, cp_rank, ep_rank, cp_group)
    return Mesh(
        cp=cp, ep=ep, cp_rank=cp_rank, ep_rank=ep_rank, cp_group=cp_group,
        ep_group=mesh.get_group("ep") if ep > 1 else None,
        device_mesh=mesh, ulysses=ulysses, ulysses_rank=cp_rank % ulysses,
        ulysses_group=ulysses_group, ring_group=ring_group,
    )


def _sequence_groups(cp: int, ep: int, ulysses: int, cp_rank: int, ep_rank: int, cp_group):
    """(ulysses_group, ring_group) of this rank; None where that degree is 1.  Every rank creates every group
    (``new_group`` is collective), in the same order."""
    ring = cp // ulysses
    if ring == 1 or ulysses == 1:
        return (cp_group, None) if ring == 1 else (None, cp_group)
    mine = {}
    for e in range(ep):
        for r in range(ring):
            group = dist.new_group([(r * ulysses + u) * ep + e for u in range(ulysses)])
            if (e, r) == (ep_rank, cp_rank // ulysses):
                mine["ulysses"] = group
    for e in range(ep):
        for u in range(ulysses):
            group = dist.new_group([(r * ulysses + u) * ep + e for r in range(ring)])
            if (e, u) == (ep_rank, cp_rank % ulysses):
                mine["ring"] = group
    return mine["ulysses"], mine["ring"]
