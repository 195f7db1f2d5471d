"""The FP8 KV cache's per-layer scales (``--kv-cache-dtype fp8_e4m3``), measured once when the engine starts.

A cached K (or V) value is stored as the e4m3 code of value / scale (``ringmoe.float8``).  e4m3 keeps 2^-4 relative
precision over 2^-6 .. 448, so a layer's scale only has to put its largest magnitudes below 448 without pushing
the bulk into the subnormals: scale = HEADROOM x (the largest |K| (|V|) the layer produced on a probe) / 448.
Values past the range saturate at +-448 x scale (never NaN).

The probe is one forward of PROBE_TOKENS seeded random token ids through the model itself, every layer attending
densely, with the K/V (MLA: the latent and RoPE key the cache holds) measured as the layer hands them over.
Projections read a normalised hidden state (RMSNorm), so their range depends little on which tokens come; the
headroom covers the rest.  Every rank of a mesh runs the same probe (its MoE exchanges included) and gets the same
scales.  The scales are a pure function of the weights: the same checkpoint always caches the same bytes.
"""

from __future__ import annotations

import torch

from ..attention import flash_attn_func
from ..float8 import FP8_MAX

__all__ = ["KV_CACHE_DTYPES", "kv_cache_is_fp8", "calibrate_kv_scales", "HEADROOM", "PROBE_TOKENS"]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; "auto": the model's dtype; "fp8" means e4m3
HEADROOM = 2.0
PROBE_TOKENS = 256


def kv_cache_is_fp8(kv_cache_dtype: str) -> bool:
    """True for an FP8 cache; ValueError naming the argument for a name ringmoe does not implement."""
    if kv_cache_dtype == "fp8_e5m2":
        raise ValueError("kv_cache_dtype 'fp8_e5m2' is not supported: ringmoe's FP8 KV cache is e4m3 "
                         "('fp8' or 'fp8_e4m3')")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype != "auto"


class _RangeProbe:
    """An ``AttentionBackend`` that attends densely and keeps each layer's largest |K| and |V|."""

    latent_ring = False

    def __init__(self, model, absorbed: bool):
        self.model, self.absorbed = model, absorbed
        self.amax: dict[int, tuple[float, float]] = {}

    def attend(self, layer, q, k, v):
        self.amax[layer] = (k.abs().max().item(), v.abs().max().item())
        return flash_attn_func(q, k, v, causal=True, backend=self.model.backend, **self.model.attention_options(layer))


@torch.no_grad()
def calibrate_kv_scales(model, latent: bool, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale, v_scale), 0-dim float32 tensors on the model's device (MLA: one scale, twice); the
    multi-token prediction modules' layers after the main ones."""
    device = model.embed_tokens.weight.device
    length = PROBE_TOKENS
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (1, length), generator=generator).to(device)
    probe = _RangeProbe(model, absorbed=latent)
    positions = torch.arange(length, device=device)
    hidden = model.hidden_states(ids, positions, probe)
    for depth in range(1, model.config.mtp_layers + 1):  # the MTP modules' caches: they read the tokens ahead
        hidden = model.mtp_hidden_states(hidden, ids.roll(-depth, 1), positions, probe, depth)

    def scale(amax: float) -> torch.Tensor:
        value = HEADROOM * amax / FP8_MAX if amax > 0 and amax == amax else 1.0  # an all-zero (or NaN) layer: 1
        return torch.tensor(value, dtype=torch.float32, device=device)

    layers = model.config.num_layers + model.config.mtp_layers
    return [(scale(probe.amax[i][0]), scale(probe.amax[i][1])) for i in range(layers)]
