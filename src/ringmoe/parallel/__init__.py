"""Sequence (context) parallelism: shard layouts, ring attention, Ulysses and the hybrid, and rank launching."""

from .layout import LAYOUTS, positions, shard, unshard
from .mesh import Mesh, make_mesh
from .ring import RingStats, ring_flash_attn_func
from .ulysses import ulysses_attn_func, usp_attn_func

__all__ = ["LAYOUTS", "positions", "shard", "unshard", "ring_flash_attn_func", "RingStats", "Mesh", "make_mesh",
           "ulysses_attn_func", "usp_attn_func"]
