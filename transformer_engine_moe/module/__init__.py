"""User-facing nn.Modules."""

from .grouped_linear import GroupedLinear

__all__ = ["GroupedLinear"]
