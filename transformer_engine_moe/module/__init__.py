"""User-facing nn.Modules."""

from .grouped_linear import GroupedLinear
from .moe import FP8FlowMoE, saved_activation_bytes

__all__ = ["FP8FlowMoE", "GroupedLinear", "saved_activation_bytes"]
