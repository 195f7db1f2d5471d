"""Block kernels behind one interface, the backend choice, and the autograd glue.

A block kernel computes exact attention of a query block against a key/value
block and returns the partial result as (out, lse); its backward takes the
*final* (out, lse) of the whole attention, so ring attention can call it per
block and merge with ``merge_attention``.  All tensors use flash-attn's layout:
q (B, Sq, H, D), k/v (B, Sk, Hkv, D), lse (B, H, Sq).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .blockwise import blockwise_backward, blockwise_forward, compute_dtype
from .mask import AttentionSpec
from .native import native_backward, native_forward, native_unsupported
from .reference import attention_reference
from .sinks import add_sinks, sinks_grad

__all__ = ["BlockKernel", "BACKENDS", "check_backend", "resolve_kernel", "AttentionFunction", "attention_with_kernel"]

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionSpec], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BlockKernel:
    """name, forward(q, k, v, spec) -> (out, lse), backward(dout, q, k, v, out, lse, spec, dlse) -> grads,
    unsupported(q, k, spec) -> reason string or None."""

    name: str
    forward: Forward
    backward: Backward
    unsupported: Callable[[torch.Tensor, torch.Tensor, AttentionSpec], str | None]


def _always(q, k, spec):
    return None


def _reference_forward(q, k, v, spec):
    return attention_reference(q, k, v, spec, compute_dtype(q.dtype))


def _reference_backward(dout, q, k, v, out, lse, spec, dlse=None):
    """Naive backward: autograd through the materialised reference (recomputed) of this block.

    ``out``/``lse`` are those of the whole attention (other blocks, a sink): with w = exp(l - lse) the
    block's weight in it, out = sum_b w_b o_b and lse = log sum_b exp(l_b) give
    d o = w dout and d l = w (dout . (o - out) + dlse).
    """
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o, l = attention_reference(*leaves, spec, compute_dtype(q.dtype))
        acc = o.dtype
        weight = torch.exp(l.detach() - lse.to(acc))                       # (B, H, S); 0 where l = -inf
        weight = torch.where(torch.isinf(l.detach()), torch.zeros_like(weight), weight)
        w = weight.transpose(1, 2).unsqueeze(-1)
        d_l = (dout.to(acc) * (o.detach() - out.to(acc))).sum(-1).transpose(1, 2)
        if dlse is not None:
            d_l = d_l + torch.where(torch.isinf(lse), torch.zeros_like(d_l), dlse.to(acc))
        pairs = [(t, g) for t, g in ((o, w * dout.to(acc)), (l, weight * d_l)) if t.requires_grad]
        grads = torch.autograd.grad([t for t, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))


def _triton_unsupported(q, k, spec):
    try:
        from . import triton_flash
    except ImportError as exc:  # Triton is optional: the module is imported only when asked for
        return f"backend='triton' needs Triton installed ({exc})"
    return triton_flash.triton_unsupported(q, k, spec)


def _from_triton(name: str):
    """A function of triton_flash, imported on first call."""

    def call(*args):
        from . import triton_flash

        return getattr(triton_flash, name)(*args)

    return call


BACKENDS: dict[str, BlockKernel] = {
    "blockwise": BlockKernel("blockwise", blockwise_forward, blockwise_backward, _always),
    "native": BlockKernel("native", native_forward, native_backward, native_unsupported),
    "triton": BlockKernel("triton", _from_triton("triton_forward"), _from_triton("triton_backward"), _triton_unsupported),
    "reference": BlockKernel("reference", _reference_forward, _reference_backward, _always),
}


def check_backend(backend) -> None:
    """ValueError unless ``backend`` names a kernel (or "auto"); cheap, for before any communication."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be one of 'auto', {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}")


def resolve_kernel(backend: str, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> BlockKernel:
    """The kernel for ``backend``; "auto" takes the fastest that supports the request.

    auto: on CUDA the Triton kernel, on CPU torch's native kernel (never Triton's
    interpreter, which is for tests), else (or if
    they do not support the options) the blockwise kernel, which supports all.
    Raises ValueError naming the backend if an explicit choice cannot run.
    """
    if backend == "auto":
        preferred = ["triton"] if q.device.type == "cuda" else ["native"]
        for name in preferred:
            if BACKENDS[name].unsupported(q, k, spec) is None:
                return BACKENDS[name]
        return BACKENDS["blockwise"]
    check_backend(backend)
    kernel = BACKENDS[backend]
    reason = kernel.unsupported(q, k, spec)
    if reason is not None:
        raise ValueError(reason)
    return kernel


class AttentionFunction(torch.autograd.Function):
    """Autograd for any block kernel: saves q, k, v, out, lse (O(N)), recomputes tiles in backward.

    With ``sinks`` (heads,) the sink joins the normaliser after the kernel (``sinks.add_sinks``); the
    kernel's backward then runs from the final (out, lse) and the sink gets its own gradient.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel: BlockKernel, spec: AttentionSpec):
        out, lse = kernel.forward(q, k, v, spec)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.kernel, ctx.spec = kernel, spec
        ctx.set_materialize_grads(False)
        result = out.to(q.dtype)
        if not result.is_contiguous():
            result = result.contiguous()
        return result, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.spec, dlse)
        dsinks = sinks_grad(dout, out, lse, sinks, dlse) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None


def attention_with_kernel(q, k, v, kernel: BlockKernel, spec: AttentionSpec,
                          sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse) through ``kernel`` (plus ``sinks``), with autograd when any input requires grad."""
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return AttentionFunction.apply(q, k, v, sinks, kernel, spec)
    out, lse = kernel.forward(q, k, v, spec)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype).contiguous(), lse
