"""Weights kept a second time in a layout for the CPU products of few rows that decode steps run.

A decode step multiplies a handful of rows (one per request, or per request routed to an expert) by each weight
matrix.  MKL's sgemm packs the weight into its own panel layout on every call, and for a few rows that packing
is most of the work: a (8, 256) x (256, 1024) product from cold memory took ~190 us on the 2-core development
machine (an AMD EPYC, AVX2), about 5 GB/s of weights.  oneDNN multiplies a weight that was reordered once into
its blocked layout (the pair of private operators torch's inductor uses for the same purpose) in ~85 us, and an
LM head (4096 x 256) at 8 rows in ~320 us instead of ~1050 us (each product alone, cold; whole decode steps:
``benchmarks/bench_decode.py``).  A stack of expert matrices (E, out, in) is packed instead into the 16-column
panels of ``ringmoe.panel_gemm`` where that kernel runs (x86-64 with AVX2), whose grouped product of all the
experts in one call is faster still (2.4-4x the oneDNN copies at 2-128 rows): ``packed_panels`` returns it.

``prepack(weight)`` stores the blocked copy beside the parameter (a side table keyed by the tensor: modules,
state dicts and deep copies never see it); ``packed(weight, x)`` returns it only where it gives the plain
product: float32 on a CPU, no gradient wanted, outside a graph torch.compile traces, and only while the weight
is unchanged since it was packed (its version counter and storage: an optimizer step, ``copy_`` or
``module.to(...)`` make the copy stale and the plain product is used).  The copy costs the weight's bytes
again: the serving engine packs the products a step runs eagerly (``prepack_weights``) and its memory check
counts them.

Where ``panel_gemm`` runs, a matrix (out, in) is packed as its panels too, kept in a tensor of the weight's shape,
and multiplied by the operator ``ringmoe::panel_linear`` (its C kernel called by torch's dispatcher, no Python on
the way; ``panel_linear``): at 2-16 rows 1.1-4.5x faster than oneDNN's copies, up to 1.8x faster than MKL's
products of the plain weight (3.6x for an LM head kept input-major), from ~128 rows about even (side by side on
the development machine, 2 threads: ``benchmarks/bench_products.py``; an eager call pays ~6 us of Python, so
``batch_invariant.linear`` takes the copy where that pays).  A compiled decode step cannot read the side table:
the modules whose products it runs (``InvariantLinear``, the router) hold their weight's panels in the attribute
``decode_panels``, which ``DecodePanels`` sets and keeps current (packing again, in place, a weight that changed).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import panel_gemm
from .operators import LIBRARY, c_kernels

__all__ = ["prepack_supported", "prepack", "packed", "packed_panels", "has_panels", "panel_copy", "packed_linear",
           "prepacked_bytes", "prepack_module", "panel_linear", "traced_panels", "DecodePanels"]


@dataclass
class _Pack:
    source: weakref.ref   # the parameter it copies (an id may be reused once that one is freed)
    version: int          # the parameter's version counter when it was packed
    data_ptr: int         # and where its values lay (``module.to(...)``, ``.data = ...`` move them)
    matrices: list | None         # oneDNN: one blocked copy per (out, in) matrix (one for a 2-D weight, E for a stack)
    panels: torch.Tensor | None   # or the panel copy: a stack's (E, out * in) for ``panel_gemm.grouped_linear``, a
    #                               matrix's (out, in) (its panels in a tensor of its shape) for ``panel_linear``
    nbytes: int


_PACKS: dict[int, _Pack] = {}


def prepack_supported(weight: torch.Tensor) -> bool:
    """Can ``weight`` ((out, in) or a stack (E, out, in)) be packed: float32 on a CPU where ``panel_gemm`` runs or
    torch has oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() in (2, 3)
            and (panel_gemm.available() or (torch.backends.mkldnn.is_available()
                                            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))))


def prepack(weight: torch.Tensor, rows_hint: int = 8) -> int:
    """Store a second copy of ``weight``: ``panel_gemm``'s panels where that kernel runs (a stack (E, out, in) as
    (E, out * in), a matrix in a tensor of its own shape), else oneDNN's blocked copy of each matrix; its bytes, 0
    when the weight cannot be packed (``prepack_supported``).  A matrix packed again takes its new panels into the
    tensor that held the old ones (the one a decode step's module holds: ``DecodePanels``).  ``rows_hint``: the
    rows a product usually has (a hint to oneDNN's choice of layout; products of any row count use the copy)."""
    if not prepack_supported(weight):
        return 0
    key = id(weight)
    matrices = panels = None
    with torch.no_grad():
        stack = weight.detach()
        if panel_gemm.available():
            panels = panel_gemm.pack(stack)
            if stack.dim() == 2:
                panels = panels.view(stack.shape).clone()  # not a view: torch.compile guards a view's base too
                earlier = _PACKS.get(key)
                if (earlier is not None and earlier.source() is weight and earlier.panels is not None
                        and earlier.panels.shape == panels.shape):
                    panels = earlier.panels.copy_(panels)
                c_kernels()  # the products go through ``ringmoe::panel_linear``: its C kernel, where it registers
        else:
            matrices = [torch.ops.mkldnn._reorder_linear_weight(m.contiguous(), rows_hint)
                        for m in (stack.unbind(0) if stack.dim() == 3 else (stack,))]
    if key not in _PACKS:
        weakref.finalize(weight, _PACKS.pop, key, None)
    nbytes = weight.numel() * weight.element_size()
    _PACKS[key] = _Pack(weakref.ref(weight), weight._version, weight.data_ptr(), matrices, panels, nbytes)
    return nbytes


def _current(weight: torch.Tensor) -> _Pack | None:
    """``weight``'s pack if it is unchanged since it was packed (same tensor, version and storage)."""
    pack = _PACKS.get(id(weight))
    if (pack is None or pack.source() is not weight or pack.version != weight._version
            or pack.data_ptr != weight.data_ptr()):
        return None
    return pack


def _usable(weight: torch.Tensor, x: torch.Tensor) -> _Pack | None:
    """``weight``'s pack when a product of x by it may use it: packed and unchanged since, x of its dtype, no
    gradient through the product, not traced."""
    if torch.compiler.is_compiling():  # first: a traced graph keeps the plain product and never sees the table
        return None
    pack = _current(weight)
    if pack is None or x.dtype != weight.dtype:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    return pack


def packed(weight: torch.Tensor, x: torch.Tensor) -> list | None:
    """The oneDNN copies of ``weight`` (a list: one per matrix) when a product of x by it may use them, else None."""
    pack = _usable(weight, x)
    return None if pack is None else pack.matrices


def packed_panels(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """The panel copy of ``weight`` when a product of x by it may use it, else None: a stack's (E, out * in), a
    matrix's (out, in) (for ``panel_linear``)."""
    pack = _usable(weight, x)
    return None if pack is None else pack.panels


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) float32 @ W.T (+ bias) for the panel copy ``panels`` (out, in) of a matrix W: (..., out); one
    call of ``ringmoe::panel_linear`` (eager or traced)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.ringmoe.panel_linear.default(flat, panels).view(*x.shape[:-1], panels.shape[0])
    return out if bias is None else out + bias


def traced_panels(panels: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Does a product of x in code torch.compile traces take a module's ``decode_panels``: set, x float32 (their
    dtype), no gradient wanted (the operator has no backward)."""
    return (panels is not None and torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and x.dtype == panels.dtype)


def _panel_linear_python(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """``ringmoe::panel_linear``'s kernel where its C one is not registered: x (T, in), panels (out, in) -> (T, out)."""
    return panel_gemm.grouped_linear(x, [x.shape[0]], panels.view(1, -1), panels.shape[0])


def _panel_linear_shape(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], panels.shape[0])


LIBRARY.impl("panel_linear", _panel_linear_python, "CompositeExplicitAutograd")
torch.library.register_fake("ringmoe::panel_linear", _panel_linear_shape, lib=LIBRARY)


def packed_linear(x: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W.T (+ bias) for one blocked copy of W (out, in) from ``packed``: (..., out)."""
    return torch.ops.mkldnn._linear_pointwise(x, matrix, bias, "none", [], "")


def has_panels(weight: torch.Tensor) -> bool:
    """Does the stack ``weight`` have a current panel copy (``packed_panels`` hands it to the products that may
    use it).  Call outside torch.compile (a traced graph never sees the table)."""
    return panel_copy(weight) is not None


def panel_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The current panel copy of the stack ``weight`` (E, out * in), or None.  Call outside torch.compile."""
    pack = _current(weight)
    return None if pack is None else pack.panels


def prepacked_bytes(weight: torch.Tensor) -> int:
    """Bytes of ``weight``'s blocked copy, 0 when it has none."""
    pack = _PACKS.get(id(weight))
    return 0 if pack is None or pack.source() is not weight else pack.nbytes


def prepack_module(module: torch.nn.Module) -> int:
    """Pack every weight that ``module``'s submodules name in ``prepack_weights()`` (the layers that multiply
    through ``packed``); the bytes added."""
    total = 0
    for sub in module.modules():
        for weight in getattr(sub, "prepack_weights", lambda: ())():
            total += prepack(weight)
    return total


def module_state(module: torch.nn.Module) -> dict:
    """``module``'s state for pickling and deep copies (``nn.Module.__getstate__``) without its ``decode_panels``
    (a copy's weights are new tensors: its own decode graph packs them)."""
    state = torch.nn.Module.__getstate__(module)
    state.pop("decode_panels", None)
    return state


class DecodePanels:
    """The panel copies the products of a compiled decode step read, held by the modules that run them.

    torch.compile's graph cannot consult the side table of packs: each module of ``model`` with a
    ``decode_panels`` attribute (``InvariantLinear``, ``Router``) whose matrix ``weight`` has a current panel copy
    (``prepack``) gets that copy in the attribute, which its forward hands to ``panel_linear`` in traced code
    (``traced_panels``).  ``refresh`` (before each step of the graph) packs again, into the same tensor, a weight
    changed since.  Once set, a module's attribute stays a tensor: a graph traced with it reads it at every call."""

    def __init__(self, model: torch.nn.Module):
        # module, its parameters' dict, weight, version, address
        self._held: list[tuple[torch.nn.Module, dict, torch.Tensor, int, int]] = []
        for module in model.modules():
            if not hasattr(type(module), "decode_panels") or getattr(module, "weight", None) is None:
                continue
            weight = module.weight
            if weight.dim() == 2 and (panel_copy(weight) is not None or module.decode_panels is not None):
                self._hold(module, weight)

    def _hold(self, module: torch.nn.Module, weight: torch.Tensor) -> None:
        if panel_copy(weight) is None:
            prepack(weight)
        panels = panel_copy(weight)
        if panels is None:  # (a float32 CPU matrix where panel_gemm runs always packs)
            raise RuntimeError(f"{type(module).__name__}'s weight ({weight.dtype}, {weight.device}) can no longer be "
                               "packed as panels for the decode graph made with them")
        module.decode_panels = panels
        torch._dynamo.mark_static(panels)  # its sizes constants of the graph (a symbolic size: a conversion a call)
        self._held.append((module, module._parameters, weight, weight._version, weight.data_ptr()))

    @property
    def count(self) -> int:
        """Modules holding panels."""
        return len(self._held)

    def refresh(self) -> None:
        """Pack again the weights changed since they were packed (values, storage, or the parameter itself).
        (Before every step of the graph: ~4 us for the demo model's 21, the parameters' dicts held, not looked up.)"""
        stale = [entry for entry in self._held if entry[1].get("weight") is not entry[2]
                 or entry[2]._version != entry[3] or entry[2].data_ptr() != entry[4]]
        for entry in stale:
            self._held.remove(entry)
            self._hold(entry[0], entry[0].weight)
