"""GPU check of the Triton kernels: exactness at full size, then TFLOP/s vs torch SDPA (and flash-attn).

B=4, H=32, D in (64, 128), N in 1k..16k, bf16, causal and not, forward and
forward+backward.  FLOPs: 4 * B * H * N^2 * D, halved for causal, x2.5 for the
backward (so x3.5 for forward+backward).  Run through benchmarks/gpu.sh.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from ringmoe import flash_attn_func


def check_exactness():
    """Triton vs float64 math on a full-size head slice; bf16 by flash-attn's 2x rule."""
    from ringmoe.attention import AttentionSpec, attention_reference

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, d, causal, window, softcap in ((4096, 128, True, (-1, -1), 0.0), (3001, 64, False, (256, 0), 0.0),
                                          (2048, 64, True, (-1, -1), 30.0)):
        q = torch.randn(1, n, 8, d, device="cuda", generator=gen)
        k = torch.randn(1, n, 2, d, device="cuda", generator=gen)
        v = torch.randn(1, n, 2, d, device="cuda", generator=gen)
        dout = torch.randn(1, n, 8, d, device="cuda", generator=gen)
        spec = AttentionSpec(d**-0.5, causal, window[0], window[1], softcap)
        errs = {}
        for dtype in (torch.bfloat16, torch.float32):
            leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
            out = flash_attn_func(*leaves, causal=causal, window_size=window, softcap=softcap, backend="triton")
            out.backward(dout.to(dtype))
            ref_leaves = [x.to(dtype).double().requires_grad_() for x in (q, k, v)]
            ref, _ = attention_reference(*ref_leaves, spec)
            ref.backward(dout.to(dtype).double())
            plain_leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
            plain, _ = attention_reference(*plain_leaves, spec, compute_dtype=dtype)
            plain.backward(dout.to(dtype))
            for name, a, b, c in (("out", out, ref, plain),
                                  *((f"d{x}", la.grad, lr.grad, lp.grad) for x, la, lr, lp in
                                    zip("qkv", leaves, ref_leaves, plain_leaves))):
                ours = (a.double() - b).abs().max().item()
                theirs = (c.double() - b).abs().max().item()
                errs[f"{dtype}/{name}"] = {"ours": ours, "plain": theirs, "ok": ours <= 2 * theirs + 1e-6}
        rows.append({"n": n, "d": d, "causal": causal, "window": window, "softcap": softcap, "errors": errs})
        print(n, d, causal, window, softcap, all(e["ok"] for e in errs.values()), flush=True)
    return rows


def flash_attn_peer():
    try:
        from flash_attn import flash_attn_func as fa

        return fa
    except Exception:
        return None


def bench(quick):
    results = []
    sizes = [1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384]
    fa = flash_attn_peer()
    for d in (64, 128):
        for n in sizes:
            for causal in (False, True):
                b, h = 4, 32
                q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                impls = {
                    "ringmoe_triton": lambda x, y, z: flash_attn_func(x, y, z, causal=causal, backend="triton"),
                    "torch_sdpa": lambda x, y, z: F.scaled_dot_product_attention(
                        x.transpose(1, 2), y.transpose(1, 2), z.transpose(1, 2), is_causal=causal).transpose(1, 2),
                }
                if fa is not None:
                    impls["flash_attn_2"] = lambda x, y, z: fa(x, y, z, causal=causal)
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                for name, fn in impls.items():
                    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                    fwd_ms = triton.testing.do_bench(lambda: fn(*leaves))
                    out = fn(*leaves)
                    bwd_ms = triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True))
                    row = dict(impl=name, d=d, n=n, causal=causal, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                               fwd_tflops=flops / fwd_ms / 1e9, bwd_tflops=2.5 * flops / bwd_ms / 1e9)
                    results.append(row)
                    print(f"{name:15s} D={d:3d} N={n:6d} causal={causal!s:5s} fwd {row['fwd_tflops']:6.1f} "
                          f"TFLOP/s  bwd {row['bwd_tflops']:6.1f} TFLOP/s", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "exactness": check_exactness(), "timing": bench(args.quick)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_attention.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
