"""y = x W^T with W quantized (FP8 block-scaled or MXFP4) as one Triton kernel: each tile of W is decoded in registers.

One program per (BLOCK_M rows of x, BLOCK_N rows of W).  It walks the input dim in steps of BLOCK_K: loads the x
tile, loads the codes of the W tile (one byte per value for fp8, one byte per two values for mxfp4) with their
scales, decodes them (``ringmoe.float8_triton``: integer and float arithmetic, no fp8 hardware needed), and
accumulates the tile product in float32.  W is read from memory at its stored width (1 or ~0.53 bytes per value) and
never exists in floats outside the registers of one tile, which is what bounds a decode step (weights read per token).

- fp8: codes (N, K) uint8 (e4m3 bits), scales (ceil(N / bo), ceil(K / bi)) float32: w[n, k] = code x S[n // bo, k // bi]
  (partial edge blocks included);
- mxfp4: codes (N, K / 32, 16) uint8 (two e2m1 codes per byte, low nibble first), scales (N, K / 32) uint8 E8M0:
  w[n, k] = e2m1(nibble k % 2 of byte k // 2) x 2^(S[n, k // 32] - 127).

Tile sizes are fixed (not chosen by the batch), so a row's result never depends on the other rows of x: the
engine's deterministic mode holds.  Runs on CUDA tensors, or on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..float8_triton import e2m1, e4m3, e8m0

__all__ = ["triton_fp8_linear", "triton_mxfp4_linear"]

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _dequant_matmul(X, C, S, Y, M, N, K, stride_xm, stride_cn, stride_sn, stride_ym, block_rows, block_cols,
                    MX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        if MX:  # byte k // 2 of the row holds value k in its low (k even) or high (k odd) nibble
            byte = tl.load(C + offs_n[:, None] * stride_cn + offs_k[None, :] // 2, mask=w_mask, other=0).to(tl.int32)
            code = tl.where(offs_k[None, :] % 2 == 0, byte & 0xF, byte >> 4)
            scale = tl.load(S + offs_n[:, None] * stride_sn + offs_k[None, :] // 32, mask=w_mask, other=127)
            w = e2m1(code) * e8m0(scale)
        else:
            code = tl.load(C + offs_n[:, None] * stride_cn + offs_k[None, :], mask=w_mask, other=0)
            scale = tl.load(S + (offs_n[:, None] // block_rows) * stride_sn + offs_k[None, :] // block_cols,
                            mask=w_mask, other=0.0)
            w = e4m3(code) * scale
        w = tl.where(w_mask, w, 0.0).to(x.dtype)
        if IEEE:  # float32 inputs: exact float32 products (no TF32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=y_mask)


def _launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int, mx: bool,
            block: tuple[int, int]) -> torch.Tensor:
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, in_features).contiguous()
    codes, scales = codes.contiguous(), scales.contiguous()
    y = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(max(x2.shape[0], 1), BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    _dequant_matmul[grid](x2, codes, scales, y, x2.shape[0], out_features, in_features, x2.stride(0),
                          codes.stride(0), scales.stride(0), y.stride(0), block[0], block[1],
                          MX=mx, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return y.reshape(*lead, out_features)


def triton_fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """x (..., K) float16 / bfloat16 / float32; codes (N, K) uint8 e4m3 bits; scales (ceil(N / bo), ceil(K / bi))
    float32 -> x W^T (..., N) in x's dtype."""
    if codes.dim() != 2 or codes.shape[1] != x.shape[-1]:
        raise ValueError(f"codes must be (N, {x.shape[-1]}), got {tuple(codes.shape)}")
    return _launch(x, codes, scales.float(), codes.shape[0], False, block)


def triton_mxfp4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (..., K); codes (N, K / 32, 16) uint8; scales (N, K / 32) uint8 -> x W^T (..., N) in x's dtype."""
    if codes.dim() != 3 or codes.shape[1] * 32 != x.shape[-1] or codes.shape[2] != 16:
        raise ValueError(f"codes must be (N, {x.shape[-1] // 32}, 16), got {tuple(codes.shape)}")
    return _launch(x, codes.flatten(1), scales, codes.shape[0], True, (1, 1))
