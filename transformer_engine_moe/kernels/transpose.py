"""Triton kernels for the scaling-aware FP8 transpose and the 128x128 byte transpose, and their launchers.

Rowwise 1x128 FP8 ``q [M, K]`` with power-of-two ``scale_inv [M, ceil(K/128)]``
becomes columnwise 128x1 FP8 ``qt`` (``[K, M]``; grouped: expert-major ``[M*K]``,
each group's ``[K, m_g]`` after the previous one, ``layout.py``) with block-major
``scale_inv_t [num_column_blocks, K]``, blocks restarting at each group (rule in
``reference/transpose.py``). One launch, no host sync: ``_scaling_aware_transpose_kernel``,
one program per column block (128 rows of one group) and KB_TILE 128-column blocks (the
group looked up once). Per 128-column block it finds the rows with a nonzero code (on 32-bit words of 4 codes
when rows are 16-byte aligned, K % 16 == 0: fewer instructions than bytes widened to int32), reduces their row
scales to the column scale (the largest live scale and the power-of-two check in one pair reduction: one pass
instead of two), writes it, shifts the codes by the per-row exponent difference and stores them transposed into
the group's own ``[K, m_g]`` block, CHUNKS column slices at a time (each slice's codes read again, from L1/L2:
on 2 warps a whole 128x128 block re-encoded at once spilled 1.6 kB a thread at 255 registers; ptxas for
sm_90). One read of FP8 from memory and one write. Those transposed stores are 16-byte vectors only
when the compiler can prove the group's first row and size multiples of 16: a run-time branch rewrites them
as ``x // 16 * 16`` when they are (padded experts always are); ragged groups take the
general path, correct but with byte stores.

Re-encoding on the GPU decodes each code, multiplies by ``2**-d`` (exact) and
rounds with the hardware FP8 conversion (E4M3 in half precision, E5M2 in float32);
under the interpreter it is integer arithmetic on the codes. Both are the same
function (tested bit for bit on the GPU). A non-power-of-two row scale turns its
column block's scales to NaN: the device-side guard against a mislabelled tensor.

``transpose_128x128`` (weights, 128x128 blocks: the scales are transpose-invariant) moves bytes
only: ``_byte_transpose_kernel``, one program per square tile of one matrix.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..layout import columnwise_data_shape, num_column_blocks
from ..recipe import BLOCK_SIZE
from .casts import float_to_fp8_bits, fp8_bits_to_float, use_software_cast
from .groups import column_block_rows, group_sizes_arg, store_columnwise

# (KB_TILE: 128-column blocks per program, CHUNKS: column slices re-encoded at a time, num_warps) from
# benchmarks/bench_transpose.py's sweep (H200).
TRANSPOSE_CONFIG = (1, 4, 4)
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
def f16_pow2_neg_bits(d):
    """The float16 bits (int32) of ``2**-d`` (``d >= 0``), exact or 0: d <= 14 a normal, 15..24 a subnormal, then 0.
    Its own function so the CPU test runs it; as int32 (the caller bitcasts) the kernel compiles to the SASS of the
    variant measured in docs/transpose.md (an f16-returning helper reorders it)."""
    return tl.where(d <= 14, (15 - d) << 10, tl.where(d <= 24, 1 << tl.maximum(24 - d, 0), 0))


@triton.jit
def shift_e4m3_f16(code, d):
    """E4M3 codes (uint8) re-encoded for a scale 2**d times larger, with the hardware casts, in half precision:
    3 instructions a pair of codes (FP8 -> f16x2, HMUL2, f16x2 -> FP8) instead of 6 in float32 (SASS, sm_90a).
    Exact: a product >= 2**-14 is an f16 (4 significant bits), a smaller one rounds to 0 in E4M3 either way (half
    its smallest subnormal is 2**-10), and so does every product past d = 24 (factor 0); tests/ops/test_transpose.py
    checks every code and shift. Not for E5M2: its largest values times 2**-25 round to nonzero codes."""
    factor = f16_pow2_neg_bits(d).to(tl.int16).to(tl.float16, bitcast=True)
    v = code.to(tl.float8e4nv, bitcast=True).to(tl.float16) * factor
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def shift_fp8_down(code, d, E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """FP8 codes (uint8) re-encoded for a scale 2**d times larger: ``fp8_rne(value * 2**-d)``.

    NaN becomes 0x7F and E5M2 +-inf becomes +-max, as the quantizer's cast does. On the GPU, E4M3 in half
    precision (``shift_e4m3_f16``), E5M2 in float32.
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
    if not E5M2:
        return shift_e4m3_f16(code, d)
    # 2**-d from its bits; d >= 64 sends every FP8 value to zero all the same
    factor = ((127 - tl.minimum(d, 64)) << 23).to(tl.float32, bitcast=True)
    return float_to_fp8_bits(fp8_bits_to_float(code, True, False) * factor, 57344.0, True, False)


@triton.jit
def _max_min(a_max, a_min, b_max, b_min):
    """Combine of the pair reduction in ``_column_block_scales``: (max, min)."""
    return tl.maximum(a_max, b_max), tl.minimum(a_min, b_min)


@triton.jit
def _column_block_scales(s_ptr, rows, row_ok, live, kb, num_kb):
    """The block's column scale_inv (the largest scale of the ``live`` rows, those whose codes are not all
    zero; NaN unless every valid row's is a power of two: a row marked non-finite by its quantizer
    (scale_inv NaN) or mislabelled; 1 when no row is live) and each live row's exponent shift ``d`` to the
    largest biased exponent (255 when a row's scale is NaN: the block's codes are then those shifts,
    meaningless under its NaN scale); 0 for the other rows, whose zero codes stay."""
    bits = tl.load(s_ptr + rows * num_kb + kb, mask=row_ok, other=0.0).to(tl.int32, bitcast=True)
    exp = bits >> 23  # biased exponent; 2**-127 (bits 0x400000) -> 0
    # valid: a positive normal power of two, or 2**-127 (the subnormal an overflowed scale gives)
    pow2 = (((bits & -2139095041) == 0) & (exp > 0) & (exp < 255)) | (bits == 0x400000)
    # one pair reduction over the block, not two: the largest live scale_inv (positive floats order as their
    # bits) and whether every valid row's scale is a power of two
    live_bits, all_pow2 = tl.reduce((tl.where(live, bits, 0), tl.where(row_ok, pow2, True).to(tl.int32)), 0,
                                    _max_min)
    s_col = tl.where(live_bits > 0, live_bits.to(tl.float32, bitcast=True), 1.0)
    s_col = tl.where(all_pow2 > 0, s_col, float("nan"))
    return s_col, tl.where(live, (live_bits >> 23) - exp, 0)


@triton.jit
def _scaling_aware_transpose_kernel(
    q_ptr, s_ptr, qt_ptr, st_ptr, sizes_ptr, M, K, num_kb, num_groups,
    E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr, GROUPED: tl.constexpr, MAX_GROUPS: tl.constexpr,
    KB_TILE: tl.constexpr, CHUNKS: tl.constexpr, WORDS: tl.constexpr,
):
    """Column block ``b`` x KB_TILE 128-column blocks of q [M, K]: the block's group is looked up once."""
    b = tl.program_id(0)
    kb0 = tl.program_id(1) * KB_TILE
    start, count, _, first, size = column_block_rows(b, sizes_ptr, num_groups, M, GROUPED, MAX_GROUPS)
    local = (start - first) // 128 * 128  # the block's first column in its group's [K, m_g] block
    if (first % 16 == 0) & (size % 16 == 0):  # provably aligned in this branch: 16-byte stores
        _transpose_column_block(q_ptr, s_ptr, qt_ptr, st_ptr, b, start, count // 16 * 16, first // 16 * 16,
                                size // 16 * 16, local, K, num_kb, kb0, E5M2, SOFTWARE_CAST, KB_TILE, CHUNKS,
                                WORDS)
    else:
        _transpose_column_block(q_ptr, s_ptr, qt_ptr, st_ptr, b, start, count, first, size, local, K, num_kb,
                                kb0, E5M2, SOFTWARE_CAST, KB_TILE, CHUNKS, WORDS)


@triton.jit
def _transpose_column_block(q_ptr, s_ptr, qt_ptr, st_ptr, b, start, count, first, size, local, K, num_kb, kb0,
                            E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr, KB_TILE: tl.constexpr,
                            CHUNKS: tl.constexpr, WORDS: tl.constexpr):
    r = tl.arange(0, 128)
    row_ok = r < count
    rows = (start + r).to(tl.int64)
    W: tl.constexpr = 128 // CHUNKS
    for i in tl.static_range(KB_TILE):
        kb = kb0 + i
        cols = kb * 128 + tl.arange(0, 128)
        col_ok = cols < K
        # rows with a nonzero code in this block; WORDS (rows 16-byte aligned): tested on 32 words of 4 codes a row
        if WORDS:
            w = kb * 32 + tl.arange(0, 32)
            words = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 4) + w[None, :],
                            mask=row_ok[:, None] & (w < K // 4)[None, :], other=0)
            live = tl.max(((words & 0x7F7F7F7F) != 0).to(tl.int32), axis=1) > 0
        else:
            code = tl.load(q_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                           other=0)
            live = tl.max((code & 0x7F).to(tl.int32), axis=1) > 0
        s_col, d = _column_block_scales(s_ptr, rows, row_ok & (kb < num_kb), live, kb, num_kb)
        tl.store(st_ptr + b.to(tl.int64) * K + cols, tl.zeros([128], tl.float32) + s_col, mask=col_ok)
        for c in tl.static_range(CHUNKS):
            part_cols = kb * 128 + c * W + tl.arange(0, W)
            part_ok = part_cols < K
            # one slice on the bytes path: the block's codes as loaded for the zero-row test
            part = code if (CHUNKS == 1) & (not WORDS) else tl.load(q_ptr + rows[:, None] * K + part_cols[None, :],
                                                                     mask=row_ok[:, None] & part_ok[None, :], other=0)
            out = tl.trans(shift_fp8_down(part, d[:, None], E5M2, SOFTWARE_CAST))
            store_columnwise(qt_ptr, out, part_ok, part_cols, r, count, first, size, local, K)


def scaling_aware_transpose(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    m_splits=None,
    software_cast: bool | None = None,
    config: tuple[int, int, int] | None = None,
):
    """``data [M, K]`` FP8 (contiguous), ``scale_inv [M, ceil(K/128)]`` -> ``(qt, scale_inv_t [num_column_blocks,
    K])``, ``qt`` ``[K, M]`` or, with ``m_splits`` (host list or device tensor of group sizes summing to M),
    expert-major ``[M*K]``.

    ``software_cast`` forces the integer re-encoding on or off (default: on for CPU
    tensors); ``config`` overrides ``(KB_TILE, CHUNKS, num_warps)`` (benchmark sweeps).
    """
    m, k = data.shape
    nb, num_kb = num_column_blocks(m, m_splits), triton.cdiv(k, BLOCK_SIZE)
    qt = torch.empty(columnwise_data_shape(m, k, m_splits), dtype=data.dtype, device=data.device)
    st = torch.empty((nb, k), dtype=torch.float32, device=data.device)
    if nb == 0 or k == 0:
        return qt, st
    kb_tile, chunks, num_warps = config or TRANSPOSE_CONFIG
    sizes, g, grouped, max_groups = group_sizes_arg(m_splits, data.device)
    _scaling_aware_transpose_kernel[(nb, triton.cdiv(num_kb, kb_tile))](
        data.view(torch.uint8), scale_inv, qt.view(torch.uint8), st, sizes, m, k, num_kb, g,
        E5M2=data.dtype == torch.float8_e5m2,
        SOFTWARE_CAST=use_software_cast(data, software_cast),
        GROUPED=grouped, MAX_GROUPS=max_groups, KB_TILE=kb_tile, CHUNKS=chunks,
        WORDS=k % 16 == 0 and data.data_ptr() % 16 == 0, num_warps=num_warps,
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
