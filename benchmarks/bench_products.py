"""Products of a few rows by one weight matrix on the CPU: the three ways ringmoe's float32 products can run.

Side by side, in turns, for each matrix of the small preset (its attention projections, the routers' gate, the LM
head) and of the demo model, at 1 to 512 rows, 2 threads:

- MKL: ``torch.nn.functional.linear`` on the plain weight (what a compiled graph ran before, ``aoti_torch_cpu_mm``;
  the LM head stored input-major as the CPU engine keeps it, ``serve.runner.store_head_input_major``);
- oneDNN: the weight's blocked copy (``torch.ops.mkldnn._linear_pointwise``, the eager copy where ``panel_gemm``
  does not run);
- panels: ``ringmoe::panel_linear`` on the weight's 16-column panel copy (``ringmoe.prepacked``), the C kernel
  called through torch's dispatcher.

Each product's median over many warm calls (the weights stay in the caches: what a decode step's products of
one matrix see when its layers are small); the ratios are the point.  Writes benchmarks/results/products.json
and products.png.

    python benchmarks/bench_products.py [--rows 1,2,5,8,16,32,128,512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, write_results  # noqa: E402

from ringmoe import operators, panel_gemm  # noqa: E402
from ringmoe.prepacked import panel_copy, panel_linear, prepack  # noqa: E402

# (name, out_features, in_features, input-major as the engine keeps the LM head)
MATRICES = [("small: q / o proj", 256, 256, False), ("small: k / v proj", 128, 256, False),
            ("small: router", 8, 256, False), ("small: LM head", 4096, 256, True),
            ("demo: q / o proj", 128, 128, False), ("demo: LM head", 384, 128, True)]


def median_us(fn, budget_s: float = 0.25) -> float:
    """Median microseconds of fn() over calls filling about ``budget_s`` (at least 30), after 10 warm-up calls."""
    for _ in range(10):
        fn()
    times, spent = [], 0.0
    while len(times) < 30 or spent < budget_s:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return 1e6 * statistics.median(times)


def measure(out_features: int, in_features: int, input_major: bool, rows: int, rounds: int = 3) -> dict:
    gen = torch.Generator().manual_seed(out_features * 7 + rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    if input_major:
        weight = weight.t().contiguous().t()
    x = torch.randn(rows, in_features, generator=gen)
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)
    prepack(weight)
    panels = panel_copy(weight)
    ways = {"mkl": lambda: F.linear(x, weight),
            "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
            "panels": lambda: panel_linear(x, panels)}
    reference = F.linear(x.double(), weight.double())
    for name, fn in ways.items():  # all three give the product (float32 rounding)
        torch.testing.assert_close(fn().double(), reference, rtol=1e-4, atol=1e-4, msg=name)
    times = {name: [] for name in ways}
    for _ in range(rounds):  # in turns: a machine whose speed drifts moves every way alike
        for name, fn in ways.items():
            times[name].append(median_us(fn))
    us = {name: statistics.median(values) for name, values in times.items()}
    return {"rows": rows, "us": us, "panels_vs_mkl": us["mkl"] / us["panels"],
            "panels_vs_onednn": us["onednn"] / us["panels"],
            "panels_gflops": 2 * rows * out_features * in_features / us["panels"] / 1e3}


def plot(data, path):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in data.items():
        counts = [r["rows"] for r in rows]
        axes[0].plot(counts, [r["panels_vs_mkl"] for r in rows], marker="o", label=name)
        axes[1].plot(counts, [r["panels_vs_onednn"] for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ("panel_linear vs MKL (plain weight)", "panel_linear vs the oneDNN copy")):
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xlabel("rows")
        ax.set_ylabel("speed-up (x)")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,5,8,16,32,128,512")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not (panel_gemm.available() and operators.c_kernels()):
        raise SystemExit("panel_gemm or its torch operator does not run here (x86-64 with AVX2, a C compiler and "
                         "torch's C shim needed)")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    results = {}
    for name, out_features, in_features, input_major in MATRICES:
        results[name] = []
        for rows in map(int, args.rows.split(",")):
            row = measure(out_features, in_features, input_major, rows)
            results[name].append(row)
            print(f"{name:20s} rows {rows:4d}: mkl {row['us']['mkl']:8.1f} us  onednn {row['us']['onednn']:8.1f} us"
                  f"  panels {row['us']['panels']:8.1f} us  ({row['panels_vs_mkl']:.2f}x / "
                  f"{row['panels_vs_onednn']:.2f}x)", flush=True)
    write_results("products", {"config": {"matrices": [list(m) for m in MATRICES], "threads": args.threads,
                                          "dtype": "float32"}, "products": results}, plot, results)


if __name__ == "__main__":
    main()
