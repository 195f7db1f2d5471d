"""FlashAttention in plain PyTorch: tiles, an online softmax, and an FA2 backward.

Runs on any device torch runs on.  The (seqlen_q, seqlen_k) score matrix is
never stored: at most one (block_q, block_k) tile per (batch, kv head) exists at
a time, so extra memory is O(N) in both passes while compute stays O(N^2).

Forward, per query block, keeps for each row a reference point ``m`` and the
running sums ``acc = sum_j exp(s_j - m) v_j`` and ``l = sum_j exp(s_j - m)``.
When a tile holds a score above ``m`` the earlier sums are rescaled by
``exp(m_old - m_new)`` (the online softmax).  At the end ``out = acc / l`` and
``lse = m + log(l)``.

Two tricks keep the number of passes over each tile small:

* The subtraction ``s - m`` is done by the matmul itself: q gets an extra
  column holding ``-m`` and k an extra column of ones, so ``[q, -m] . [k, 1] =
  q.k - m``.  Likewise v gets a column of ones, so ``p @ [v, 1]`` yields both
  ``sum p v`` and ``sum p`` in one product.
* ``m`` need not be the exact running maximum, only an upper-ish reference that
  keeps ``exp(s - m)`` finite.  After a row's first tile (where the exact tile
  maximum is taken), later tiles reuse ``m`` unchanged and skip the max pass;
  if a tile overflows (a score more than ~88 above ``m`` in float32) it is
  recomputed with the exact maximum.  Since ``l >= 1`` relative to ``m`` after
  the first tile, anything that underflows to 0 is below rounding anyway.

Backward follows FlashAttention-2: scores are recomputed per tile from the
saved lse, ``p = exp(s - lse)``, ``delta = rowsum(dO * O)``,
``dS = p * (dP - delta)``, then ``dV += p^T dO``, ``dQ += dS K``, ``dK += dS^T Q``.
The same column trick gives ``s - lse`` and ``dP - delta`` straight from the
matmuls.  With GQA the query heads of a group are stacked as extra rows against
their shared kv head, so dK and dV are summed over the group by the matmul.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .mask import AttentionSpec

__all__ = ["blockwise_forward", "blockwise_backward", "compute_dtype"]

# Elements of one score tile across all (batch, kv head) pairs: 2M floats = 8 MiB in
# float32, sized for a CPU's last-level cache share; measured best on 2 cores
# (benchmarks/bench_attention.py).
_TILE_ELEMENTS = 1 << 21
_MAX_BLOCK = 512
_MIN_BLOCK = 16
# Keep the running sum l below 2**60 relative to m so acc = sum p v cannot overflow.
_REBASE_ABOVE = 2.0**60
# Stands in for lse = -inf (a row that sees no key) so exp(s - lse) is exactly 0.
_EMPTY_ROW_LSE = 1e30


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_sizes(batch_kv_heads: int, group: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    block_k = max(1, min(_MAX_BLOCK, seqlen_k))
    rows = _TILE_ELEMENTS // max(1, batch_kv_heads * block_k)
    block_q = max(_MIN_BLOCK, min(_MAX_BLOCK, rows // group))
    return max(1, min(block_q, seqlen_q)), block_k


def _heads_major(x: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, H, D) -> (B, Hkv, H // Hkv, S, D) in ``dtype`` (head h -> kv head h // group)."""
    b, s, h, d = x.shape
    return x.to(dtype).permute(0, 2, 1, 3).reshape(b, kv_heads, h // kv_heads, s, d)


def _kv_with_ones(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, Hkv, S, D + 1) with a last column of ones."""
    return F.pad(x.to(dtype).permute(0, 2, 1, 3), (0, 1), value=1.0)


class _Workspace:
    """Reusable tile buffers: fresh multi-MiB allocations cost page faults on every tile."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, *shape: int) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=self.dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:numel].view(*shape)


class _QueryBlock:
    """Rows [i0, i1) of every query head of a group, stacked: (B * Hkv, group * rows, D + 1).

    The last column is free for a per-row term added to every score by the matmul.
    """

    def __init__(self, qh: torch.Tensor, i0: int, i1: int):
        b, hkv, g, _, d = qh.shape
        self.i0, self.i1, self.rows, self.group = i0, i1, i1 - i0, g
        self.aug = F.pad(qh[:, :, :, i0:i1], (0, 1)).view(b * hkv, g * self.rows, d + 1)

    def scores(
        self,
        k_aug: torch.Tensor,
        spec: AttentionSpec,
        row_term: torch.Tensor,
        masked_out: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """s - row_term against keys ``k_aug`` (B * Hkv, bk, D + 1), written into ``out`` (B * Hkv, R, bk).

        Masked positions are -inf.  With softcap the tanh must act on the raw
        score, so the row term is subtracted after it instead of in the matmul.
        """
        if spec.softcap > 0:
            self.aug[..., -1] = 0.0
            torch.bmm(self.aug, k_aug.transpose(-1, -2), out=out)
            out.div_(spec.softcap).tanh_().mul_(spec.softcap).sub_(row_term.unsqueeze(-1))
        else:
            torch.neg(row_term, out=self.aug[..., -1])
            torch.bmm(self.aug, k_aug.transpose(-1, -2), out=out)
        if masked_out is not None:
            out.view(out.shape[0], self.group, self.rows, -1).masked_fill_(masked_out, float("-inf"))
        return out

    def body(self) -> torch.Tensor:
        """The block without its extra column: (B * Hkv, R, D)."""
        return self.aug[..., :-1]


def _tiles(spec: AttentionSpec, i0: int, i1: int, seqlen_q: int, seqlen_k: int, block_k: int, device):
    """Yield (j0, j1, inverted mask or None, first_key_here) for every non-empty key tile."""
    for j0 in range(0, seqlen_k, block_k):
        j1 = min(seqlen_k, j0 + block_k)
        kind = spec.tile_kind(i0, i1, j0, j1, seqlen_q, seqlen_k)
        if kind == "empty":
            continue
        masked_out = None
        if kind == "partial":
            masked_out = ~spec.tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k, device)
        yield j0, j1, masked_out, spec.first_key_starts_in(i0, i1, j0, j1, seqlen_q, seqlen_k)


def blockwise_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention forward.

    q (B, Sq, H, D); k, v (B, Sk, Hkv, D); any float dtype.
    Returns out (B, Sq, H, D) and lse (B, H, Sq), both in float32 (float64 for
    float64 inputs).  Rows that see no key: out 0, lse -inf.
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = compute_dtype(q.dtype)
    out = torch.zeros(batch, kv_heads, group, seqlen_q, head_dim, dtype=dtype, device=q.device)
    lse = torch.full((batch, kv_heads, group, seqlen_q), float("-inf"), dtype=dtype, device=q.device)
    if seqlen_q > 0 and seqlen_k > 0:
        auto_q, auto_k = _tile_sizes(batch * kv_heads, group, seqlen_q, seqlen_k)
        block_q, block_k = block_q or auto_q, block_k or auto_k
        qh = _heads_major(q, kv_heads, dtype).mul(spec.softmax_scale)
        k_aug = _kv_with_ones(k, dtype).flatten(0, 1)
        vh = v.to(dtype).permute(0, 2, 1, 3).reshape(batch * kv_heads, seqlen_k, head_dim)
        work = _Workspace(dtype, q.device)
        for i0 in range(0, seqlen_q, block_q):
            i1 = min(seqlen_q, i0 + block_q)
            block = _QueryBlock(qh, i0, i1)
            acc, total, m = _forward_block(block, k_aug, vh, spec, seqlen_q, seqlen_k, block_k, work)
            seen = total > 0
            safe_total = torch.where(seen, total, torch.ones_like(total))
            shape = (batch, kv_heads, group, i1 - i0)
            out[:, :, :, i0:i1] = (acc / safe_total.unsqueeze(-1)).view(*shape, head_dim)
            lse[..., i0:i1] = torch.where(seen, m + torch.log(safe_total), float("-inf")).view(shape)
    return out.view(batch, heads, seqlen_q, head_dim).transpose(1, 2), lse.view(batch, heads, seqlen_q)


def _forward_block(block, k_aug, vh, spec, seqlen_q, seqlen_k, block_k, work):
    """Online softmax of one query block over all its visible key tiles.

    Returns acc (B * Hkv, R, D) = sum_j exp(s_j - m) v_j, total (B * Hkv, R) =
    sum_j exp(s_j - m), and the reference point m (B * Hkv, R).
    """
    n, rows, _ = block.aug.shape
    acc = torch.zeros(n, rows, vh.shape[-1], dtype=vh.dtype, device=vh.device)
    total = torch.zeros(n, rows, dtype=vh.dtype, device=vh.device)
    m = torch.zeros(n, rows, dtype=vh.dtype, device=vh.device)
    tile_total = torch.empty_like(total)
    for j0, j1, masked_out, first_key_here in _tiles(spec, block.i0, block.i1, seqlen_q, seqlen_k, block_k, acc.device):
        k_tile, v_tile = k_aug[:, j0:j1], vh[:, j0:j1]
        s = work.get("s", n, rows, j1 - j0)
        if not first_key_here:
            # Fast path: keep the reference m; no max pass, no subtraction pass.
            block.scores(k_tile, spec, m, masked_out, out=s).exp_()
            torch.sum(s, dim=-1, out=tile_total)
            if bool(torch.isfinite(tile_total).all()):
                total += tile_total
                acc.baddbmm_(s, v_tile)
                _rebase_if_large(acc, total, m)
                continue
        # Exact path: take the tile maximum and move the reference point up to it.
        block.scores(k_tile, spec, m, masked_out, out=s)
        tile_max = s.amax(dim=-1)
        has_mass = total > 0
        # Rows with mass only ever move m up (so acc shrinks); rows without mass
        # take this tile's max as their first reference.  -inf (row fully masked
        # here) means no move.
        shift = torch.where(has_mass, tile_max.clamp(min=0.0), tile_max)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        s.sub_(shift.unsqueeze(-1)).exp_()
        m += shift
        rescale = torch.where(has_mass, torch.exp(-shift), torch.ones_like(shift))
        total.mul_(rescale).add_(s.sum(dim=-1))
        acc.mul_(rescale.unsqueeze(-1)).baddbmm_(s, v_tile)
    return acc, total, m


def _rebase_if_large(acc: torch.Tensor, total: torch.Tensor, m: torch.Tensor) -> None:
    """Move m to lse for rows whose running sum grew past 2**60 (keeps acc finite)."""
    big = total > _REBASE_ABOVE
    if bool(big.any()):
        scale = torch.where(big, 1.0 / total, torch.ones_like(total))
        m += torch.where(big, torch.log(total), torch.zeros_like(total))
        acc.mul_(scale.unsqueeze(-1))
        total.mul_(scale)


def blockwise_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: AttentionSpec,
    dlse: torch.Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward.

    dout, out (B, Sq, H, D); q (B, Sq, H, D); k, v (B, Sk, Hkv, D); lse (B, H, Sq).
    ``out`` and ``lse`` may be the result of a larger attention (ring attention
    passes the final ones): then the gradients are this key block's share.
    dlse (B, H, Sq), optional: gradient w.r.t. lse (d lse / d s = p, so it
    enters as delta - dlse).
    Returns dq (B, Sq, H, D), dk, dv (B, Sk, Hkv, D) in float32 (float64 for float64).
    """
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = compute_dtype(q.dtype)
    dq = torch.zeros(batch, kv_heads, group, seqlen_q, head_dim, dtype=dtype, device=q.device)
    dk = torch.zeros(batch, kv_heads, seqlen_k, head_dim, dtype=dtype, device=q.device)
    dv = torch.zeros_like(dk)
    if seqlen_q > 0 and seqlen_k > 0:
        auto_q, auto_k = _tile_sizes(batch * kv_heads, group, seqlen_q, seqlen_k)
        block_q, block_k = block_q or auto_q, block_k or auto_k
        _backward_all(dout, q, k, v, out, lse, spec, dlse, block_q, block_k, dq, dk, dv)
    return (
        dq.view(batch, heads, seqlen_q, head_dim).transpose(1, 2),
        dk.transpose(1, 2),
        dv.transpose(1, 2),
    )


def _backward_all(dout, q, k, v, out, lse, spec, dlse, block_q, block_k, dq, dk, dv):
    """Fill dq (B, Hkv, G, Sq, D) and dk, dv (B, Hkv, Sk, D); loop keys outside, queries inside."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    n = batch * kv_heads
    dtype = dq.dtype
    qh = _heads_major(q, kv_heads, dtype).mul(spec.softmax_scale)
    doh = _heads_major(dout, kv_heads, dtype)
    # delta_i = sum_d dO_id O_id = sum_j p_ij dP_ij
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2)  # (B, H, Sq)
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    delta = delta.reshape(batch, kv_heads, group, seqlen_q)
    lse = lse.to(dtype).reshape(batch, kv_heads, group, seqlen_q)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, _EMPTY_ROW_LSE), lse)
    k_aug = _kv_with_ones(k, dtype).flatten(0, 1)
    v_aug = _kv_with_ones(v, dtype).flatten(0, 1)
    dk, dv = dk.view(n, seqlen_k, head_dim), dv.view(n, seqlen_k, head_dim)
    work = _Workspace(dtype, q.device)

    blocks = []
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(seqlen_q, i0 + block_q)
        block = _QueryBlock(qh, i0, i1)
        grad_block = _QueryBlock(doh, i0, i1)  # [dO, -delta] . [v, 1] = dP - delta
        grad_block.aug[..., -1] = -delta[..., i0:i1].reshape(n, -1)
        row_lse = lse[..., i0:i1].reshape(n, -1)
        dq_block = torch.zeros(n, group * (i1 - i0), head_dim, dtype=dtype, device=q.device)
        blocks.append((block, grad_block, row_lse, dq_block))

    for j0 in range(0, seqlen_k, block_k):
        j1 = min(seqlen_k, j0 + block_k)
        k_tile, v_tile = k_aug[:, j0:j1], v_aug[:, j0:j1]
        # contiguous accumulators: BLAS writes into them directly, then one copy into dk, dv
        dk_tile = torch.zeros(n, j1 - j0, head_dim, dtype=dtype, device=q.device)
        dv_tile = torch.zeros_like(dk_tile)
        for block, grad_block, row_lse, dq_block in blocks:
            kind = spec.tile_kind(block.i0, block.i1, j0, j1, seqlen_q, seqlen_k)
            if kind == "empty":
                continue
            masked_out = None
            if kind == "partial":
                masked_out = ~spec.tile_mask(block.i0, block.i1, j0, j1, seqlen_q, seqlen_k, q.device)
            shape = (n, block.aug.shape[1], j1 - j0)
            s = work.get("s", *shape)
            if spec.softcap > 0:
                tanh = work.get("tanh", *shape)
                torch.bmm(block.body(), k_tile[..., :-1].transpose(-1, -2), out=tanh)
                tanh.div_(spec.softcap).tanh_()
                torch.mul(tanh, spec.softcap, out=s).sub_(row_lse.unsqueeze(-1))
                if masked_out is not None:
                    s.view(n, group, block.rows, -1).masked_fill_(masked_out, float("-inf"))
            else:
                block.scores(k_tile, spec, row_lse, masked_out, out=s)
            p = s.exp_()  # exact probabilities of the full attention
            dv_tile.baddbmm_(p.transpose(-1, -2), grad_block.body())
            ds = torch.bmm(grad_block.aug, v_tile.transpose(-1, -2), out=work.get("ds", *shape))
            ds.mul_(p)  # p * (dP - delta)
            if spec.softcap > 0:
                ds.mul_(tanh.mul_(tanh).neg_().add_(1.0))  # d(cap*tanh(x/cap))/dx = 1 - tanh^2
            dq_block.baddbmm_(ds, k_tile[..., :-1])
            dk_tile.baddbmm_(ds.transpose(-1, -2), block.body())
        dk[:, j0:j1] = dk_tile
        dv[:, j0:j1] = dv_tile

    for block, _, _, dq_block in blocks:
        dq[:, :, :, block.i0 : block.i1] = dq_block.view(batch, kv_heads, group, block.rows, head_dim)
    dq.mul_(spec.softmax_scale)  # s = scale * q.k, and q was pre-scaled for dK
