"""Public ops: argument checks, autograd rules, and the kernel-or-reference choice."""

from .dequantize import dequantize_blockwise
from .permute import (
    PermuteLayout,
    layout_host_counts,
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_unpermute,
    permute_layout,
    routing_map_to_topk,
    topk_to_routing_map,
)
from .grouped_gemm import grouped_gemm, grouped_gemm_wgrad
from .quantize import QuantizeArgs, quantize_blockwise, quantize_grouped_weight
from .swiglu import weighted_swiglu_quant
from .transpose import scaling_aware_transpose, transpose_grouped_weight

__all__ = [
    "PermuteLayout",
    "QuantizeArgs",
    "dequantize_blockwise",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "layout_host_counts",
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_unpermute",
    "permute_layout",
    "quantize_blockwise",
    "quantize_grouped_weight",
    "routing_map_to_topk",
    "scaling_aware_transpose",
    "topk_to_routing_map",
    "transpose_grouped_weight",
    "weighted_swiglu_quant",
]
