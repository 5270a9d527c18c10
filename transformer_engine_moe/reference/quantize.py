"""Plain-PyTorch blockwise FP8 quantization: the oracle and the CPU path.

Semantics equal TransformerEngine's blockwise quantizer bit for bit on finite
inputs, with one deliberate difference for +-inf (last item):

* ``amax`` is the max of ``|x|`` over the block's valid elements, NaN ignored
  (TE reduces with ``fmaxf``, which drops NaN operands);
* ``amax < amax_epsilon`` is raised to ``amax_epsilon``;
* ``scale = fp8_max / amax`` (float32, round-to-nearest); ``scale = 1`` when
  ``amax`` is 0 or inf; an overflowing division gives the input dtype's max;
  with ``force_pow_2_scales`` the float32 bits are masked with ``0xFF800000``
  (round down to a power of two);
* ``scale_inv = 1 / scale`` (float32);
* ``data = fp8(x * scale)``: float32 product, round-to-nearest-even, finite
  saturation (``__NV_SATFINITE``: +-inf becomes +-fp8_max), NaN becomes the
  canonical NaN byte ``0x7F`` whatever its sign;
* a block holding +-inf gets ``scale_inv = NaN`` (TE: 1), so it dequantizes,
  and multiplies in a GEMM, to non-finite values: an overflow is never turned
  into a finite +-fp8_max (Megatron's checks for non-finite gradients and
  losses depend on it). NaN elements stay NaN through their code.

Layouts (COMPACT, see ``layout.py``): rowwise 1x128 data ``[M, K]``
with scale_inv ``[M, ceil(K/128)]``; columnwise 128x1 data ``[K, M]`` (the
transpose; grouped: expert-major ``[M*K]``) with block-major scale_inv
``[num_column_blocks, K]``, blocks never crossing a group boundary; 128x128 data ``[M, K]`` with scale_inv
``[ceil(M/128), ceil(K/128)]``. A ragged last block (K, M or a group not a
multiple of 128) is scaled over its valid elements only, as TE does.
"""

from __future__ import annotations

import torch

from ..recipe import BLOCK_SIZE, fp8_max, scale_value_for_inf
from ..layout import MSplits, column_block_of_row, num_column_blocks, to_columnwise

FP8_NAN_BITS = 0x7F
"""The byte every NaN is written as, in both E4M3 and E5M2 (canonical NaN)."""

_POW2_MASK = -8388608  # 0xFF800000 as a signed int32: sign and exponent bits


def compute_scale(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    input_dtype: torch.dtype,
    force_pow_2_scales: bool,
    amax_epsilon: float,
) -> torch.Tensor:
    """Float32 quantization scale per block from float32 ``amax`` (TE's rule)."""
    amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    # A true float32 division (``python_float / tensor`` multiplies by a reciprocal).
    scale = torch.full_like(amax, fp8_max(fp8_dtype)) / amax
    scale = torch.where(torch.isinf(scale), scale_value_for_inf(input_dtype), scale)
    special = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(special, torch.ones_like(scale), scale)
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & _POW2_MASK).view(torch.float32)
    return scale


def scale_inv_of(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` per block, NaN for a block whose amax is inf: its codes saturate as TE's do, but the
    NaN scale makes it dequantize (and multiply in a GEMM) to non-finite values. A deliberate difference
    from TransformerEngine, which gives such a block scale 1 and so turns an overflow into +-fp8_max."""
    return torch.where(torch.isinf(amax), torch.full_like(scale, float("nan")), torch.reciprocal(scale))


def cast_to_fp8(v: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Cast float32 ``v`` to FP8: round-to-nearest-even, saturate to finite, NaN -> 0x7F."""
    limit = fp8_max(fp8_dtype)
    q = v.clamp(-limit, limit).to(fp8_dtype)
    nan_bits = torch.full_like(q.view(torch.uint8), FP8_NAN_BITS)
    return torch.where(torch.isnan(v), nan_bits, q.view(torch.uint8)).view(fp8_dtype)


def _block_amax_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row, per-128-column amax of 2-D ``x``: float32 ``[M, ceil(K/128)]``."""
    m, k = x.shape
    nkb = -(-k // BLOCK_SIZE)
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    a = torch.nn.functional.pad(a, (0, nkb * BLOCK_SIZE - k))
    return a.view(m, nkb, BLOCK_SIZE).amax(dim=2)


def quantize_1x128(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise 1x128 quantization of 2-D ``x [M, K]``.

    Returns FP8 data ``[M, K]`` and float32 scale_inv ``[M, ceil(K/128)]``.
    """
    k = x.shape[1]
    amax = _block_amax_rows(x)
    scale = compute_scale(amax, fp8_dtype, x.dtype, force_pow_2_scales, amax_epsilon)
    scale_full = scale.repeat_interleave(BLOCK_SIZE, dim=1)[:, :k]
    data = cast_to_fp8(x.float() * scale_full, fp8_dtype)
    return data, scale_inv_of(scale, amax)


def quantize_128x1(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    m_splits: MSplits = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise 128x1 quantization of 2-D ``x [M, K]``: blocks of 128 rows along M,
    restarting at each group of ``m_splits`` (list or device tensor; None: one group).

    Returns the transposed FP8 data ``[K, M]`` (grouped: expert-major ``[M*K]``, ``layout.py``) and
    block-major scale_inv ``[num_column_blocks, K]`` (unused trailing blocks: scale_inv 1).
    """
    m, k = x.shape
    block = column_block_of_row(m, m_splits, x.device)
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    amax = torch.zeros(num_column_blocks(m, m_splits), k, device=x.device)
    amax.scatter_reduce_(0, block[:, None].expand(m, k), a, "amax")
    scale = compute_scale(amax, fp8_dtype, x.dtype, force_pow_2_scales, amax_epsilon)
    data = cast_to_fp8(x.float() * scale[block], fp8_dtype)
    return to_columnwise(data, m_splits), scale_inv_of(scale, amax)


def quantize_128x128(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D 128x128 quantization of ``x [M, K]`` (weights).

    Returns FP8 data ``[M, K]`` and scale_inv ``[ceil(M/128), ceil(K/128)]``.
    """
    m, k = x.shape
    nmb, nkb = -(-m // BLOCK_SIZE), -(-k // BLOCK_SIZE)
    row_amax = _block_amax_rows(x)  # [M, nkb]
    row_amax = torch.nn.functional.pad(row_amax, (0, 0, 0, nmb * BLOCK_SIZE - m))
    amax = row_amax.view(nmb, BLOCK_SIZE, nkb).amax(dim=1)
    scale = compute_scale(amax, fp8_dtype, x.dtype, force_pow_2_scales, amax_epsilon)
    scale_full = scale.repeat_interleave(BLOCK_SIZE, 0).repeat_interleave(BLOCK_SIZE, 1)
    data = cast_to_fp8(x.float() * scale_full[:m, :k], fp8_dtype)
    return data, scale_inv_of(scale, amax)


def quantize_grouped_weight(
    weights, fp8_dtype: torch.dtype, force_pow_2_scales: bool = True, amax_epsilon: float = 0.0, transpose: bool = True
):
    """G expert weights ``[N, K]`` (N, K multiples of 128) -> 128x128 FP8 ``(W [G, N, K], scale_inv
    [G, N/128, K/128], W^T [G, K, N] or None, scale_inv_t [G, K/128, N/128] or None)``: each weight's
    ``quantize_128x128``; W^T the same codes transposed (the scales are transpose-invariant)."""
    parts = [quantize_128x128(w, fp8_dtype, force_pow_2_scales, amax_epsilon) for w in weights]
    q = torch.stack([p[0] for p in parts])
    s = torch.stack([p[1] for p in parts])
    if not transpose:
        return q, s, None, None
    return q, s, q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()
