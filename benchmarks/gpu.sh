#!/usr/bin/env bash
# One script for a lent GPU machine (H100/H200 class): correctness at full sizes, then
# Triton FlashAttention vs torch SDPA (and flash-attn if it imports) in bf16, then the engine decode step.
# Usage: bash benchmarks/gpu.sh [quick]   -> results in ${OUT:-benchmarks/results}/gpu_attention.json
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 benchmarks/bench_gpu.py --out "${OUT:-benchmarks/results}" ${1:+--quick}
# the engine's decode step, eager vs the compiled decode graph (CUDA graphs through torch.compile's
# "reduce-overhead"), batch 1-64
python3 benchmarks/bench_decode.py --device cuda --name decode_gpu
cp benchmarks/results/decode_gpu.json benchmarks/results/decode_gpu.png "${OUT:-benchmarks/results}/" 2>/dev/null || true
# the quantized kernels: dequantizing fp8 / mxfp4 GEMMs vs torch's bf16 GEMM, paged attention over an FP8 cache
python3 benchmarks/bench_gpu_quant.py --out "${OUT:-benchmarks/results}"
