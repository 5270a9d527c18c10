"""Public ops: argument checks, autograd rules, and the kernel-or-reference choice."""

from .quantize import QuantizeArgs, quantize_blockwise

__all__ = ["QuantizeArgs", "quantize_blockwise"]
