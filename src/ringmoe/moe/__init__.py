"""Mixture of experts: routers, dispatch (permute / capacity / unpermute), grouped experts, MoELayer."""

from .layer import MoELayer, MoEStats
from .router import Router, Routing, load_balancing_loss, router_z_loss, update_correction_bias

__all__ = ["MoELayer", "MoEStats", "Router", "Routing", "load_balancing_loss", "router_z_loss", "update_correction_bias"]
