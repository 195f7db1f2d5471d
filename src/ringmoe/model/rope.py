"""Rotary position embeddings and their long-context scalings (linear, YaRN, Llama 3), as transformers has them.

Pair i of a head (dimensions i and i + D/2) turns by position * inv_freq[i] with
inv_freq[i] = theta^(-2i/D).  The scalings change inv_freq (and YaRN the magnitude):

* linear:  inv_freq / factor (positions interpolated by ``factor``).
* llama3:  wavelengths 2 pi / inv_freq longer than original_max / low_freq_factor are divided by
  ``factor``; shorter than original_max / high_freq_factor kept; in between, a blend whose weight
  s = (original_max / wavelength - low) / (high - low) goes linearly from interpolated to kept.
* yarn:    per pair a blend of interpolated (inv_freq / factor) and kept frequencies with a linear ramp
  between the pairs that turn beta_fast and beta_slow times over the original context
  (d(r) = D ln(original_max / (2 pi r)) / (2 ln theta), floored / ceiled unless ``truncate`` is false);
  cos and sin are multiplied by attention_factor (default 0.1 ln(factor) + 1, or the ratio of the
  mscale terms when ``mscale`` and ``mscale_all_dim`` are given), which scales every q.k by its square.

Angles are computed in float32 as transformers does, so logits match its models.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_rope_scaling", "inv_freq", "attention_factor", "rope_tables", "apply_rope"]

_TYPES = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings"),
          "yarn": ("factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling: dict) -> None:
    """ValueError naming the field unless ``scaling`` is empty or a complete linear / llama3 / yarn description."""
    if not scaling:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in _TYPES:
        raise ValueError(f"rope_type must be one of default, {', '.join(_TYPES)}; got {kind!r}")
    for name in _TYPES[kind]:
        value = scaling.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope scaling {kind!r} needs a positive {name}, got {value!r}")


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim / 2,) float32, attention_factor) for ``scaling`` (empty: plain RoPE)."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return base, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return base / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / base
        scaled = torch.where(wavelength > original / low, base / factor, base)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < original / high) * ~(wavelength > original / low)
        return torch.where(medium, blended, scaled), 1.0
    # yarn
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp                                   # 1: the original frequency, 0: interpolated
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, attention_factor(scaling)


def attention_factor(scaling: dict | None) -> float:
    """The factor of cos and sin: YaRN's (the ``attention_factor`` given, else from its mscale terms), else 1."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "yarn":
        return 1.0
    factor, given = float(scaling["factor"]), scaling.get("attention_factor")
    if given is not None:
        return float(given)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)


def rope_tables(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                scaling: dict | None = None, freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (S, head_dim) for integer positions pos (S,), both halves of a head turning together.  freqs:
    ``inv_freq``'s (head_dim / 2,) for these arguments, computed before (a compiled decode step takes them as an
    input: traced, theta's powers are computed again for every element of every kernel that reads the tables)."""
    if freqs is None:
        freqs, factor = inv_freq(head_dim, theta, scaling, pos.device)
    else:
        factor = attention_factor(scaling)
    angles = pos.float()[:, None] * freqs[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, S, heads, D) by position: pairs (x_i, x_{i+D/2}) turn by their angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)  # autocast: stay in x's dtype
