"""On-the-fly quantization of a float model, with the recipes the published checkpoints use.

fp8: every projection of attention, the MLPs, shared experts and routed experts in e4m3 with one scale per
``block`` (128 x 128), as DeepSeek-V3 ships; embeddings, the head, norms and routers stay float.  mxfp4: the
routed experts only (32 values per E8M0 scale), as gpt-oss ships.  The result is the model a checkpoint in
that format would load as (``load_checkpoint(..., quantization=...)`` / ``ringmoe serve --quantization``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..moe.quantized_experts import QuantizedSwiGLUExperts
from ..moe.experts import SwiGLUExperts
from ..quant import MX_GROUP, QuantizedLinear, QuantScheme, quantize_fp8, quantize_mxfp4
from .transformer import MoETransformer

__all__ = ["quantize_model", "requested_scheme", "METHODS"]

METHODS = ("fp8", "mxfp4")  # what ``--quantization`` accepts

_FLOAT_ONLY = ("embed_tokens", "lm_head", "router")


def _quantize(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8(weight, scheme.block) if scheme.method == "fp8" else quantize_mxfp4(weight)


def requested_scheme(config, method: str | None) -> QuantScheme | None:
    """The scheme to quantize a checkpoint of ``config`` to on the fly (``--quantization method``); None when
    there is nothing to do (no method, or the checkpoint already ships in it).  ValueError naming
    ``quantization`` for an unknown method, a checkpoint quantized otherwise, or dims the format cannot cut."""
    if method is None:
        return None
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    if config.quantization is not None:
        if config.quantization.method != method:
            raise ValueError(f"quantization {method!r}: the checkpoint ships {config.quantization.method!r} "
                             f"weights (drop --quantization to serve them as they are)")
        return None
    if method == "mxfp4":
        for name in ("hidden_size", "ffn_size"):
            if getattr(config, name) % MX_GROUP:
                raise ValueError(f"quantization 'mxfp4' cuts the experts' rows into groups of {MX_GROUP}: "
                                 f"{name} {getattr(config, name)} is not a multiple of {MX_GROUP}")
    return QuantScheme(method)


@torch.no_grad()
def quantize_model(model: MoETransformer, scheme: QuantScheme) -> MoETransformer:
    """Replace ``model``'s float weights by ``scheme``'s quantized ones, in place; returns the model (its
    config then names the scheme)."""
    if model.config.quantization is not None:
        raise ValueError(f"the model is already quantized ({model.config.quantization.method})")
    swaps = []
    for name, module in model.named_modules():
        if isinstance(module, SwiGLUExperts):
            f = module.ffn_size
            quantized = QuantizedSwiGLUExperts(scheme, module.num_experts, module.hidden_size, f,
                                               module.gate_up_bias is not None, module.limit, module.alpha)
            for target, weight in ((quantized.gate_q, module.gate_up[:, :f]), (quantized.up_q, module.gate_up[:, f:]),
                                   (quantized.down_q, module.down)):
                target.fill(*_quantize(weight, scheme))
            if module.gate_up_bias is not None:
                quantized.gate_up_bias.copy_(module.gate_up_bias)
                quantized.down_bias.copy_(module.down_bias)
            swaps.append((name, quantized, module))
        elif (scheme.method == "fp8" and isinstance(module, nn.Linear)
              and not any(part in name.split(".") for part in _FLOAT_ONLY)):
            quantized = QuantizedLinear(module.in_features, module.out_features, module.bias is not None, scheme)
            quantized.weight_q.fill(*_quantize(module.weight, scheme))
            if module.bias is not None:
                quantized.bias.copy_(module.bias)
            swaps.append((name, quantized, module))
    for name, quantized, old in swaps:
        parent, _, attr = name.rpartition(".")
        param = next(old.parameters())
        setattr(model.get_submodule(parent) if parent else model, attr,
                quantized.to(device=param.device, dtype=param.dtype))
    model.config = model.config.replace(quantization=scheme)
    return model
