"""FlashAttention as fused Triton kernels (forward, and the FA2 backward as three kernels).

Forward: one program per (query tile, batch * head).  The query tile stays in
registers/SRAM; K/V tiles stream past it; the online softmax runs in base 2
(scores are pre-multiplied by scale * log2(e), so exp2 replaces exp); the
output and lse are written once.  Key tiles every row of the query tile sees
run without any mask; only the tiles on the band edges (the causal diagonal,
window borders, the ragged end) compute a mask; tiles outside the band are
never visited.  GQA reads kv head h // group.  head_dim is padded to a power
of two inside the kernel.

Backward: a preprocess kernel computes delta = rowsum(dO * O); a dK/dV kernel
runs one program per (key tile, batch * kv head) and loops over the query heads
of its group, so GQA gradients are summed in registers (deterministic, no
atomics); a dQ kernel runs one program per (query tile, batch * head).

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, for tests).  Triton is optional: importing this module
without it raises ImportError, which the backend registry reports.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .mask import AttentionSpec

__all__ = ["triton_forward", "triton_backward", "triton_unsupported"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (Triton's own switch)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unsupported(q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> str | None:
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        return "backend='triton' needs CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1, on CPU)"
    if q.dtype not in SUPPORTED:
        return f"backend='triton' supports float16, bfloat16 and float32, got {q.dtype}"
    return None


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with float32 accumulation; exact float32 products (no TF32) for float32 inputs."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _key_range(start_m, seqlen_q, seqlen_k, offset, left, right,
               BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Keys [lo, hi) that some row of the query tile starting at start_m sees, and its last row."""
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    lo = seqlen_k * 0
    hi = seqlen_k + 0
    if HAS_RIGHT:
        hi = tl.minimum(seqlen_k, last_m + offset + right + 1)
    if HAS_LEFT:
        lo = tl.maximum(0, start_m + offset - left)
    return lo, hi, last_m


@triton.jit
def _rows(base, b, head, stride_b, stride_h, stride_s, offs, offs_d):
    """Pointers (len(offs), BLOCK_D) to rows ``offs`` of (batch b, head) in a (B, S, H, D) tensor."""
    return base + b * stride_b + head * stride_h + offs[:, None] * stride_s + offs_d[None, :]


@triton.jit
def _query_tile(heads, group, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (batch, head, kv head, first row, rows, head-dim lanes); grid = (query tiles, B * H)."""
    pid_bh = tl.program_id(1)
    h = pid_bh % heads
    start_m = tl.program_id(0) * BLOCK_M
    return pid_bh // heads, h, h // group, start_m, start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)


@triton.jit
def _load_rows(X, b, h, sb, sh, sm, offs_m, offs_d, seqlen, HEAD_DIM: tl.constexpr):
    """(mask, tile): rows offs_m of head h, zero past the sequence and the head dim."""
    mask = (offs_m[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    return mask, tl.load(_rows(X, b, h, sb, sh, sm, offs_m, offs_d), mask=mask, other=0.0)


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at +-inf
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores(q, k, offs_m, cols, seqlen_k, lo, hi, offset, left, right, scale, softcap,
            MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
            SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Scores of a (BLOCK_M, BLOCK_N) tile in log2 units, -inf where masked."""
    s = _dot(q, tl.trans(k), IEEE)
    if SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap)) * 1.4426950408889634
    else:
        s = s * (scale * 1.4426950408889634)
    if MASKED:
        visible = (cols[None, :] >= lo) & (cols[None, :] < hi) & (cols[None, :] < seqlen_k)
        if HAS_RIGHT:
            visible = visible & (cols[None, :] <= offs_m[:, None] + offset + right)
        if HAS_LEFT:
            visible = visible & (cols[None, :] >= offs_m[:, None] + offset - left)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, skn, svn, start, stop, offs_m, offs_n, offs_d,
               seqlen_k, lo, hi, offset, left, right, scale, softcap,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + cols[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        # a masked run covers keys [start, stop) only: its last tile may overlap the next run
        s = _scores(q, k, offs_m, cols, seqlen_k, tl.maximum(lo, start), tl.minimum(hi, stop), offset, left, right,
                    scale, softcap, MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)  # rescale earlier sums to the new maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                sqb, sqm, sqh, skb, skn, skh, svb, svn, svh, sob, som, soh, slb, slh,
                seqlen_q, seqlen_k, heads, group, offset, left, right, scale, softcap,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    b, h, kvh, start_m, offs_m, offs_d = _query_tile(heads, group, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_mask, q = _load_rows(Q, b, h, sqb, sqh, sqm, offs_m, offs_d, seqlen_q, HEAD_DIM)
    k_base = K + b * skb + kvh * skh
    v_base = V + b * svb + kvh * svh

    # keys any row of this tile sees: [lo, hi); keys every row sees: [full_lo, full_hi)
    lo, hi, last_m = _key_range(start_m, seqlen_q, seqlen_k, offset, left, right, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    full_lo = lo
    full_hi = hi
    if HAS_RIGHT:
        full_hi = tl.minimum(hi, start_m + offset + right + 1)
    if HAS_LEFT:
        full_lo = tl.maximum(lo, last_m + offset - left)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(full_hi, full_lo)
    full_end = full_lo + ((full_hi - full_lo) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # edge tiles before the fully visible run (window's left border)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, skn, svn, lo, full_lo, offs_m, offs_n, offs_d,
                               seqlen_k, lo, hi, offset, left, right, scale, softcap,
                               HEAD_DIM, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, IEEE)
    # fully visible tiles: no mask at all
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, skn, svn, full_lo, full_end, offs_m, offs_n,
                               offs_d, seqlen_k, lo, hi, offset, left, right, scale, softcap,
                               HEAD_DIM, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, IEEE)
    # edge tiles after it (the causal diagonal, the window's right border, the ragged end)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, skn, svn, full_end, hi, offs_m, offs_n, offs_d,
                               seqlen_k, lo, hi, offset, left, right, scale, softcap,
                               HEAD_DIM, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, IEEE)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(_rows(O, b, h, sob, soh, som, offs_m, offs_d), out.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + b * slb + h * slh + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit
def _bwd_preprocess(O, DO, DLSE, DELTA, som, sdm, rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    """delta[r] = sum_d dO[r, d] * O[r, d] (- dlse[r]) over rows flattened as (B * S * H)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < rows) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + offs_m[:, None] * som + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs_m[:, None] * sdm + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + offs_m, mask=offs_m < rows, other=0.0)
    tl.store(DELTA + offs_m, delta, mask=offs_m < rows)


@triton.jit
def _ds_tile(q, k, v, do, lse, delta, offs_m, cols, seqlen_k, lo, hi, offset, left, right, scale, softcap,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """(p, dS) of a (BLOCK_M, BLOCK_N) tile; dS is w.r.t. the raw score q.k (before scale)."""
    raw = _dot(q, tl.trans(k), IEEE)
    dp = _dot(do, tl.trans(v), IEEE)
    if SOFTCAP:
        t = _tanh(raw * (scale / softcap))
        s = softcap * t
    else:
        s = raw * scale
    visible = (cols[None, :] >= lo) & (cols[None, :] < hi) & (cols[None, :] < seqlen_k)
    if HAS_RIGHT:
        visible = visible & (cols[None, :] <= offs_m[:, None] + offset + right)
    if HAS_LEFT:
        visible = visible & (cols[None, :] >= offs_m[:, None] + offset - left)
    p = tl.where(visible, tl.math.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p, ds * scale


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     sqb, sqm, sqh, skb, skn, skh, svb, svn, svh, sdb, sdm, sdh, slb, slh,
                     sdkb, sdkn, sdkh, sdvb, sdvn, sdvh,
                     seqlen_q, seqlen_k, kv_heads, group, offset, left, right, scale, softcap,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_mm = tl.arange(0, BLOCK_M)
    kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(_rows(K, b, kvh, skb, skh, skn, cols, offs_d), mask=kv_mask, other=0.0)
    v = tl.load(_rows(V, b, kvh, svb, svh, svn, cols, offs_d), mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # queries that can see any key of this tile
    last_n = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    q_lo = seqlen_q * 0
    q_hi = seqlen_q + 0
    if HAS_RIGHT:
        q_lo = tl.maximum(0, start_n - offset - right)
    if HAS_LEFT:
        q_hi = tl.minimum(seqlen_q, last_n - offset + left + 1)
    q_lo = (q_lo // BLOCK_M) * BLOCK_M
    for g in range(0, group):
        h = kvh * group + g
        for start_m in range(q_lo, q_hi, BLOCK_M):
            offs_m = start_m + offs_mm
            q_mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
            q = tl.load(_rows(Q, b, h, sqb, sqh, sqm, offs_m, offs_d), mask=q_mask, other=0.0)
            do = tl.load(_rows(DO, b, h, sdb, sdh, sdm, offs_m, offs_d), mask=q_mask, other=0.0)
            lse = tl.load(LSE + b * slb + h * slh + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
            delta = tl.load(DELTA + b * slb + h * slh + offs_m, mask=offs_m < seqlen_q, other=0.0)
            p, ds = _ds_tile(q, k, v, do, lse, delta, offs_m, cols, seqlen_k, 0, seqlen_k, offset, left, right,
                             scale, softcap, HAS_LEFT, HAS_RIGHT, SOFTCAP, IEEE)
            dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    tl.store(_rows(DK, b, kvh, sdkb, sdkh, sdkn, cols, offs_d), dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(_rows(DV, b, kvh, sdvb, sdvh, sdvn, cols, offs_d), dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                   sqb, sqm, sqh, skb, skn, skh, svb, svn, svh, sdb, sdm, sdh, slb, slh, sdqb, sdqm, sdqh,
                   seqlen_q, seqlen_k, heads, group, offset, left, right, scale, softcap,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    b, h, kvh, start_m, offs_m, offs_d = _query_tile(heads, group, BLOCK_M, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_mask, q = _load_rows(Q, b, h, sqb, sqh, sqm, offs_m, offs_d, seqlen_q, HEAD_DIM)
    do = tl.load(_rows(DO, b, h, sdb, sdh, sdm, offs_m, offs_d), mask=q_mask, other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    delta = tl.load(DELTA + b * slb + h * slh + offs_m, mask=offs_m < seqlen_q, other=0.0)
    lo, hi, last_m = _key_range(start_m, seqlen_q, seqlen_k, offset, left, right, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(_rows(K, b, kvh, skb, skh, skn, cols, offs_d), mask=kv_mask, other=0.0)
        v = tl.load(_rows(V, b, kvh, svb, svh, svn, cols, offs_d), mask=kv_mask, other=0.0)
        p, ds = _ds_tile(q, k, v, do, lse, delta, offs_m, cols, seqlen_k, lo, hi, offset, left, right,
                         scale, softcap, HAS_LEFT, HAS_RIGHT, SOFTCAP, IEEE)
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(_rows(DQ, b, h, sdqb, sdqh, sdqm, offs_m, offs_d), dq.to(DQ.dtype.element_ty),
             mask=q_mask)


_TUNING = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages) tried on a real GPU
    (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 2, 2),
]
_KEY = ["seqlen_q", "seqlen_k", "HEAD_DIM", "HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "IEEE"]


def _autotuned(kernel):
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in _TUNING]
    return triton.autotune(configs=configs, key=_KEY)(kernel)


_TUNED = {}


def _launch(kernel, grid, *args, **kwargs):
    """Fixed small tiles under the interpreter; autotuned tiles on a GPU.

    grid(meta) -> launch grid, where meta holds BLOCK_M and BLOCK_N.
    """
    if interpreting():
        meta = {"BLOCK_M": 16, "BLOCK_N": 16}
        kernel[grid(meta)](*args, **meta, num_warps=1, num_stages=1, **kwargs)
        return
    if kernel not in _TUNED:
        _TUNED[kernel] = _autotuned(kernel)
    _TUNED[kernel][grid](*args, **kwargs)


def _block_d(head_dim: int) -> int:
    """head_dim padded to a power of two (at least 16, the smallest tl.dot size)."""
    return max(16, triton.next_power_of_2(head_dim))


def _mask_args(spec: AttentionSpec, seqlen_q: int, seqlen_k: int) -> dict:
    right, left = spec.right, spec.left
    return dict(
        offset=spec.resolve_offset(seqlen_q, seqlen_k),
        left=0 if left is None else left,
        right=0 if right is None else right,
        scale=spec.softmax_scale,
        softcap=spec.softcap if spec.softcap > 0 else 1.0,
        HAS_LEFT=left is not None,
        HAS_RIGHT=right is not None,
        SOFTCAP=spec.softcap > 0,
    )


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec):
    """q (B, Sq, H, D); k, v (B, Sk, Hkv, D).  Returns out (B, Sq, H, D) and lse (B, H, Sq), both float32."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    # float32 output: ring attention merges per-block outputs, which must not be rounded to half precision
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    if seqlen_q == 0:
        return out, lse
    _launch(
        _fwd_kernel, lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * heads),
        q, k, v, out, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], lse.stride(0), lse.stride(1),
        seqlen_q, seqlen_k, heads, heads // kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), IEEE=q.dtype == torch.float32,
        **_mask_args(spec, seqlen_q, seqlen_k),
    )
    return out, lse


def triton_backward(dout, q, k, v, out, lse, spec: AttentionSpec, dlse=None):
    """FA2 backward.  Returns dq (B, Sq, H, D), dk, dv (B, Sk, Hkv, D) in float32."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    q, k, v = (x.contiguous() for x in (q, k, v))
    dout = dout.to(q.dtype).contiguous()
    out = out.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    if seqlen_q == 0 or seqlen_k == 0:
        return dq, dk, dv
    block_d = _block_d(head_dim)
    # (B, S, H) row order for the preprocess, then (B, H, S) like lse
    rows = batch * seqlen_q * heads
    delta_rows = torch.empty(rows, dtype=torch.float32, device=q.device)
    dlse_rows = dlse.to(torch.float32).transpose(1, 2).contiguous().view(-1) if dlse is not None else delta_rows
    _bwd_preprocess[(triton.cdiv(rows, 16),)](
        out, dout, dlse_rows, delta_rows, head_dim, head_dim, rows,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=16, HAS_DLSE=dlse is not None,
    )
    delta = delta_rows.view(batch, seqlen_q, heads).transpose(1, 2).contiguous()
    # a row that saw no key has lse -inf; +inf makes its probabilities exactly 0
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).to(torch.float32).contiguous()
    mask = _mask_args(spec, seqlen_q, seqlen_k)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, IEEE=q.dtype == torch.float32, **mask)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], lse.stride(0), lse.stride(1))
    _launch(
        _bwd_dkdv_kernel, lambda meta: (triton.cdiv(seqlen_k, meta["BLOCK_N"]), batch * kv_heads),
        q, k, v, dout, lse, delta, dk, dv, *strides, *dk.stride()[:3], *dv.stride()[:3],
        seqlen_q, seqlen_k, kv_heads, heads // kv_heads, **common,
    )
    _launch(
        _bwd_dq_kernel, lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * heads),
        q, k, v, dout, lse, delta, dq, *strides, *dq.stride()[:3],
        seqlen_q, seqlen_k, heads, heads // kv_heads, **common,
    )
    return dq, dk, dv

