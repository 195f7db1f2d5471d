"""ringmoe: exact long-context mixture-of-experts transformers across devices.

FlashAttention (tiled, exact, forward and backward), ring attention (sequence
parallelism with K/V blocks passed around a ring) and expert parallelism.
"""

from .attention import flash_attn_func, flash_attn_varlen_func, merge_attention

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "merge_attention", "__version__"]
