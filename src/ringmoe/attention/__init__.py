"""Exact attention: the naive oracle, tiled kernels, the online-softmax merge, the public API."""

from .api import flash_attn_func, flash_attn_varlen_func
from .decode import decode_attention
from .mask import AttentionSpec
from .merge import merge_attention
from .reference import attention_reference

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "merge_attention", "attention_reference", "AttentionSpec", "decode_attention"]
