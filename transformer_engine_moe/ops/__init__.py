"""Public ops: argument checks, autograd rules, and the kernel-or-reference choice."""

from .dequantize import dequantize_blockwise
from .permute import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_unpermute,
    topk_to_routing_map,
)
from .quantize import QuantizeArgs, quantize_blockwise
from .swiglu import weighted_swiglu_quant
from .transpose import scaling_aware_transpose

__all__ = [
    "QuantizeArgs",
    "dequantize_blockwise",
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_unpermute",
    "quantize_blockwise",
    "scaling_aware_transpose",
    "topk_to_routing_map",
    "weighted_swiglu_quant",
]
