"""Adapters to and from TransformerEngine's ``Float8BlockwiseQTensor``.

Written against TE's public constructor (``shape, dtype, rowwise_data,
rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype,
quantizer, is_2D_scaled``; ``data_format`` from TE 2.3 on). TE stores FP8 as
uint8 with the logical shape (rowwise) or ``[K, *leading]`` (columnwise,
GEMM_READY). TE is not installed where this package is tested, so these
adapters are unverified there (see docs/tensor.md).
"""

from __future__ import annotations

import math

import torch

from .float8_blockwise_tensor import Float8BlockwiseQTensor
from ..layout import gemm_ready_to_compact


def _te():
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
            Float8BlockQuantizer,
            Float8BlockwiseQTensor as TEFloat8BlockwiseQTensor,
        )
    except ImportError as e:
        raise ImportError(
            "to_te/from_te need TransformerEngine >= 2.2 (pip install transformer-engine[pytorch])"
        ) from e
    return tex, Float8BlockQuantizer, TEFloat8BlockwiseQTensor


def _te_fp8_dtype(tex, fp8_dtype: torch.dtype):
    return tex.DType.kFloat8E4M3 if fp8_dtype == torch.float8_e4m3fn else tex.DType.kFloat8E5M2


def to_te(t: Float8BlockwiseQTensor):
    """A TE ``Float8BlockwiseQTensor`` (GEMM_READY scales) holding ``t``'s FP8 data.

    Data is shared (viewed as uint8); scales are transposed/padded copies. Grouped
    128x1 columnwise copies (expert-major, ``layout.py``) have no TE equivalent (``ValueError``).
    """
    if not isinstance(t, Float8BlockwiseQTensor):
        raise TypeError(f"to_te expects this package's Float8BlockwiseQTensor, got {type(t).__name__}")
    if t.columnwise_m_splits is not None:
        raise ValueError(
            "to_te: t's 128x1 columnwise copy is grouped (expert-major [M*K], blocks restarting at each of "
            "its columnwise_m_splits); TE has no such tensor: drop it with "
            "t.update_usage(columnwise_usage=False) first"
        )
    tex, Float8BlockQuantizer, TETensor = _te()
    fp8 = _te_fp8_dtype(tex, t.fp8_dtype)
    shape = tuple(t.shape)
    quantizer = Float8BlockQuantizer(
        fp8,
        rowwise=t.rowwise_data is not None,
        columnwise=t.columnwise_data is not None,
        force_pow_2_scales=t.force_pow_2_scales,
        block_scaling_dim=2 if t.is_2D_scaled else 1,
    )
    row = col = row_s = col_s = None
    if t.rowwise_data is not None:
        row = t.rowwise_data.view(torch.uint8).view(shape)
        row_s = t.scale_inv_gemm_ready("rowwise")
    if t.columnwise_data is not None:
        col = t.columnwise_data.view(torch.uint8).view((shape[-1],) + shape[:-1])
        col_s = t.scale_inv_gemm_ready("columnwise")
    return TETensor(
        shape=shape,
        dtype=t.dtype,
        rowwise_data=row,
        rowwise_scale_inv=row_s,
        columnwise_data=col,
        columnwise_scale_inv=col_s,
        fp8_dtype=fp8,
        quantizer=quantizer,
        is_2D_scaled=t.is_2D_scaled,
        requires_grad=t.requires_grad,
    )


def from_te(te_tensor) -> Float8BlockwiseQTensor:
    """This package's Float8BlockwiseQTensor (COMPACT) from a TE one (GEMM_READY or COMPACT)."""
    tex, _, TETensor = _te()
    if not isinstance(te_tensor, TETensor):
        raise TypeError(f"from_te expects a TE Float8BlockwiseQTensor, got {type(te_tensor).__name__}")
    fp8_dtype = (
        torch.float8_e4m3fn if te_tensor._fp8_dtype == tex.DType.kFloat8E4M3 else torch.float8_e5m2
    )
    shape = tuple(te_tensor.shape)
    k, m = shape[-1], math.prod(shape[:-1])
    is_2d = te_tensor._is_2D_scaled
    fmt = getattr(te_tensor, "_data_format", None)
    compact = fmt is not None and fmt == tex.Float8BlockScaleTensorFormat.COMPACT
    out = {}
    if te_tensor._rowwise_data is not None:
        s = te_tensor._rowwise_scale_inv
        if not compact:
            s = gemm_ready_to_compact(s, is_2d, False, -(-k // 128) if is_2d else m)
        out.update(rowwise_data=te_tensor._rowwise_data.view(fp8_dtype).reshape(m, k),
                   rowwise_scale_inv=s)
    if te_tensor._columnwise_data is not None:
        d, s = te_tensor._columnwise_data.view(fp8_dtype), te_tensor._columnwise_scale_inv
        if compact:  # TE's COMPACT columnwise data is untransposed [M, K]; scales as ours
            d = d.reshape(m, k).t().contiguous()
        else:
            d = d.reshape(k, m)
            s = gemm_ready_to_compact(s, is_2d, True, -(-m // 128) if is_2d else k)
        out.update(columnwise_data=d, columnwise_scale_inv=s)
    quantizer = getattr(te_tensor, "_quantizer", None)
    return Float8BlockwiseQTensor(
        shape=shape, dtype=te_tensor.dtype, fp8_dtype=fp8_dtype, is_2D_scaled=is_2d,
        force_pow_2_scales=bool(getattr(quantizer, "force_pow_2_scales", False)),
        requires_grad=te_tensor.requires_grad, **out,
    )

