"""Quantized weights as checkpoints ship them (FP8 block-wise, MXFP4), kept quantized in memory."""

from .formats import (MX_GROUP, QuantScheme, dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4,
                      scale_shape, scheme_from_hf)
from .linear import QuantizedLinear
from .matmul import quantized_linear
from .weight import QuantizedWeight

__all__ = ["MX_GROUP", "QuantScheme", "scheme_from_hf", "scale_shape", "dequantize_fp8", "quantize_fp8",
           "dequantize_mxfp4", "quantize_mxfp4", "QuantizedWeight", "QuantizedLinear", "quantized_linear"]
