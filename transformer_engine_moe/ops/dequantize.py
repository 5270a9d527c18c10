"""``dequantize_blockwise``: Float8BlockwiseQTensor -> high-precision tensor (what ``t.dequantize()`` runs).

Rowwise 1x128 copies use the Triton kernel on the GPU; other layouts, and the
CPU, use the reference. The gradient passes straight through.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..recipe import HIGH_PRECISION_DTYPES
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from .backend import use_triton


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
    kernel = (
        usage == "rowwise"
        and not t.is_2D_scaled
        and dtype != torch.float64
        and t.rowwise_data.is_contiguous()
        and use_triton(backend, t.rowwise_data, "dequantize_blockwise")
    )
    return _Dequantize.apply(t, dtype, usage, kernel)


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, dtype, usage, kernel: bool):
        ctx.nominal_dtype = t.dtype
        if kernel:
            from ..kernels import dequantize as kd

            return kd.dequantize_1x128(t.rowwise_data, t.rowwise_scale_inv, dtype).view(t.shape)
        return t._dequantize_no_grad(dtype, usage)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.nominal_dtype), None, None, None
