"""Triton kernels for blockwise FP8 quantization, and their launchers.

Launchers take and return plain tensors (no package types). The arithmetic is
that of :mod:`transformer_engine_moe.reference.quantize`, step for step, so the
GPU output is bitwise equal to the reference: float32 amax with NaN dropped,
``div_rn`` for ``fp8_max / amax`` and ``1 / scale``, a power-of-two mask on the
scale bits, and the FP8 conversion of ``casts.py`` (round-to-nearest-even,
finite saturation, NaN as the byte ``0x7F``).

FP8 data is stored through a ``uint8`` view of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layout import address_table, columnwise_data_shape, num_column_blocks
from ..recipe import BLOCK_SIZE, fp8_max, scale_value_for_inf
from .casts import float_to_fp8_bits, to_float, use_software_cast
from .groups import column_block_rows, group_sizes_arg, store_columnwise

# Launch shapes (BLOCK_M, K_BLOCKS, num_warps) from benchmarks/bench_quantize.py's sweep
# (H200, 2026-11-22). Rowwise-only quantization of a contiguous [M, K] with K % 128 == 0
# runs on the [M*K/128, 128] view: a purely linear stream, same bits, 97-102% of the copy
# bandwidth where 2-D tiles of rows 14 KB apart reached 74-89%.
FLAT_CONFIG = (16, 1, 4)
ROWWISE_CONFIG = (16, 2, 4)  # ragged K or strided rows
COLWISE_CONFIG = (64, 4)  # (BLOCK_K, num_warps) of the 128x1 kernel: 69% of copy (expert-major, x128 groups)
GROUPED_WEIGHT_WARPS = 8  # quantize_grouped_weight, W only, aligned weights: 97-99% of copy on an H200 (4 warps: 78)
# quantize_grouped_weight writing W and W^T from one launch (16-bit weights): (rows per slice, num_warps). Two passes
# over 64-row slices of each 128x128 tile on 8 warps (79 registers a thread: four programs per SM) reach 88-96% of
# copy on an H200, where the whole tile held at once on 4 warps (248 registers: two programs per SM) reached 75-78%
# (2026-12-02, DeepSeek-V3 expert shapes at 32 and 128 experts, docs/quantization.md); on an H100 the whole tile ran
# at 92-93% (2026-11-23). With float32 weights the one-launch kernel wrote wrong bytes under Triton 3.6 (also
# transposing the codes or the scaled tile; the codes' transpose was wrong with BF16 weights too, and slower), so
# float32 weights take the two launches.
FUSED_WEIGHT_CONFIG = (64, 8)


@triton.jit
def compute_scale(amax, eps, value_for_inf, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Per-block (scale, scale_inv) from float32 amax (NaN ignored): TransformerEngine's rule, except that a
    block holding +-inf gets scale_inv NaN (its codes saturate as TE's do), so dequantization and every
    GEMM on it give non-finite values instead of +-fp8_max times a scale of 1."""
    amax = tl.where(amax < eps, eps, amax)
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    scale = tl.where(scale == float("inf"), value_for_inf, scale)
    scale = tl.where((amax == 0.0) | (amax == float("inf")), 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return scale, tl.where(amax == float("inf"), float("nan"), scale_inv)


@triton.jit
def abs_no_nan(x):
    """|x| in float32 with NaN replaced by 0 (NaN never wins an amax, as in TE)."""
    a = tl.abs(x)
    return tl.where(a != a, 0.0, a)


@triton.jit
def quantize_1x128_tile(x, eps, value_for_inf, BLOCK_M: tl.constexpr, K_BLOCKS: tl.constexpr,
                        FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr,
                        SOFTWARE_CAST: tl.constexpr):
    """Float32 tile [BLOCK_M, K_BLOCKS*128] -> (FP8 codes uint8, scale_inv [BLOCK_M, K_BLOCKS]) per 1x128 block
    (a block holding +-inf: scale_inv NaN, ``compute_scale``)."""
    x3 = tl.reshape(x, (BLOCK_M, K_BLOCKS, 128))
    amax = tl.max(abs_no_nan(x3), axis=2)
    scale, scale_inv = compute_scale(amax, eps, value_for_inf, FP8_MAX, POW2)
    v = tl.reshape(x3 * scale[:, :, None], (BLOCK_M, K_BLOCKS * 128))
    return float_to_fp8_bits(v, FP8_MAX, E5M2, SOFTWARE_CAST), scale_inv


@triton.jit
def _quantize_1x128_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K, stride_xm, num_kb,
    eps, value_for_inf,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, K_BLOCKS: tl.constexpr,
):
    """One [BLOCK_M, K_BLOCKS*128] tile of x [M, K] -> 1x128 FP8 q [M, K], scale_inv s [M, num_kb]."""
    BLOCK_K: tl.constexpr = K_BLOCKS * 128
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    q, scale_inv = quantize_1x128_tile(to_float(x, SOFTWARE_CAST), eps, value_for_inf, BLOCK_M, K_BLOCKS,
                                       FP8_MAX, E5M2, POW2, SOFTWARE_CAST)
    tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q, mask=mask)
    kb = pid_k * K_BLOCKS + tl.arange(0, K_BLOCKS)
    tl.store(s_ptr + rows64[:, None] * num_kb + kb[None, :], scale_inv,
             mask=row_ok[:, None] & (kb[None, :] < num_kb))


@triton.jit
def _quantize_128x1_kernel(
    x_ptr, qt_ptr, st_ptr, sizes_ptr,
    M, K, stride_xm, num_groups,
    eps, value_for_inf,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    GROUPED: tl.constexpr, MAX_GROUPS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Column block ``b`` (128 rows of one group) x BLOCK_K columns of x [M, K] -> 128x1 FP8 into the
    columnwise data (``[K, M]``, or expert-major: ``groups.store_columnwise``) and scale_inv st [b, K];
    unused blocks get scale_inv 1."""
    b = tl.program_id(0)
    pid_k = tl.program_id(1)
    start, count, _, first, size = column_block_rows(b, sizes_ptr, num_groups, M, GROUPED, MAX_GROUPS)
    r = tl.arange(0, 128)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    mask = (r < count)[:, None] & col_ok[None, :]
    x_block = x_ptr + start.to(tl.int64) * stride_xm  # the block's first row
    x = tl.load(x_block + r[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = to_float(x, SOFTWARE_CAST)
    scale, scale_inv = compute_scale(tl.max(abs_no_nan(x), axis=0), eps, value_for_inf, FP8_MAX, POW2)
    qt = tl.trans(float_to_fp8_bits(x * scale[None, :], FP8_MAX, E5M2, SOFTWARE_CAST))
    local = (start - first) // 128 * 128
    if (first % 16 == 0) & (size % 16 == 0):  # provably aligned in this branch: 16-byte stores
        store_columnwise(qt_ptr, qt, col_ok, cols, r, count // 16 * 16, first // 16 * 16, size // 16 * 16,
                         local, K)
    else:
        store_columnwise(qt_ptr, qt, col_ok, cols, r, count, first, size, local, K)
    tl.store(st_ptr + b.to(tl.int64) * K + cols, scale_inv, mask=col_ok)


@triton.jit
def _quantize_128x128_kernel(
    x_ptr, q_ptr, s_ptr,
    M, K, stride_xm, num_kb,
    eps, value_for_inf,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One 128x128 tile of x [M, K] -> q [M, K], one scale_inv in s [ceil(M/128), num_kb]."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_m * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = to_float(x, SOFTWARE_CAST)
    amax = tl.max(tl.max(abs_no_nan(x), axis=1), axis=0)
    scale, scale_inv = compute_scale(amax, eps, value_for_inf, FP8_MAX, POW2)
    q = float_to_fp8_bits(x * scale, FP8_MAX, E5M2, SOFTWARE_CAST)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + pid_m * num_kb + pid_k, scale_inv)


def _common_args(x, fp8_dtype, force_pow_2_scales, amax_epsilon, software_cast):
    return dict(
        SOFTWARE_CAST=use_software_cast(x, software_cast),
        eps=float(amax_epsilon),
        value_for_inf=scale_value_for_inf(x.dtype),
        FP8_MAX=fp8_max(fp8_dtype),
        E5M2=fp8_dtype == torch.float8_e5m2,
        POW2=bool(force_pow_2_scales),
    )


def quantize_1x128(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    software_cast: bool | None = None,
    config: tuple[int, int, int] | None = None,
):
    """Rowwise 1x128 quantization of 2-D ``x [M, K]`` (unit stride along K):
    ``(data [M, K], scale_inv [M, ceil(K/128)])``.

    A contiguous ``x`` with K % 128 == 0 is processed as its ``[M*K/128, 128]``
    view. ``software_cast`` forces the integer FP8 rounding on or off (default: on
    for CPU tensors, i.e. the interpreter); ``config`` overrides the launch shape
    ``(BLOCK_M, K_BLOCKS, num_warps)`` (benchmark sweeps).
    """
    m, k = x.shape
    num_kb = triton.cdiv(k, BLOCK_SIZE)
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    s = torch.empty((m, num_kb), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    flat = k % BLOCK_SIZE == 0 and x.is_contiguous()
    block_m, k_blocks, num_warps = config or (FLAT_CONFIG if flat else ROWWISE_CONFIG)
    # the flat view: data [M*K/128, 128] and scales [M*K/128, 1], same memory
    xm, xk, stride, nkb = (m * num_kb, BLOCK_SIZE, BLOCK_SIZE, 1) if flat else (m, k, x.stride(0), num_kb)
    _quantize_1x128_kernel[(triton.cdiv(xm, block_m), triton.cdiv(nkb, k_blocks))](
        x, q.view(torch.uint8), s, xm, xk, stride, nkb,
        BLOCK_M=block_m, K_BLOCKS=k_blocks, num_warps=num_warps,
        **_common_args(x, fp8_dtype, force_pow_2_scales, amax_epsilon, software_cast),
    )
    return q, s


def quantize_128x1(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    m_splits=None,
    software_cast: bool | None = None,
    config: tuple[int, int] | None = None,
):
    """Columnwise 128x1 quantization of 2-D ``x [M, K]``, blocks restarting at each group of ``m_splits``
    (None, host list or device tensor): ``(data_t, scale_inv_t [num_column_blocks, K])``, ``data_t``
    ``[K, M]`` or, grouped, expert-major ``[M*K]`` (``layout.py``).

    ``config`` overrides ``(BLOCK_K, num_warps)``.
    """
    m, k = x.shape
    nb = num_column_blocks(m, m_splits)
    qt = torch.empty(columnwise_data_shape(m, k, m_splits), dtype=fp8_dtype, device=x.device)
    st = torch.empty((nb, k), dtype=torch.float32, device=x.device)
    if nb > 0 and k > 0:
        block_k, num_warps = config or COLWISE_CONFIG
        sizes, g, grouped, max_groups = group_sizes_arg(m_splits, x.device)
        _quantize_128x1_kernel[(nb, triton.cdiv(k, block_k))](
            x, qt.view(torch.uint8), st, sizes, m, k, x.stride(0), g,
            GROUPED=grouped, MAX_GROUPS=max_groups, BLOCK_K=block_k, num_warps=num_warps,
            **_common_args(x, fp8_dtype, force_pow_2_scales, amax_epsilon, software_cast),
        )
    return qt, st


def quantize_128x128(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    software_cast: bool | None = None,
):
    """Quantize 2-D ``x [M, K]`` in 128x128 blocks: ``(data [M, K], scale_inv [ceil(M/128), ceil(K/128)])``."""
    m, k = x.shape
    num_mb, num_kb = triton.cdiv(m, BLOCK_SIZE), triton.cdiv(k, BLOCK_SIZE)
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    s = torch.empty((num_mb, num_kb), dtype=torch.float32, device=x.device)
    if m > 0 and k > 0:
        _quantize_128x128_kernel[(num_mb, num_kb)](
            x, q.view(torch.uint8), s, m, k, x.stride(0), num_kb,
            BLOCK=BLOCK_SIZE, num_warps=8,
            **_common_args(x, fp8_dtype, force_pow_2_scales, amax_epsilon, software_cast),
        )
    return q, s


@triton.jit
def _quantize_grouped_weight_kernel(
    ptrs, x0_ptr, q_ptr, qt_ptr, s_ptr, N, K,
    eps, value_for_inf,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    ALIGNED: tl.constexpr, TRANSPOSE: tl.constexpr, SLICE: tl.constexpr,
):
    """One 128x128 tile of weight g (read through the pointer table ``ptrs``; ``x0_ptr`` gives the
    element type) -> its codes in q [G, N, K], one scale_inv, and (``TRANSPOSE``) the codes of the
    transposed tile in qt [G, K, N]: each loaded slice is transposed before the same per-element
    arithmetic, so W^T holds W's bytes. The tile is read in ``SLICE``-row slices, twice when SLICE < 128
    (the amax, then the codes, the slices read again from L1/L2): no whole tile is held in registers, so
    more programs share an SM. ``ALIGNED``: every table entry is a multiple of 16 bytes, which the compiler
    cannot know of a loaded pointer; without the hint the loads are not vectorised (63% of copy on an H200
    against 97-99%)."""
    pid_k, pid_n, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x_ptr = tl.load(ptrs + g).to(tl.pointer_type(x0_ptr.dtype.element_ty))
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
    cols = (pid_k * 128 + tl.arange(0, 128)).to(tl.int64)
    amax = tl.zeros([SLICE, 128], tl.float32)  # the slices' running |x|, NaN left out
    for c in tl.static_range(128 // SLICE):
        rows = (pid_n * 128 + c * SLICE + tl.arange(0, SLICE)).to(tl.int64)
        raw = tl.load(x_ptr + rows[:, None] * K + cols[None, :])
        amax = tl.maximum(amax, abs_no_nan(to_float(raw, SOFTWARE_CAST)))
    scale, scale_inv = compute_scale(tl.max(tl.max(amax, axis=1), axis=0), eps, value_for_inf, FP8_MAX, POW2)
    base = g.to(tl.int64) * N * K
    for c in tl.static_range(128 // SLICE):
        rows = (pid_n * 128 + c * SLICE + tl.arange(0, SLICE)).to(tl.int64)
        if SLICE < 128:  # one slice keeps the tile it read
            raw = tl.load(x_ptr + rows[:, None] * K + cols[None, :])
        tl.store(q_ptr + base + rows[:, None] * K + cols[None, :],
                 float_to_fp8_bits(to_float(raw, SOFTWARE_CAST) * scale, FP8_MAX, E5M2, SOFTWARE_CAST))
        if TRANSPOSE:
            qt = float_to_fp8_bits(to_float(tl.trans(raw), SOFTWARE_CAST) * scale, FP8_MAX, E5M2, SOFTWARE_CAST)
            tl.store(qt_ptr + base + cols[:, None] * N + rows[None, :], qt)
    tl.store(s_ptr + (g * (N // 128) + pid_n) * (K // 128) + pid_k, scale_inv)


def quantize_grouped_weight(
    weights,
    fp8_dtype: torch.dtype,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    transpose: bool = True,
    software_cast: bool | None = None,
    config: tuple[int, int] | None = None,
    fused: bool | None = None,
):
    """As ``reference.quantize.quantize_grouped_weight``: one launch quantizes all G weights in place
    (a table of the G contiguous ``[N, K]`` weights' addresses: no stacking copy) into W ``[G, N, K]``
    and, with ``transpose``, W^T ``[G, K, N]``. ``fused`` (default: for 16-bit weights) writes W^T from
    the same launch (``FUSED_WEIGHT_CONFIG``); otherwise the byte transpose ``transpose_128x128`` of W
    writes it after. ``config``: (rows per slice, num_warps) of the quantizing launch (benchmark sweeps;
    default ``FUSED_WEIGHT_CONFIG``, or whole tiles on ``GROUPED_WEIGHT_WARPS`` for W alone)."""
    from .transpose import transpose_128x128

    x0 = weights[0]
    g, (n, k) = len(weights), x0.shape
    fused = transpose and (x0.element_size() == 2 if fused is None else fused)
    slice_rows, num_warps = config or (FUSED_WEIGHT_CONFIG if fused else (BLOCK_SIZE, GROUPED_WEIGHT_WARPS))
    if slice_rows not in (16, 32, 64, 128):
        raise ValueError(f"config: rows per slice must be 16, 32, 64 or 128, got {slice_rows}")
    q = torch.empty((g, n, k), dtype=fp8_dtype, device=x0.device)
    qt = torch.empty((g, k, n), dtype=fp8_dtype, device=x0.device) if fused else q
    s = torch.empty((g, n // BLOCK_SIZE, k // BLOCK_SIZE), dtype=torch.float32, device=x0.device)
    if q.numel():
        table, aligned = address_table(weights)
        _quantize_grouped_weight_kernel[(k // BLOCK_SIZE, n // BLOCK_SIZE, g)](
            table, x0, q.view(torch.uint8), qt.view(torch.uint8), s, n, k, ALIGNED=aligned, TRANSPOSE=fused,
            SLICE=slice_rows, num_warps=num_warps,
            **_common_args(x0, fp8_dtype, force_pow_2_scales, amax_epsilon, software_cast),
        )
    if not transpose:
        return q, s, None, None
    if fused:
        return q, s, qt, s.transpose(1, 2).contiguous()
    return (q, s) + transpose_128x128(q, s)
