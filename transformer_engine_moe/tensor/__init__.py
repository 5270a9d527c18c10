"""Quantized tensor types."""

from .float8_blockwise_tensor import Float8BlockwiseQTensor, scale_inv_shape
from .te_interop import from_te, to_te

__all__ = ["Float8BlockwiseQTensor", "scale_inv_shape", "from_te", "to_te"]
