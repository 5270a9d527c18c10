"""Triton kernels for the scaling-aware FP8 transpose and the 128x128 byte transpose, and their launchers.

Rowwise 1x128 FP8 ``q [M, K]`` with power-of-two ``scale_inv [M, ceil(K/128)]``
becomes columnwise 128x1 FP8 ``qt [K, M]`` with block-major
``scale_inv_t [num_column_blocks, K]``, blocks restarting at each group (rule
in ``reference/transpose.py``). Two launches, no host sync:

1. ``_column_scales_kernel``, one program per column block and 8 128-column
   blocks: reads only the row scales, writes the column scales and, per row and
   128-column block, the exponent shift ``d`` (uint8 ``[M, ceil(K/128)]``, 1/128
   of the data).
2. ``_shift_transpose_kernel``, one program per 128-row window aligned to 128
   (not per block: a group may start at any row, and only aligned windows let
   the transposed FP8 stores be vectorized): one read and one write of FP8.

Re-encoding on the GPU decodes each code, multiplies by ``2**-d`` (exact) and
rounds with the hardware FP8 conversion; under the interpreter it is integer
arithmetic on the codes. Both are the same function (tested bit for bit on the
GPU). A non-power-of-two row scale turns its column block's scales to NaN: the
device-side guard against a mislabelled tensor.

``transpose_128x128`` (weights, 128x128 blocks: the scales are transpose-invariant) moves bytes
only: ``_byte_transpose_kernel``, one program per square tile of one matrix.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..layout import num_column_blocks
from ..recipe import BLOCK_SIZE
from .casts import float_to_fp8_bits, fp8_bits_to_float
from .groups import column_block_rows, group_sizes_arg

# (BLOCK_K, num_warps) of the shift-transpose kernel, from benchmarks/bench_transpose.py's sweep.
TRANSPOSE_CONFIG = (128, 4)
# (BLOCK, num_warps) of the byte transpose, from benchmarks/bench_transpose_grouped_weight.py's sweep.
BYTE_TRANSPOSE_CONFIG = (64, 4)


@triton.jit
def _shift_fp8_down_software(code, d, MBITS: tl.constexpr):
    """Integer version of ``fp8(value(code) * 2**-d)`` (d >= 0), round-to-nearest-even.

    Normals whose exponent stays >= 1 lose d from the exponent field; results
    below the smallest normal become subnormal multiples, ties to even (0 below
    half the smallest subnormal, the sign kept). Specials are handled by the caller.
    """
    sign = code & 0x80
    mag = code & 0x7F
    e = mag >> MBITS
    significand = tl.where(e > 0, (mag & ((1 << MBITS) - 1)) | (1 << MBITS), mag)
    r = tl.maximum(tl.minimum(d + 1 - tl.maximum(e, 1), MBITS + 2), 1)
    sub = (significand + ((1 << (r - 1)) - 1) + ((significand >> r) & 1)) >> r
    out = tl.where(e > d, mag - (d << MBITS), sub)
    return sign | tl.where(d == 0, mag, out)


@triton.jit
def shift_fp8_down(code, d, E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """FP8 codes (uint8) re-encoded for a scale 2**d times larger: ``fp8_rne(value * 2**-d)``.

    NaN becomes 0x7F and E5M2 +-inf becomes +-max, as the quantizer's cast does.
    """
    if SOFTWARE_CAST:
        c = code.to(tl.int32)
        mag = c & 0x7F
        if E5M2:
            out = _shift_fp8_down_software(c, d, 2)
            out = tl.where(mag == 0x7C, (c & 0x80) | 0x7B, tl.where(mag > 0x7C, 0x7F, out))
        else:
            out = tl.where(mag == 0x7F, 0x7F, _shift_fp8_down_software(c, d, 3))
        return out.to(tl.uint8)
    # 2**-d from its bits; d >= 64 sends every FP8 value to zero all the same
    factor = ((127 - tl.minimum(d, 64)) << 23).to(tl.float32, bitcast=True)
    v = fp8_bits_to_float(code, E5M2, False) * factor
    if E5M2:
        return float_to_fp8_bits(v, 57344.0, True, False)
    return float_to_fp8_bits(v, 448.0, False, False)


@triton.jit
def _column_scales_kernel(
    s_ptr, st_ptr, d_ptr, sizes_ptr,
    M, K, num_kb, num_groups,
    GROUPED: tl.constexpr, MAX_GROUPS: tl.constexpr, KB_TILE: tl.constexpr,
):
    """Column block ``b`` x KB_TILE 128-column blocks: st[b, k] = the largest row scale_inv of the
    block's rows in k's 128-column block; d[r, kb] = log2(st / s[r, kb]); unused blocks get st = 1."""
    b = tl.program_id(0)
    start, count, _ = column_block_rows(b, sizes_ptr, num_groups, M, GROUPED, MAX_GROUPS)
    r = tl.arange(0, 128)
    kb = tl.program_id(1) * KB_TILE + tl.arange(0, KB_TILE)
    rows = (start + r).to(tl.int64)
    mask = (r < count)[:, None] & (kb < num_kb)[None, :]
    bits = tl.load(s_ptr + rows[:, None] * num_kb + kb[None, :], mask=mask, other=0.0).to(tl.int32, bitcast=True)
    exp = bits >> 23  # biased exponent; 2**-127 (bits 0x400000) -> 0
    # valid: a positive normal power of two, or 2**-127 (the subnormal an overflowed scale gives)
    pow2 = (((bits & -2139095041) == 0) & (exp > 0) & (exp < 255)) | (bits == 0x400000)
    all_pow2 = tl.min(tl.where(mask, pow2, True).to(tl.int32), axis=0) > 0
    exp_col = tl.max(exp, axis=0)
    s_col = tl.max(bits, axis=0).to(tl.float32, bitcast=True)  # monotone bits: the largest scale_inv
    s_col = tl.where(count > 0, tl.where(all_pow2, s_col, float("nan")), 1.0)
    tl.store(d_ptr + rows[:, None] * num_kb + kb[None, :], (exp_col[None, :] - exp).to(tl.uint8), mask=mask)
    k = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(st_ptr + b.to(tl.int64) * K + k, tl.zeros([KB_TILE, 128], tl.float32) + s_col[:, None], mask=k < K)


@triton.jit
def _shift_transpose_kernel(
    q_ptr, d_ptr, qt_ptr, M, K, num_kb,
    E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows [128*i, 128*i + 128) x BLOCK_K columns of q [M, K] -> qt [K, M], shifted by d."""
    rows = tl.program_id(0) * 128 + tl.arange(0, 128)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kb = (tl.program_id(1) * BLOCK_K) // 128  # BLOCK_K divides 128: one shift per row
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    code = tl.load(q_ptr + rows64[:, None] * K + cols[None, :], mask=mask, other=0)
    d = tl.load(d_ptr + rows64 * num_kb + kb, mask=row_ok, other=0).to(tl.int32)
    out = shift_fp8_down(code, d[:, None], E5M2, SOFTWARE_CAST)
    cols64 = cols.to(tl.int64)
    tl.store(qt_ptr + cols64[:, None] * M + rows64[None, :], tl.trans(out), mask=tl.trans(mask))


def scaling_aware_transpose(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    m_splits=None,
    software_cast: bool | None = None,
    config: tuple[int, int] | None = None,
):
    """``q [M, K]`` FP8 (contiguous), ``scale_inv [M, ceil(K/128)]`` ->
    ``(qt [K, M], scale_inv_t [num_column_blocks, K])``.

    ``m_splits``: None, a host list or a device tensor of group sizes summing to M.
    ``software_cast`` forces the integer re-encoding on or off (default: on for CPU
    tensors); ``config`` overrides ``(BLOCK_K, num_warps)`` (benchmark sweeps).
    """
    m, k = q.shape
    nb, num_kb = num_column_blocks(m, m_splits), triton.cdiv(k, BLOCK_SIZE)
    qt = torch.empty((k, m), dtype=q.dtype, device=q.device)
    st = torch.empty((nb, k), dtype=torch.float32, device=q.device)
    if nb == 0:
        return qt, st
    block_k, num_warps = config or TRANSPOSE_CONFIG
    if BLOCK_SIZE % block_k:
        raise ValueError(f"BLOCK_K must divide {BLOCK_SIZE}, got {block_k}")
    shifts = torch.empty((m, num_kb), dtype=torch.uint8, device=q.device)
    sizes, g, grouped, max_groups = group_sizes_arg(m_splits, q.device)
    kb_tile = min(triton.next_power_of_2(num_kb), 8)
    _column_scales_kernel[(nb, triton.cdiv(num_kb, kb_tile))](
        scale_inv, st, shifts, sizes, m, k, num_kb, g,
        GROUPED=grouped, MAX_GROUPS=max_groups, KB_TILE=kb_tile, num_warps=4,
    )
    if m > 0:
        _shift_transpose_kernel[(triton.cdiv(m, BLOCK_SIZE), triton.cdiv(k, block_k))](
            q.view(torch.uint8), shifts, qt.view(torch.uint8), m, k, num_kb,
            E5M2=q.dtype == torch.float8_e5m2,
            SOFTWARE_CAST=(not q.is_cuda) if software_cast is None else software_cast,
            BLOCK_K=block_k, num_warps=num_warps,
        )
    return qt, st


@triton.jit
def _byte_transpose_kernel(src, dst, N, K, BLOCK: tl.constexpr):
    """``dst[g, k, n] = src[g, n, k]`` for one ``BLOCK x BLOCK`` tile; N and K are multiples of BLOCK."""
    pid_k, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = g.to(tl.int64) * N * K
    rn = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    rk = (pid_k * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    tile = tl.load(src + base + rn[:, None] * K + rk[None, :])
    tl.store(dst + base + rk[:, None] * N + rn[None, :], tl.trans(tile))


def transpose_128x128(data: torch.Tensor, scale_inv: torch.Tensor, *,
                      config: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``data [G, N, K]`` FP8 (N, K multiples of 128), ``scale_inv [G, N/128, K/128]`` -> ``[G, K, N]``
    and ``[G, K/128, N/128]`` (rule in ``reference/transpose.py``). ``config``: ``(BLOCK, num_warps)``."""
    g, n, k = data.shape
    out = torch.empty((g, k, n), dtype=data.dtype, device=data.device)
    block, num_warps = config or BYTE_TRANSPOSE_CONFIG
    if BLOCK_SIZE % block:
        raise ValueError(f"BLOCK must divide {BLOCK_SIZE}, got {block}")
    if out.numel():
        _byte_transpose_kernel[(k // block, n // block, g)](
            data.view(torch.uint8), out.view(torch.uint8), n, k, BLOCK=block, num_warps=num_warps)
    return out, scale_inv.transpose(1, 2).contiguous()
