"""``dequantize_blockwise``: Float8BlockwiseQTensor -> high-precision tensor (what ``t.dequantize()`` runs).

Rowwise 1x128 copies use the Triton kernel on the GPU; other layouts (``backend.TRITON`` holds the
reference for them), float64 outputs, non-contiguous data and the CPU use the reference
(``reference/dequantize.py``). The gradient passes straight through.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backend import REFERENCE, Implementation, implementation
from ..recipe import HIGH_PRECISION_DTYPES
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor


def dequantize_blockwise(
    t: Float8BlockwiseQTensor,
    dtype: torch.dtype = torch.float32,
    usage: Optional[str] = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """The logical ``[..., K]`` value of ``t`` in ``dtype``, from its ``usage`` copy
    (default: rowwise when held). Differentiable (straight-through to ``t``)."""
    if not isinstance(t, Float8BlockwiseQTensor):
        raise TypeError(f"t must be a Float8BlockwiseQTensor, got {type(t).__name__}")
    if dtype not in HIGH_PRECISION_DTYPES + (torch.float64,):
        raise TypeError(f"dequantize dtype must be a floating dtype, got {dtype}")
    usage = t._check_usage(usage)
    impl = implementation(backend, t, "dequantize_blockwise")
    if dtype == torch.float64 or (usage == "rowwise" and not t.rowwise_data.is_contiguous()):
        impl = REFERENCE  # the 1x128 kernel writes bf16/fp16/fp32 from contiguous rows
    return _Dequantize.apply(t, dtype, usage, impl)


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, dtype, usage, impl: Implementation):
        ctx.nominal_dtype = t.dtype
        return t._dequantize_no_grad(dtype, usage, impl)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.nominal_dtype), None, None, None
