"""User-facing nn.Modules."""

from .graphed_moe import GraphedFP8FlowMoE, GraphPool
from .grouped_linear import GroupedLinear
from .moe import FP8FlowMoE

__all__ = ["FP8FlowMoE", "GraphedFP8FlowMoE", "GraphPool", "GroupedLinear"]
