"""The 2-D mesh of ranks the model runs on: context parallel x expert parallel.

Rank r sits at (cp_rank, ep_rank) = divmod(r, ep): ranks of one expert-parallel
group are neighbours (the all-to-all is the heavier traffic, so it gets the
closest links), ranks of one context-parallel group are ``ep`` apart.

The ep dimension also splits the batch, as data parallelism does: ranks of an
EP group hold different sequences (the same positions of them), so the tokens
they exchange are distinct.  The cp dimension splits each sequence by a shard
layout.  cp = ep = 1 is one device with no process group.
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

    @property
    def size(self) -> int:
        return self.cp * self.ep

    def batch_rows(self, batch: int) -> slice:
        """The rows of a global batch this rank's EP coordinate holds."""
        if batch % self.ep:
            raise ValueError(f"batch ({batch}) must be divisible by the expert-parallel degree ep={self.ep}")
        per = batch // self.ep
        return slice(self.ep_rank * per, (self.ep_rank + 1) * per)


def make_mesh(cp: int = 1, ep: int = 1, device_type: str = "cpu") -> Mesh:
    """Build the cp x ep mesh over the default process group (world size must be cp * ep).

    Uses ``torch.distributed.device_mesh.init_device_mesh`` with dimension names
    ("cp", "ep").  Every rank must call it (it creates the subgroups).
    """
    for name, value in (("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
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
    return Mesh(
        cp=cp, ep=ep, cp_rank=cp_rank, ep_rank=ep_rank,
        cp_group=mesh.get_group("cp") if cp > 1 else None,
        ep_group=mesh.get_group("ep") if ep > 1 else None,
        device_mesh=mesh,
    )
