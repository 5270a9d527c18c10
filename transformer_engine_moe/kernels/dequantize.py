"""Triton kernel for 1x128 blockwise FP8 dequantization, and its launcher.

``q [M, K]`` FP8 times ``scale_inv [M, ceil(K/128)]`` in float32, cast to the
output dtype: the reference's arithmetic, so results are bitwise equal. A
contiguous ``q`` with K % 128 == 0 runs on the ``[M*K/128, 128]`` view (one
linear stream), as the quantize kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..recipe import BLOCK_SIZE
from .casts import cast_for_store, fp8_bits_to_float, use_software_cast

# (BLOCK_M, num_warps), from benchmarks/bench_transpose.py's baseline sweep.
DEQUANTIZE_CONFIG = (16, 4)


@triton.jit
def _dequantize_1x128_kernel(
    q_ptr, s_ptr, y_ptr, M, K, num_kb,
    E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """A [BLOCK_M, 128] tile of q [M, K] with scale_inv s [M, num_kb] -> y [M, K]."""
    pid_k = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_k * 128 + tl.arange(0, 128)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    code = tl.load(q_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + rows * num_kb + pid_k, mask=rows < M, other=0.0)
    y = fp8_bits_to_float(code, E5M2, SOFTWARE_CAST) * s[:, None]
    tl.store(y_ptr + rows[:, None] * K + cols[None, :],
             cast_for_store(y, y_ptr.dtype.element_ty, SOFTWARE_CAST), mask=mask)


def dequantize_1x128(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype,
    software_cast: bool | None = None,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``data [M, K]`` FP8 (contiguous), ``scale_inv [M, ceil(K/128)]`` -> ``[M, K]`` in ``dtype``."""
    m, k = data.shape
    num_kb = triton.cdiv(k, BLOCK_SIZE)
    y = torch.empty((m, k), dtype=dtype, device=data.device)
    if m == 0:
        return y
    flat = k % BLOCK_SIZE == 0
    xm, xk, nkb = (m * num_kb, BLOCK_SIZE, 1) if flat else (m, k, num_kb)
    block_m, num_warps = config or DEQUANTIZE_CONFIG
    _dequantize_1x128_kernel[(triton.cdiv(xm, block_m), nkb)](
        data.view(torch.uint8), scale_inv, y, xm, xk, nkb,
        E5M2=data.dtype == torch.float8_e5m2,
        SOFTWARE_CAST=use_software_cast(data, software_cast),
        BLOCK_M=block_m, num_warps=num_warps,
    )
    return y
