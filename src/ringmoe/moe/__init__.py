"""Mixture of experts: routers, dispatch (permute / capacity / unpermute), grouped experts, MoELayer."""

from .balance import ReplicaPlan, plan_replicas
from .layer import MoELayer
from .router import Router, Routing, load_balancing_loss, router_z_loss, update_correction_bias
from .stats import MoEStats, RouterSums

__all__ = ["ReplicaPlan", "plan_replicas", "MoELayer", "MoEStats", "RouterSums", "Router", "Routing", "load_balancing_loss", "router_z_loss", "update_correction_bias"]
