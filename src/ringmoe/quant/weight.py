"""A quantized weight held as it ships: codes and scales as buffers, dequantized only a slice at a time.

The buffers keep their bit patterns whatever ``module.to(dtype)`` does: fp8 codes are stored as uint8 and fp8
scales as the int32 bits of their float32 values (a float buffer would be rounded to bfloat16 by
``model.to(torch.bfloat16)``; the codes would be widened to 4 bytes).  A zero-size float buffer follows the
module's dtype and device and tells the dtype to dequantize to.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .formats import MX_GROUP, QuantScheme, dequantize_fp8, dequantize_mxfp4, scale_shape

__all__ = ["QuantizedWeight"]


class QuantizedWeight(nn.Module):
    """A weight of ``shape`` (..., out, in) in ``scheme``: ``dequantize(index, rows)`` gives a float slice.

    fp8: codes (..., out, in) uint8 (e4m3 bits), scales (..., ceil(out/bo), ceil(in/bi)) int32 (float32 bits).
    mxfp4: codes (..., out, in/32, 16) uint8, scales (..., out, in/32) uint8 (E8M0).
    """

    def __init__(self, scheme: QuantScheme, shape: tuple[int, ...]):
        super().__init__()
        self.scheme, self.shape = scheme, tuple(shape)
        rows, cols = self.shape[-2:]
        if scheme.method == "mxfp4":
            if cols % MX_GROUP:
                raise ValueError(f"an mxfp4 weight's input dim must be a multiple of {MX_GROUP}, got shape {shape}")
            codes = torch.zeros(*self.shape[:-1], cols // MX_GROUP, 16, dtype=torch.uint8)
            scales = torch.full(scale_shape(scheme, self.shape), 127, dtype=torch.uint8)
        else:
            codes = torch.zeros(self.shape, dtype=torch.uint8)
            scales = torch.zeros(scale_shape(scheme, self.shape), dtype=torch.int32)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("dtype_probe", torch.zeros(0), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype the weight dequantizes to (follows ``module.to(dtype)``)."""
        return self.dtype_probe.dtype

    @property
    def nbytes(self) -> int:
        """Resident bytes: codes and scales."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def expected(self, index: int | None = None) -> tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype]:
        """(codes shape, codes dtype, scales shape, scales dtype) as a checkpoint stores them (one expert's if
        ``index`` is given: the leading dim dropped)."""
        codes, scales = tuple(self.codes.shape), tuple(self.scales.shape)
        if index is not None:
            codes, scales = codes[1:], scales[1:]
        if self.scheme.method == "fp8":
            return codes, torch.float8_e4m3fn, scales, torch.float32
        return codes, torch.uint8, scales, torch.uint8

    @torch.no_grad()
    def fill(self, codes: torch.Tensor, scales: torch.Tensor, index: int | None = None) -> None:
        """Copy a checkpoint's codes and scales (in ``expected`` dtypes and shapes) in, whole or at ``index``."""
        if self.scheme.method == "fp8":
            codes, scales = codes.view(torch.uint8), scales.float().view(torch.int32)
            if ((codes & 0x7F) == 0x7F).any():
                raise ValueError("fp8 weight codes hold NaN (e4m3fn 0x7F / 0xFF): not a weight")
            if not torch.isfinite(scales.view(torch.float32)).all():
                raise ValueError("fp8 weight_scale_inv holds inf or NaN")
        elif (scales == 0xFF).any():
            raise ValueError("mxfp4 scales hold E8M0 NaN (0xFF)")
        (self.codes if index is None else self.codes[index]).copy_(codes)
        (self.scales if index is None else self.scales[index]).copy_(scales)

    def dequantize(self, index: torch.Tensor | int | None = None, rows: slice | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight (..., out, in), or its experts ``index`` (leading dim), or its output ``rows``
        (fp8: a slice whose start is a multiple of the block height, so its scales are whole block rows)."""
        codes, scales = self.codes, self.scales
        if index is not None:
            codes, scales = codes[index], scales[index]
        dtype = dtype or self.dtype
        if self.scheme.method == "mxfp4":
            if rows is not None:
                codes, scales = codes[..., rows, :, :], scales[..., rows, :]
            return dequantize_mxfp4(codes, scales, dtype)
        bo = self.scheme.block[0]
        if rows is not None:
            start, stop = rows.start or 0, min(rows.stop, codes.shape[-2])
            codes, scales = codes[..., start:stop, :], scales[..., start // bo: -(-stop // bo), :]
        return dequantize_fp8(codes.view(torch.float8_e4m3fn), scales.view(torch.float32), self.scheme.block, dtype)

    def extra_repr(self) -> str:
        return f"{self.scheme.method}, shape={self.shape}"
