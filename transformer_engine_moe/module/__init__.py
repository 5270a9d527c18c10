"""User-facing nn.Modules."""

from .grouped_linear import GroupedLinear
from .moe import FP8FlowMoE

__all__ = ["FP8FlowMoE", "GroupedLinear"]
