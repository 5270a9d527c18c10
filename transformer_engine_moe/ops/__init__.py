"""Public ops: argument checks, autograd rules, and the kernel-or-reference choice."""

from .dequantize import dequantize_blockwise
from .quantize import QuantizeArgs, quantize_blockwise
from .transpose import scaling_aware_transpose

__all__ = ["QuantizeArgs", "dequantize_blockwise", "quantize_blockwise", "scaling_aware_transpose"]
