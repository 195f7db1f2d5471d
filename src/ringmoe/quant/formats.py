"""The two weight formats checkpoints ship in: FP8 e4m3 with block scales, and MXFP4 (OCP microscaling FP4).

FP8 block-wise (DeepSeek-V3/R1, Qwen3-*-FP8; ``quant_method: "fp8"``, ``weight_block_size: [bo, bi]``):
a weight W (out, in) is stored as e4m3 codes C (out, in) and one float32 ``weight_scale_inv`` S per bo x bi
block, S (ceil(out / bo), ceil(in / bi)); the last row and column of blocks may be partial.  The weight is
W[r, c] = C[r, c] * S[r // bo, c // bi].

MXFP4 (gpt-oss's experts; ``quant_method: "mxfp4"``): a weight (out, in) is cut along ``in`` into groups of 32
values.  Each group is 16 bytes ``*_blocks`` (out, in / 32, 16), two e2m1 codes per byte (low nibble first), and
one E8M0 byte ``*_scales`` (out, in / 32): the value is e2m1(code) * 2^(scale - 127).  e2m1 is a sign bit, two
exponent bits and one mantissa bit: the 16 codes are +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.

Every function works on leading batch dims (experts stacked first) and never reads what it is not given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..float8 import FP8_MAX, e4m3_to_float

__all__ = ["QuantScheme", "scheme_from_hf", "scale_shape", "dequantize_fp8", "quantize_fp8", "dequantize_mxfp4",
           "quantize_mxfp4", "e4m3_to_float", "E2M1_VALUES", "MX_GROUP", "FP8_MAX"]

MX_GROUP = 32          # values per MXFP4 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's weight format: ``method`` "fp8" (with ``block`` = (rows, cols) per scale) or "mxfp4"."""

    method: str
    block: tuple[int, int] = (128, 128)

    def __post_init__(self):
        if self.method not in ("fp8", "mxfp4"):
            raise ValueError(f"quantization method must be 'fp8' or 'mxfp4', got {self.method!r}")
        if self.method == "fp8" and not (len(self.block) == 2 and all(isinstance(b, int) and b > 0
                                                                        for b in self.block)):
            raise ValueError(f"weight_block_size must be two positive ints, got {self.block!r}")

    def bytes_per_value(self) -> float:
        """Resident bytes per weight value, scales included (fp8: 1 + 4 / (bo bi); mxfp4: 0.5 + 1 / 32)."""
        if self.method == "fp8":
            return 1.0 + 4.0 / (self.block[0] * self.block[1])
        return 0.5 + 1.0 / MX_GROUP

    def to_hf(self) -> dict:
        """config.json's quantization_config for this scheme."""
        if self.method == "fp8":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.block)}
        return {"quant_method": "mxfp4"}


def scheme_from_hf(quantization) -> QuantScheme:
    """The scheme of config.json's ``quantization_config``; ValueError naming what ringmoe does not implement."""
    method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
    if method == "fp8":
        fmt = quantization.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config fmt {fmt!r} is not supported: ringmoe loads fp8 e4m3 weights")
        if quantization.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("quantization_config activation_scheme 'static' is not supported: ringmoe computes "
                             "activations in floating point (the 'dynamic' scheme's weights)")
        block = quantization.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise ValueError(f"quantization_config weight_block_size must be two positive ints (per-block fp8), "
                             f"got {block!r}: per-tensor and per-channel fp8 are not supported")
        return QuantScheme("fp8", (block[0], block[1]))
    if method == "mxfp4":
        return QuantScheme("mxfp4")
    raise ValueError(f"quantization_config (quant_method {method!r}) is not supported: ringmoe loads float16, "
                     f"bfloat16 and float32 weights, fp8 block-wise (quant_method 'fp8') and mxfp4 experts")


def scale_shape(scheme: QuantScheme, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape for a weight of ``shape`` (..., out, in) (mxfp4: ``in`` must be a multiple of 32)."""
    *lead, rows, cols = shape
    if scheme.method == "fp8":
        bo, bi = scheme.block
        return (*lead, -(-rows // bo), -(-cols // bi))
    return (*lead, rows, cols // MX_GROUP)


def dequantize_fp8(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (..., out, in) float8_e4m3fn, scale_inv (..., ceil(out / bo), ceil(in / bi)) float32 ->
    the weight (..., out, in) in ``dtype``; partial edge blocks take their block's scale."""
    rows, cols = codes.shape[-2:]
    bo, bi = block
    values = e4m3_to_float(codes)                       # the codes' values x 2^-8, exact
    scale_inv = scale_inv.float() * 256.0               # the 2^8 back, in the scales (exact: a power of two)
    if rows % bo == 0 and cols % bi == 0:  # whole blocks: the scales broadcast over a (R, bo, C, bi) view
        tiles = values.unflatten(-1, (-1, bi)).unflatten(-3, (-1, bo))
        return tiles.mul_(scale_inv[..., :, None, :, None]).flatten(-2).flatten(-3, -2).to(dtype)
    # scale of every (row, col): repeat each block's scale over its rows and columns, then cut the overhang
    scale = scale_inv.repeat_interleave(bo, dim=-2)[..., :rows, :].repeat_interleave(bi, dim=-1)[..., :cols]
    return values.mul_(scale).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (..., out, in) float -> (codes float8_e4m3fn, scale_inv float32): each block's largest magnitude maps
    to 448 (e4m3's largest value), an all-zero block gets scale 1."""
    rows, cols = weight.shape[-2:]
    bo, bi = block
    lead = weight.shape[:-2]
    w = weight.float()
    padded = torch.nn.functional.pad(w, (0, -cols % bi, 0, -rows % bo))
    tiles = padded.unflatten(-1, (-1, bi)).unflatten(-3, (-1, bo))          # (..., R, bo, C, bi)
    amax = tiles.abs().amax(dim=(-3, -1))                                     # (..., R, C)
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (tiles / scale_inv[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return codes.reshape(*lead, rows, cols).to(torch.float8_e4m3fn), scale_inv


def _e2m1_table(dtype, device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., out, in / 32, 16) uint8, scales (..., out, in / 32) uint8 -> the weight (..., out, in)."""
    # one lookup per byte: the (low, high) pair of values each of the 256 bytes holds, low nibble first
    table = _e2m1_table(torch.float32, blocks.device)
    pairs = torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=-1)   # (256, 2)
    values = torch.nn.functional.embedding(blocks.int(), pairs).flatten(-2)            # (..., out, G, 32)
    # E8M0: a bare biased exponent, 2^(scale - 127); multiplying by a power of two is exact
    factor = torch.ldexp(torch.ones(scales.shape, device=blocks.device), scales.to(torch.int32) - 127)
    return values.mul_(factor[..., None]).flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (..., out, in) float, ``in`` a multiple of 32 -> (blocks uint8 (..., out, in/32, 16), scales uint8):
    per group, the shared exponent is floor(log2(amax)) - 2 (OCP MX: e2m1's largest exponent is 2), each value
    rounded to the nearest e2m1 code (values beyond 6 saturate)."""
    cols = weight.shape[-1]
    if cols % MX_GROUP:
        raise ValueError(f"mxfp4 needs the input dim to be a multiple of {MX_GROUP}, got {cols}")
    groups = weight.float().unflatten(-1, (-1, MX_GROUP))                     # (..., out, G, 32)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2, torch.zeros_like(amax))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(amax), exponent.to(torch.int32))[..., None]
    table = _e2m1_table(torch.float32, weight.device)
    codes = (scaled[..., None] - table).abs().argmin(dim=-1).to(torch.uint8)  # nearest of the 16 codes
    codes = torch.where((scaled < 0) & (codes == 0), torch.full_like(codes, 8), codes)  # keep -0.0 as -0.0
    pairs = codes.unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()
