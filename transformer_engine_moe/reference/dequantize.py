"""Plain-PyTorch blockwise FP8 dequantization: the oracle and the CPU path of ``ops/dequantize.py``.

Each FP8 code times its block's float32 ``scale_inv``, in float32, cast once to the output dtype (a NaN
scale_inv, the quantizer's mark of a block that held +-inf, dequantizes the whole block to NaN). The cast
does not saturate, as TransformerEngine's dequantize (the same float32 product, then ``.to(dtype)``): a
finite input whose FP8 code rounded up past the output dtype's max comes back +-inf, e.g. with E4M3 and
power-of-two scales every fp16 value from 63488 to 65504 (scale 2**-8, code 256, 256 * 2**8 = 65536), and
bf16/fp32 values within about 3% of their max (2**128). The Triton kernel computes the same bits. Layouts
(COMPACT, ``layout.py``): rowwise 1x128 ``[M, K]`` with ``[M, ceil(K/128)]`` scales; columnwise 128x1
``[K, M]`` (grouped: expert-major ``[M*K]``) with ``[num_column_blocks, K]`` scales; 128x128 ``[M, K]``
with ``[ceil(M/128), ceil(K/128)]`` scales.
"""

from __future__ import annotations

import torch

from ..layout import MSplits, column_block_of_row, from_columnwise
from ..recipe import BLOCK_SIZE


def dequantize_1x128(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data [M, K]`` FP8 times ``scale_inv [M, ceil(K/128)]`` in float32, cast to ``dtype``."""
    k = data.shape[1]
    s = scale_inv.repeat_interleave(BLOCK_SIZE, dim=1)[:, :k]
    return (data.float() * s).to(dtype)


def dequantize_128x1(
    data_t: torch.Tensor, scale_inv_t: torch.Tensor, dtype: torch.dtype, m_splits: MSplits = None
) -> torch.Tensor:
    """Columnwise ``data_t`` (``[K, M]``, grouped: expert-major ``[M*K]``) with ``scale_inv_t
    [num_column_blocks, K]`` -> logical ``[M, K]``."""
    k = scale_inv_t.shape[1]
    m = data_t.shape[1] if data_t.dim() == 2 else data_t.numel() // k
    block = column_block_of_row(m, m_splits, data_t.device)
    return (from_columnwise(data_t, m, k, m_splits).float() * scale_inv_t[block]).to(dtype)


def dequantize_128x128(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data [M, K]`` FP8 times ``scale_inv [ceil(M/128), ceil(K/128)]``, cast to ``dtype``."""
    m, k = data.shape
    s = scale_inv.repeat_interleave(BLOCK_SIZE, 0).repeat_interleave(BLOCK_SIZE, 1)[:m, :k]
    return (data.float() * s).to(dtype)
