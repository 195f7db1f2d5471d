"""GPU check of the quantized kernels (run by benchmarks/gpu.sh on a lent GPU; nothing here runs on a CPU).

1. The dequantizing GEMMs (``quant/triton_gemm.py``): y = x W^T with W in fp8 block-scaled (128 x 128) or mxfp4
   codes, against torch's bf16 GEMM on the dequantized weight (``torch.matmul``, cuBLAS), at decode-like row counts
   (M = 1, 16, 128) and DeepSeek-V3-like shapes (N x K = 7168 x 2048, 2048 x 7168, 4096 x 4096).  Reported: the error
   against the float64 product (bf16 activations, flash-attn's 2x rule against torch's bf16 GEMM), microseconds
   per call (median of CUDA-event timings), and the weight bytes each reads (what bounds decode: 1 byte per
   value fp8, ~0.53 mxfp4, 2 bf16).
2. The paged attention kernel (``attention/triton_paged.py``) over an FP8 cache against the same kernel over a
   bf16 cache: 32 sequences x 4096 cached tokens, 32 heads / 8 K/V heads, D = 128, one query each (decode).

Writes ${OUT:-benchmarks/results}/gpu_quant.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from ringmoe.attention.paged import paged_attention
from ringmoe.float8 import FP8_MAX, encode_e4m3
from ringmoe.quant import QuantizedWeight, QuantScheme, quantize_fp8, quantize_mxfp4
from ringmoe.quant.matmul import fused_linear


def timed(fn, repeat: int = 50) -> float:
    """Median microseconds of fn() by CUDA events."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def gemm_rows() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((7168, 2048), (2048, 7168), (4096, 4096)):
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        for method in ("fp8", "mxfp4"):
            scheme = QuantScheme(method)
            weight = QuantizedWeight(scheme, (n, k)).cuda()
            codes, scales = quantize_fp8(w, scheme.block) if method == "fp8" else quantize_mxfp4(w)
            weight.fill(codes, scales)
            dense = weight.dequantize(dtype=torch.bfloat16)
            for m in (1, 16, 128):
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                exact = x.double() @ dense.double().T
                ours = (fused_linear(x, weight).double() - exact).abs().max().item()
                theirs = ((x @ dense.T).double() - exact).abs().max().item()
                rows.append({"method": method, "m": m, "n": n, "k": k, "error": ours, "torch_bf16_error": theirs,
                             "within_2x": ours <= 2 * theirs,
                             "triton_us": timed(lambda: fused_linear(x, weight)),
                             "torch_bf16_us": timed(lambda: x @ dense.T),
                             "weight_bytes": weight.nbytes, "bf16_weight_bytes": dense.numel() * 2})
                print(rows[-1])
    return rows


def paged_rows() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    seqs, context, heads, kv_heads, dim, block = 32, 4096, 32, 8, 128, 16
    blocks = seqs * context // block
    k = torch.randn(blocks, block, kv_heads, dim, device="cuda", generator=gen)
    v = torch.randn(blocks, block, kv_heads, dim, device="cuda", generator=gen)
    q = torch.randn(seqs, heads, dim, device="cuda", generator=gen).bfloat16()
    scales = (torch.tensor(2 * k.abs().max().item() / FP8_MAX, device="cuda"),
              torch.tensor(2 * v.abs().max().item() / FP8_MAX, device="cuda"))
    k8, v8 = encode_e4m3(k, scales[0]), encode_e4m3(v, scales[1])
    tables = torch.randperm(blocks, device="cuda").view(seqs, -1).tolist()
    cu, contexts = list(range(seqs + 1)), [context] * seqs

    kb, vb = k.bfloat16(), v.bfloat16()

    def bf16():
        return paged_attention(q, kb, vb, cu, contexts, tables, backend="triton")

    def fp8():
        return paged_attention(q, k8, v8, cu, contexts, tables, backend="triton", kv_scales=scales)

    rows = [{"cache": "bf16", "us": timed(bf16), "cache_bytes": 2 * kb.numel() * 2},
            {"cache": "fp8_e4m3", "us": timed(fp8), "cache_bytes": 2 * k8.numel()}]
    error = (fp8().float() - bf16().float()).abs().max().item()
    rows[1]["max_abs_diff_vs_bf16_cache"] = error
    print(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    data = {"device": torch.cuda.get_device_name(), "gemm": gemm_rows(), "paged_attention": paged_rows()}
    path = Path(args.out) / "gpu_quant.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
