"""A MoE layer's sorted per-expert GEMMs as one opaque operator of a compiled graph (``ringmoe::grouped_experts``).

The sorted form splits the tokens by expert, and the split depends on the routing: traced by torch.compile it would
break the graph in every MoE layer, and the frame that resumes each layer after the break is compiled once per layer
(it guards on the layer's place in the step), so a model with more MoE layers than torch's recompile limit falls back
to eager for its later layers.  As a custom operator the whole computation is one node of the graph: torch.compile
sees only its signature (x (T, H) and the routing in, (T, H) out: ``register_fake``) and the decode step stays one
graph whatever the number of layers.

An operator takes tensors and numbers, not modules: each ``MoELayer`` registers itself here under an int key (a
weak reference: a layer that is freed leaves the table) and the graph calls the operator with its key; a deep copy
of a layer re-registers before it is traced (``MoELayer.register_op``).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ..operators import LIBRARY

__all__ = ["register_layer", "is_registered", "grouped_experts", "bind_experts"]

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_layer(layer) -> int:
    """A key under which ``grouped_experts`` finds ``layer`` (anything with ``_local_experts``)."""
    key = next(_KEYS)
    _LAYERS[key] = layer
    return key


def is_registered(key: int, layer) -> bool:
    return _LAYERS.get(key) is layer


# Declared through ``torch.library.Library`` (``ringmoe.operators``) rather than ``torch.library.custom_op``: the
# latter wraps every call in its own Python layers (autograd and device checks, schema handling), ~40 us a call
# measured on 2 CPU threads, per MoE layer per decode step; a kernel registered on the dispatcher is called directly
# (the decode step never asks for gradients: no autograd formula is registered, and a backward through the operator
# raises).  Where the C kernels are registered (``operators.c_kernels``) a layer whose panel copies are bound
# (``MoELayer.bind_c_experts``) runs in C without entering Python; any other goes on to the kernel below.


def _grouped_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, layer: int) -> torch.Tensor:
    """The routed output (T, H) in x's dtype of layer ``layer``'s experts for x (T, H), topk_idx / topk_weight
    (T, k): tokens sorted by expert, one GEMM pair per expert, dropless."""
    y = _LAYERS[layer].grouped_local(x, topk_idx, topk_weight)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _grouped_experts_shape(x, topk_idx, topk_weight, layer):
    return torch.empty_like(x)


for _name in ("grouped_experts", "grouped_experts_python"):
    LIBRARY.impl(_name, _grouped_experts, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ringmoe::{_name}", _grouped_experts_shape, lib=LIBRARY)
grouped_experts = torch.ops.ringmoe.grouped_experts.default
bind_experts = torch.ops.ringmoe.bind_experts.default
