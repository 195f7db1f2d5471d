"""Mixture of experts: routers, dispatch (permute / capacity / unpermute), grouped experts, MoELayer."""

from .balance import ReplicaPlan, plan_replicas
from .layer import MoELayer, MoEStats
from .router import Router, Routing, load_balancing_loss, router_z_loss, update_correction_bias

__all__ = ["ReplicaPlan", "plan_replicas", "MoELayer", "MoEStats", "Router", "Routing", "load_balancing_loss", "router_z_loss", "update_correction_bias"]
