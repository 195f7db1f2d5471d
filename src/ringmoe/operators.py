"""ringmoe's torch operators, declared in one place: their schemas (``torch.library``), and where torch's stable C
shim allows, C kernels for the CPU (``torch_ops.c``, registered by ``panel_gemm.register_torch_ops``), which a
compiled graph calls without entering Python.

- ``paged_cached_attention``: decode attention over the paged cache (Python kernel: ``attention.paged_cpu``);
- ``grouped_experts``: a MoE layer's dropless routed part, the layer named by its key (Python kernel:
  ``moe.grouped_op``); its C kernel runs a layer whose panel copies were bound, any other through
  ``grouped_experts_python`` (the same Python kernel under a second name, which the C kernel calls);
- ``panel_linear``: a product by a weight's panel copy (Python kernel: ``prepacked``), the CPU products of the
  float32 projections eagerly and in a compiled decode step;
- ``gather_rows``, ``sum_rows``, ``merge_over_group``: the collectives of a compiled decode step on a mesh, the
  process group named by its key (Python kernels: ``parallel.graph_collectives``);
- ``bind_experts``: C only: gives ``grouped_experts``'s C kernel a layer's panel copies, biases and activation
  (``MoELayer.bind_c_experts``); empty panels unbind the layer.

The Python kernels are registered as CompositeExplicitAutograd: where the C kernels are registered (the CPU
key) they take the CPU calls; elsewhere (no kernel library, an older torch) the Python ones run.
"""

from __future__ import annotations

import torch

from . import panel_gemm

__all__ = ["NAMESPACE", "LIBRARY", "c_kernels"]

NAMESPACE = "ringmoe"
LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
LIBRARY.define("paged_cached_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor first, "
               "Tensor last, float scale) -> (Tensor, Tensor)")
LIBRARY.define("panel_linear(Tensor x, Tensor panels) -> Tensor")
LIBRARY.define("grouped_experts(Tensor x, Tensor topk_idx, Tensor topk_weight, int layer) -> Tensor")
LIBRARY.define("grouped_experts_python(Tensor x, Tensor topk_idx, Tensor topk_weight, int layer) -> Tensor")
LIBRARY.define("bind_experts(int layer, Tensor gate_up, Tensor down, Tensor gate_up_bias, Tensor down_bias, "
               "int ffn_size, float limit, float alpha) -> ()")
LIBRARY.define("gather_rows(Tensor x, int group) -> Tensor")
LIBRARY.define("sum_rows(Tensor y, int group) -> Tensor")
LIBRARY.define("merge_over_group(Tensor out, Tensor lse, int group) -> (Tensor, Tensor)")


def c_kernels() -> bool:
    """Are the C kernels registered (done on the first call, once per process; building the kernel library if
    needed)."""
    return panel_gemm.register_torch_ops(NAMESPACE)
