"""Plain-PyTorch scaling-aware FP8 transpose, on the FP8 bit patterns, and the double-quantization path.

Rule. Rowwise 1x128 FP8 data ``q [M, K]`` with power-of-two row scales
``s_r = scale_inv[r, k // 128]`` becomes columnwise 128x1 data: for each column
block (128 rows of one group, see ``layout.py``) and each 128-column block, the
new scale is ``s_col = max_r s_r`` over the rows whose 128 codes there are not all
zero (a power of two; 1 when every row is zero), and every element is
re-encoded for ``s_col`` by shifting its exponent down by ``d = log2(s_col / s_r)``:

* if the shifted exponent stays >= 1 (normal), only the exponent field changes:
  the value is exactly the rowwise value;
* otherwise the exact value ``v * 2**-d`` lies below the smallest normal (2**-6
  for E4M3, 2**-14 for E5M2) and is rounded to the nearest subnormal, ties to
  even; below half the smallest subnormal it becomes a zero of the same sign.
  Input subnormals are shifted the same way, never flushed.

Zero rows are left out because their scale says nothing about them: a zero block's
quantizer scale is 1 (TE's rule for amax 0), and the padding rows that permute
writes after each expert's tokens are zero with scale 1. Counted, a zero row's 1
would set ``s_col`` for the whole block and flush every row whose values lie below
the format's smallest subnormal at that scale (gradients, typically) to zero.

Equivalently ``dequantize(columnwise) == fp8(dequantize(rowwise) / s_col) * s_col``
element for element, with the quantizer's cast (``reference.quantize.cast_to_fp8``:
round-to-nearest-even, NaN -> 0x7F, E5M2 +-inf -> +-max; the quantizer never
writes inf). Here the values are never touched by float arithmetic and nothing
can overflow (``d >= 0``); the GPU kernel multiplies decoded values by the exact
power of two ``2**-d`` and rounds once, the same function.
"""

from __future__ import annotations

import torch

from ..layout import MSplits, column_block_of_row, num_column_blocks, to_columnwise
from ..recipe import BLOCK_SIZE
from .dequantize import dequantize_1x128
from .quantize import quantize_128x1

def shift_fp8_down(code: torch.Tensor, d: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """int32 FP8 codes times ``2**-d`` (``d >= 0``), re-encoded with round-to-nearest-even."""
    mbits = 2 if fp8_dtype == torch.float8_e5m2 else 3
    sign, mag = code & 0x80, code & 0x7F
    e = mag >> mbits
    significand = torch.where(e > 0, (mag & ((1 << mbits) - 1)) | (1 << mbits), mag)
    r = (d + 1 - e.clamp(min=1)).clamp(1, mbits + 2)
    sub = (significand + ((1 << (r - 1)) - 1) + ((significand >> r) & 1)) >> r
    out = sign | torch.where(e > d, mag - (d << mbits), torch.where(d == 0, mag, sub))
    if fp8_dtype == torch.float8_e5m2:  # inf -> +-max, NaN -> 0x7F, as the quantizer's cast
        return torch.where(mag == 0x7C, sign | 0x7B, torch.where(mag > 0x7C, 0x7F, out))
    return torch.where(mag == 0x7F, 0x7F, out)


def check_pow2_scales(scale_inv: torch.Tensor, name: str = "scale_inv") -> None:
    """Raise ValueError unless every scale is a positive power of two (normal, or 2**-127) or NaN (a block
    its quantizer marked non-finite)."""
    mantissa, _ = torch.frexp(scale_inv)
    if not bool((((mantissa == 0.5) & torch.isfinite(scale_inv)) | torch.isnan(scale_inv)).all()):
        raise ValueError(
            f"{name} holds scales that are not powers of two; the scaling-aware transpose "
            "shifts exponents and would need a real requantization (quantize with force_pow_2_scales=True)"
        )


def scaling_aware_transpose(
    data: torch.Tensor, scale_inv: torch.Tensor, m_splits: MSplits = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``data [M, K]`` FP8, ``scale_inv [M, ceil(K/128)]`` (powers of two) ->
    ``(data_t, scale_inv_t [num_column_blocks, K])``, ``data_t`` ``[K, M]`` or, grouped, expert-major ``[M*K]``
    (``layout.py``); unused trailing blocks and all-zero blocks get scale 1. A column block with a row scale
    of NaN (a row block its quantizer marked non-finite) gets scale NaN: the non-finite value stays non-finite
    (its codes are the kernel's: shifts to the NaN's biased exponent 255)."""
    check_pow2_scales(scale_inv)
    m, k = data.shape
    nb = num_column_blocks(m, m_splits)
    block = column_block_of_row(m, m_splits, data.device)
    idx = block[:, None].expand_as(scale_inv)
    # As the kernel, on the float32 bits: the largest bits are the largest scale (positive floats order as
    # their bits), and shifts are differences of biased exponents (2**-127 -> 0, NaN -> 255). Row blocks of
    # zero codes (+-0) take no part and keep their codes (d = 0).
    kb = scale_inv.shape[1]
    mag = torch.nn.functional.pad(data.view(torch.uint8) & 0x7F, (0, kb * BLOCK_SIZE - k))
    live = mag.view(m, kb, BLOCK_SIZE).amax(-1) > 0
    bits = torch.where(live, scale_inv.contiguous().view(torch.int32), 0)
    col_bits = torch.zeros(nb, kb, dtype=torch.int32, device=data.device)
    col_bits.scatter_reduce_(0, idx, bits, "amax")
    d = torch.where(live, (col_bits >> 23)[block] - (bits >> 23), 0).repeat_interleave(BLOCK_SIZE, dim=1)[:, :k]
    out = shift_fp8_down(data.view(torch.uint8).int(), d, data.dtype)
    nan_col = torch.zeros(col_bits.shape, device=data.device).scatter_reduce_(
        0, idx, torch.isnan(scale_inv).float(), "amax") > 0
    s_col = torch.where(nan_col, float("nan"), torch.where(col_bits > 0, col_bits.view(torch.float32), 1.0))
    data_t = to_columnwise(out.to(torch.uint8).view(data.dtype), m_splits)
    return data_t, s_col.repeat_interleave(BLOCK_SIZE, dim=1)[:, :k].contiguous()


def double_quantize_columnwise(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    m_splits: MSplits = None,
    force_pow_2_scales: bool = True,
    intermediate_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The casting path the transpose replaces: dequantize the rowwise FP8 to
    ``intermediate_dtype``, then quantize it again in 128x1 blocks (grouped by ``m_splits``).
    Returns ``(data_t, scale_inv_t [num_column_blocks, K])`` in the layout of ``scaling_aware_transpose``."""
    hp = dequantize_1x128(data, scale_inv, intermediate_dtype)
    return quantize_128x1(hp, data.dtype, force_pow_2_scales, 0.0, m_splits)


def transpose_128x128(data: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-scaled FP8 ``data [G, N, K]`` and ``scale_inv [G, N/128, K/128]`` -> ``[G, K, N]`` and
    ``[G, K/128, N/128]``: each matrix transposed byte for byte, exact (a 128x128 block's scale is
    transpose-invariant, so no code changes). The weights' dgrad copy."""
    return data.transpose(1, 2).contiguous(), scale_inv.transpose(1, 2).contiguous()
