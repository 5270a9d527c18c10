"""FP8-Flow-MoE: keep the Mixture-of-Experts expert path in blockwise FP8.

Public names are re-exported here; see README.md and docs/ for the design.
"""

from .dispatch import get_dispatcher
from .module import FP8FlowMoE, GraphedFP8FlowMoE, GraphPool, GroupedLinear
from .ops import (
    dequantize_blockwise,
    grouped_gemm,
    grouped_gemm_wgrad,
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_unpermute,
    quantize_blockwise,
    quantize_grouped_weight,
    routing_map_to_topk,
    scaling_aware_transpose,
    topk_to_routing_map,
    transpose_grouped_weight,
    weighted_swiglu_quant,
)
from .quantizer import Float8BlockQuantizer
from .recipe import BlockShape, FP8FlowRecipe, Format, Role
from .tensor import Float8BlockwiseQTensor, from_te, to_te

__version__ = "0.1.0"

__all__ = [
    "BlockShape",
    "FP8FlowMoE",
    "FP8FlowRecipe",
    "Float8BlockQuantizer",
    "Float8BlockwiseQTensor",
    "Format",
    "GraphPool",
    "GraphedFP8FlowMoE",
    "GroupedLinear",
    "Role",
    "dequantize_blockwise",
    "from_te",
    "get_dispatcher",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_unpermute",
    "quantize_blockwise",
    "quantize_grouped_weight",
    "routing_map_to_topk",
    "scaling_aware_transpose",
    "to_te",
    "topk_to_routing_map",
    "transpose_grouped_weight",
    "weighted_swiglu_quant",
]
