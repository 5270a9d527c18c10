"""Quantized tensor types and their layouts."""

from .float8_blockwise_tensor import Float8BlockwiseQTensor, scale_inv_shape
from .layout import compact_to_gemm_ready, gemm_ready_to_compact
from .te_interop import from_te, to_te

__all__ = [
    "Float8BlockwiseQTensor",
    "scale_inv_shape",
    "compact_to_gemm_ready",
    "gemm_ready_to_compact",
    "from_te",
    "to_te",
]
