"""Triton kernels for blockwise FP8 quantization, and their launchers.

Launchers take and return plain tensors (no package types). The arithmetic is
that of :mod:`transformer_engine_moe.reference.quantize`, step for step, so the
GPU output is bitwise equal to the reference: float32 amax with NaN dropped,
``div_rn`` for ``fp8_max / amax`` and ``1 / scale``, a power-of-two mask on the
scale bits, explicit finite saturation, and NaN written as the byte ``0x7F``.

FP8 data is stored through a ``uint8`` view of the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..recipe import BLOCK_SIZE, fp8_max, scale_value_for_inf

# Launch shapes (BLOCK_M, K_BLOCKS, num_warps) from benchmarks/bench_quantize.py's sweep
# (H200, 2026-11-22). Rowwise-only quantization of a contiguous [M, K] with K % 128 == 0
# runs on the [M*K/128, 128] view: a purely linear stream, same bits, 97-102% of the copy
# bandwidth where 2-D tiles of rows 14 KB apart reached 74-89%.
FLAT_CONFIG = (16, 1, 4)
ROWWISE_CONFIG = (16, 2, 4)  # ragged K or strided rows
COLWISE_CONFIG = (128, 1, 8)  # a columnwise copy needs 128-row tiles


@triton.jit
def compute_scale(amax, eps, value_for_inf, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Per-block (scale, scale_inv) from float32 amax: TransformerEngine's rule."""
    amax = tl.where(amax < eps, eps, amax)
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    scale = tl.where(scale == float("inf"), value_for_inf, scale)
    scale = tl.where((amax == 0.0) | (amax == float("inf")), 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return scale, scale_inv


@triton.jit
def _round_to_fp8_bits_software(c, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """|c| <= fp8_max, not NaN -> FP8 bit pattern (int32), RNE, by integer arithmetic.

    Normals round the float32 bits to MBITS mantissa bits (the carry may bump
    the exponent); values below the smallest FP8 normal become a multiple of
    the subnormal step, rounded to nearest even with the 2**23 magic number.
    """
    bits = c.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - (
        (127 - BIAS) << MBITS
    )
    subnormal_steps = tl.abs(c) * (2.0 ** (BIAS - 1 + MBITS))
    subnormal = ((subnormal_steps + 8388608.0) - 8388608.0).to(tl.int32)
    is_normal = mag >= ((128 - BIAS) << 23)
    return sign | tl.where(is_normal, normal, subnormal)


@triton.jit
def cast_to_fp8_bits(v, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """Float32 -> FP8 bit pattern (uint8): RNE, finite saturation, every NaN -> 0x7F.

    On the GPU this is the hardware conversion (``cvt.rn.satfinite``), which
    already saturates +-inf and overflow to +-fp8_max and writes NaN as 0x7F;
    extra clamps here cost a quarter of the kernel's bandwidth. Under Triton's
    CPU interpreter, whose FP8 cast is not IEEE (ties away from zero, lost
    exponent carries, no saturation), launchers set ``SOFTWARE_CAST`` and the
    same result is computed with integer arithmetic. Both paths are compared
    bitwise on the GPU (tests/ops/test_quantize.py).
    """
    if SOFTWARE_CAST:
        c = tl.where(v > FP8_MAX, FP8_MAX, tl.where(v < -FP8_MAX, -FP8_MAX, v))
        if E5M2:
            bits = _round_to_fp8_bits_software(c, 2, 15)
        else:
            bits = _round_to_fp8_bits_software(c, 3, 7)
        return tl.where(v != v, 0x7F, bits).to(tl.uint8)
    elif E5M2:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def abs_no_nan(x):
    """|x| in float32 with NaN replaced by 0 (NaN never wins an amax, as in TE)."""
    a = tl.abs(x)
    return tl.where(a != a, 0.0, a)


@triton.jit
def _quantize_1d_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    M, K, stride_xm, num_kb, num_mb,
    eps, value_for_inf,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, K_BLOCKS: tl.constexpr,
):
    """One [BLOCK_M, K_BLOCKS*128] tile of x [M, K] -> 1x128 rowwise and/or 128x1 columnwise FP8.

    Rowwise: q [M, K], s [M, num_kb]. Columnwise (needs BLOCK_M == 128):
    qt [K, M] (transposed), st [K, num_mb].
    """
    BLOCK_K: tl.constexpr = K_BLOCKS * 128
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    a = abs_no_nan(x)
    if ROWWISE:
        amax = tl.max(tl.reshape(a, (BLOCK_M, K_BLOCKS, 128)), axis=2)
        scale, scale_inv = compute_scale(amax, eps, value_for_inf, FP8_MAX, POW2)
        v = tl.reshape(tl.reshape(x, (BLOCK_M, K_BLOCKS, 128)) * scale[:, :, None], (BLOCK_M, BLOCK_K))
        q = cast_to_fp8_bits(v, FP8_MAX, E5M2, SOFTWARE_CAST)
        tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q, mask=mask)
        kb = pid_k * K_BLOCKS + tl.arange(0, K_BLOCKS)
        tl.store(
            s_ptr + rows64[:, None] * num_kb + kb[None, :],
            scale_inv,
            mask=row_ok[:, None] & (kb[None, :] < num_kb),
        )
    if COLWISE:
        scale_t, scale_inv_t = compute_scale(tl.max(a, axis=0), eps, value_for_inf, FP8_MAX, POW2)
        qt = tl.trans(cast_to_fp8_bits(x * scale_t[None, :], FP8_MAX, E5M2, SOFTWARE_CAST))
        cols64 = cols.to(tl.int64)
        tl.store(qt_ptr + cols64[:, None] * M + rows[None, :], qt, mask=tl.trans(mask))
        tl.store(st_ptr + cols64 * num_mb + pid_m, scale_inv_t, mask=col_ok)


@triton.jit
def _quantize_2d_kernel(
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
    x = x.to(tl.float32)
    amax = tl.max(tl.max(abs_no_nan(x), axis=1), axis=0)
    scale, scale_inv = compute_scale(amax, eps, value_for_inf, FP8_MAX, POW2)
    q = cast_to_fp8_bits(x * scale, FP8_MAX, E5M2, SOFTWARE_CAST)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + pid_m * num_kb + pid_k, scale_inv)


def _common_args(x, fp8_dtype, pow2_scales, amax_epsilon, software_cast):
    return dict(
        # CPU tensors only reach a kernel under the interpreter: round in software there.
        SOFTWARE_CAST=(not x.is_cuda) if software_cast is None else software_cast,
        eps=float(amax_epsilon),
        value_for_inf=scale_value_for_inf(x.dtype),
        FP8_MAX=fp8_max(fp8_dtype),
        E5M2=fp8_dtype == torch.float8_e5m2,
        POW2=bool(pow2_scales),
    )


def quantize_1d(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float,
    rowwise: bool = True,
    columnwise: bool = False,
    software_cast: bool | None = None,
    config: tuple[int, int, int] | None = None,
):
    """Quantize 2-D ``x [M, K]`` (unit stride along K) in 1x128 and/or 128x1 blocks.

    Returns ``(data [M, K], scale_inv [M, ceil(K/128)])`` for rowwise and
    ``(data_t [K, M], scale_inv_t [K, ceil(M/128)])`` for columnwise, None where
    not asked for. ``software_cast`` forces the integer FP8 rounding on or off
    (default: on for CPU tensors, i.e. the interpreter). ``config`` overrides the
    launch shape ``(BLOCK_M, K_BLOCKS, num_warps)`` (benchmark sweeps).
    """
    m, k = x.shape
    num_kb, num_mb = triton.cdiv(k, BLOCK_SIZE), triton.cdiv(m, BLOCK_SIZE)
    dev = x.device
    flat = rowwise and not columnwise and k % BLOCK_SIZE == 0 and x.is_contiguous()
    q = s = qt = st = None
    if rowwise:
        q = torch.empty((m, k), dtype=fp8_dtype, device=dev)
        s = torch.empty((m, num_kb), dtype=torch.float32, device=dev)
    if columnwise:
        qt = torch.empty((k, m), dtype=fp8_dtype, device=dev)
        st = torch.empty((k, num_mb), dtype=torch.float32, device=dev)
    if m > 0 and k > 0:
        default = FLAT_CONFIG if flat else COLWISE_CONFIG if columnwise else ROWWISE_CONFIG
        block_m, k_blocks, num_warps = config or default
        if columnwise and block_m != BLOCK_SIZE:
            raise ValueError(f"a columnwise copy needs BLOCK_M = {BLOCK_SIZE}, got {block_m}")
        # the flat view: data [M*K/128, 128] and scales [M*K/128, 1], same memory
        xm, xk, stride, nkb = (m * num_kb, BLOCK_SIZE, BLOCK_SIZE, 1) if flat else (m, k, x.stride(0), num_kb)
        dummy = torch.empty(0, dtype=torch.uint8, device=dev)
        grid = (triton.cdiv(xm, block_m), triton.cdiv(nkb, k_blocks))
        _quantize_1d_kernel[grid](
            x,
            q.view(torch.uint8) if rowwise else dummy, s if rowwise else dummy,
            qt.view(torch.uint8) if columnwise else dummy, st if columnwise else dummy,
            xm, xk, stride, nkb, num_mb,
            ROWWISE=rowwise, COLWISE=columnwise, BLOCK_M=block_m, K_BLOCKS=k_blocks,
            num_warps=num_warps,
            **_common_args(x, fp8_dtype, pow2_scales, amax_epsilon, software_cast),
        )
    return (q, s), (qt, st)


def quantize_2d(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    pow2_scales: bool,
    amax_epsilon: float,
    software_cast: bool | None = None,
):
    """Quantize 2-D ``x [M, K]`` in 128x128 blocks: ``(data [M, K], scale_inv [ceil(M/128), ceil(K/128)])``."""
    m, k = x.shape
    num_mb, num_kb = triton.cdiv(m, BLOCK_SIZE), triton.cdiv(k, BLOCK_SIZE)
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    s = torch.empty((num_mb, num_kb), dtype=torch.float32, device=x.device)
    if m > 0 and k > 0:
        _quantize_2d_kernel[(num_mb, num_kb)](
            x, q.view(torch.uint8), s, m, k, x.stride(0), num_kb,
            BLOCK=BLOCK_SIZE, num_warps=8,
            **_common_args(x, fp8_dtype, pow2_scales, amax_epsilon, software_cast),
        )
    return q, s
