"""Triton decoders of the narrow float codes (loaded only by Triton kernels: the package imports without Triton).

Both decode with integer and float arithmetic only, not Triton's fp8 types: the same code runs on every GPU (FP8
hardware or not) and under Triton's CPU interpreter, which the tests use.

- ``e4m3``: float8_e4m3fn bits (uint8) -> float32: (-1)^s 2^(e - 7) (1 + m / 8) for e > 0, (-1)^s m 2^-9 for e = 0,
  NaN for 0x7F / 0xFF.
- ``e2m1``: a 4-bit MXFP4 code -> float32: (-1)^s 2^(e - 1) (1 + m / 2) for e > 0, (-1)^s m / 2 for e = 0
  (the codes +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}).
- ``e8m0``: an MX scale byte -> 2^(byte - 127).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["e4m3", "e2m1", "e8m0"]


@triton.jit
def _minifloat(bits, MANTISSA_BITS: tl.constexpr, EXPONENT_MASK: tl.constexpr, SIGN_SHIFT: tl.constexpr,
               BIAS: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """Sign, exponent and mantissa fields -> float32: 2^(e - bias) (1 + m / 2^M) for e > 0, m x SUBNORMAL_STEP
    (= 2^(1 - bias - M)) for e = 0; returns (value, the code as int32)."""
    b = bits.to(tl.int32)
    exponent = (b >> MANTISSA_BITS) & EXPONENT_MASK
    mantissa = (b & ((1 << MANTISSA_BITS) - 1)).to(tl.float32)
    normal = (1.0 + mantissa / (1 << MANTISSA_BITS)) * tl.exp2((exponent - BIAS).to(tl.float32))
    magnitude = tl.where(exponent == 0, mantissa * SUBNORMAL_STEP, normal)
    sign = (b >> SIGN_SHIFT) & 1
    return tl.where(sign != 0, -magnitude, magnitude), b


@triton.jit
def e4m3(bits):
    value, b = _minifloat(bits, 3, 0xF, 7, 7, 0.001953125)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def e2m1(code):
    value, _ = _minifloat(code, 1, 0x3, 3, 1, 0.5)
    return value


@triton.jit
def e8m0(bits):
    return tl.exp2((bits.to(tl.int32) - 127).to(tl.float32))
