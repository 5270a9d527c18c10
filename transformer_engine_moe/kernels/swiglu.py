"""Triton kernels for weighted SwiGLU fused with 1x128 FP8 quantization, forward and backward.

The arithmetic is that of ``reference/swiglu.py`` step for step: ``libdevice``'s
``exp2f`` (bitwise torch's CUDA ``exp2``), IEEE division, no FMA contraction. So
on the GPU the quantized output is bitwise ``quantize_1x128`` of the
reference's ``y``. Triton's CPU interpreter has no libdevice: there ``tl.exp2``
(numpy's) stands in, and results agree within the last float32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..recipe import BLOCK_SIZE, fp8_max, scale_value_for_inf
from .casts import cast_for_store, to_float, use_software_cast
from .quantize import quantize_1x128_tile

# Launch shapes (BLOCK_M, K_BLOCKS, num_warps), from benchmarks/bench_swiglu.py's sweep (H200). The quantizing
# backward's (4, 2, 4): the fastest at [65536, 2*2048] (348 us, (4, 4, 8) 394) and within 1.5% of it at Qwen3's
# [131072, 2*768] (273 us, where (4, 4, 8), cut to (4, 2, 8), took 407).
FORWARD_CONFIG = (8, 1, 2)
BACKWARD_CONFIG = (4, 2, 4)


@triton.jit
def _one_plus_exp_neg(a, SOFTWARE_CAST: tl.constexpr):
    """1 + exp2(-a * LOG2E) (LOG2E of reference/swiglu.py): torch's CUDA exp2f (libdevice); numpy's under
    the interpreter."""
    if SOFTWARE_CAST:
        return 1.0 + tl.exp2(-a * 1.4426950408889634)
    return 1.0 + libdevice.exp2(-a * 1.4426950408889634)


@triton.jit
def _weighted_swiglu_quant_kernel(
    x_ptr, p_ptr, q_ptr, s_ptr, M, F, num_kb, value_for_inf,
    HAS_PROBS: tl.constexpr, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, BLOCK_M: tl.constexpr, K_BLOCKS: tl.constexpr,
):
    """Rows [BLOCK_M] x columns [K_BLOCKS*128] of y = silu(a) * b * p -> FP8 q [M, F], s [M, F/128]."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * K_BLOCKS * 128 + tl.arange(0, K_BLOCKS * 128)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < F)[None, :]
    xa = x_ptr + rows[:, None] * (2 * F) + cols[None, :]
    a = to_float(tl.load(xa, mask=mask, other=0.0), SOFTWARE_CAST)
    b = to_float(tl.load(xa + F, mask=mask, other=0.0), SOFTWARE_CAST)
    y = tl.math.div_rn(a, _one_plus_exp_neg(a, SOFTWARE_CAST)) * b
    if HAS_PROBS:
        y = y * to_float(tl.load(p_ptr + rows, mask=row_ok, other=0.0), SOFTWARE_CAST)[:, None]
    q, scale_inv = quantize_1x128_tile(y, 0.0, value_for_inf, BLOCK_M, K_BLOCKS, FP8_MAX, E5M2, POW2,
                                       SOFTWARE_CAST)
    tl.store(q_ptr + rows[:, None] * F + cols[None, :], q, mask=mask)
    kb = tl.program_id(1) * K_BLOCKS + tl.arange(0, K_BLOCKS)
    tl.store(s_ptr + rows[:, None] * num_kb + kb[None, :], scale_inv, mask=row_ok[:, None] & (kb < num_kb)[None, :])


@triton.jit
def _weighted_swiglu_backward_kernel(
    dy_ptr, x_ptr, p_ptr, dx_ptr, dxs_ptr, dp_ptr, M, F, value_for_inf,
    HAS_PROBS: tl.constexpr, QUANTIZE_GRAD: tl.constexpr, FP8_MAX: tl.constexpr, E5M2: tl.constexpr,
    POW2: tl.constexpr, SOFTWARE_CAST: tl.constexpr, BLOCK_M: tl.constexpr, K_BLOCKS: tl.constexpr,
):
    """Rows [BLOCK_M], all of F: dx [M, 2F] (bf16, or FP8 1x128 with scales dxs [M, 2F/128]) and
    dp [M] = sum_f dy * silu * b, reduced in the program (no atomics)."""
    BLOCK_K: tl.constexpr = K_BLOCKS * 128
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < M
    if HAS_PROBS:
        p = to_float(tl.load(p_ptr + rows, mask=row_ok, other=0.0), SOFTWARE_CAST)[:, None]
    dp = tl.zeros([BLOCK_M], tl.float32)
    k0 = 0
    while k0 < F:  # while loops: Triton's interpreter cannot range() over run-time values
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < F)[None, :]
        xa = x_ptr + rows[:, None] * (2 * F) + cols[None, :]
        a = to_float(tl.load(xa, mask=mask, other=0.0), SOFTWARE_CAST)
        b = to_float(tl.load(xa + F, mask=mask, other=0.0), SOFTWARE_CAST)
        g = to_float(tl.load(dy_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0), SOFTWARE_CAST)
        s = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), _one_plus_exp_neg(a, SOFTWARE_CAST))
        silu = a * s
        dsilu = s * (1.0 + a * (1.0 - s))
        if HAS_PROBS:
            dp += tl.sum((g * silu) * b, axis=1)
            g = g * p
        da = (g * b) * dsilu
        db = g * silu
        dxa = dx_ptr + rows[:, None] * (2 * F) + cols[None, :]
        if QUANTIZE_GRAD:  # rounded to x's dtype first: bitwise the quantization of the dx stored otherwise
            da = to_float(cast_for_store(da, x_ptr.dtype.element_ty, SOFTWARE_CAST), SOFTWARE_CAST)
            db = to_float(cast_for_store(db, x_ptr.dtype.element_ty, SOFTWARE_CAST), SOFTWARE_CAST)
            num_kb = 2 * F // 128
            kb = k0 // 128 + tl.arange(0, K_BLOCKS)
            smask = row_ok[:, None] & (kb < F // 128)[None, :]
            qa, sa = quantize_1x128_tile(da, 0.0, value_for_inf, BLOCK_M, K_BLOCKS, FP8_MAX, E5M2, POW2,
                                         SOFTWARE_CAST)
            qb, sb = quantize_1x128_tile(db, 0.0, value_for_inf, BLOCK_M, K_BLOCKS, FP8_MAX, E5M2, POW2,
                                         SOFTWARE_CAST)
            tl.store(dxa, qa, mask=mask)
            tl.store(dxa + F, qb, mask=mask)
            tl.store(dxs_ptr + rows[:, None] * num_kb + kb[None, :], sa, mask=smask)
            tl.store(dxs_ptr + rows[:, None] * num_kb + F // 128 + kb[None, :], sb, mask=smask)
        else:
            tl.store(dxa, cast_for_store(da, dx_ptr.dtype.element_ty, SOFTWARE_CAST), mask=mask)
            tl.store(dxa + F, cast_for_store(db, dx_ptr.dtype.element_ty, SOFTWARE_CAST), mask=mask)
        k0 += BLOCK_K
    if HAS_PROBS:
        tl.store(dp_ptr + rows, dp, mask=row_ok)


def _common(x, fp8_dtype, force_pow_2_scales, quantized_dtype=torch.float32):
    """The launch arguments of a quantization of ``quantized_dtype`` values (the overflowing scale's value)."""
    return dict(
        value_for_inf=scale_value_for_inf(quantized_dtype),
        FP8_MAX=fp8_max(fp8_dtype), E5M2=fp8_dtype == torch.float8_e5m2, POW2=bool(force_pow_2_scales),
        SOFTWARE_CAST=use_software_cast(x),
    )


def weighted_swiglu_quant(x, probs, fp8_dtype, force_pow_2_scales, config=None):
    """``x [M, 2F]`` (F % 128 == 0), ``probs [M]`` or None -> ``(q [M, F] FP8, scale_inv [M, F/128])``."""
    m, f2 = x.shape
    f = f2 // 2
    q = torch.empty((m, f), dtype=fp8_dtype, device=x.device)
    s = torch.empty((m, f // BLOCK_SIZE), dtype=torch.float32, device=x.device)
    if m > 0 and f > 0:
        block_m, k_blocks, num_warps = config or FORWARD_CONFIG
        k_blocks = min(k_blocks, triton.next_power_of_2(f // BLOCK_SIZE))
        _weighted_swiglu_quant_kernel[(triton.cdiv(m, block_m), triton.cdiv(f, k_blocks * BLOCK_SIZE))](
            x, probs if probs is not None else x.new_empty(0), q.view(torch.uint8), s, m, f, f // BLOCK_SIZE,
            HAS_PROBS=probs is not None, BLOCK_M=block_m, K_BLOCKS=k_blocks, num_warps=num_warps,
            enable_fp_fusion=False, **_common(x, fp8_dtype, force_pow_2_scales),
        )
    return q, s


def weighted_swiglu_backward(dy, x, probs, grad_fp8_dtype=None, force_pow_2_scales=True, config=None):
    """``dy [M, F]``, ``x [M, 2F]``, ``probs [M]`` or None -> ``(dx, dx_scale_inv, dprobs)``: dx ``[M, 2F]``
    in ``x``'s dtype (``dx_scale_inv`` None), or FP8 1x128 in ``grad_fp8_dtype`` with ``[M, 2F/128]`` scales
    (bitwise ``quantize_1x128`` of the dx in ``x``'s dtype); dprobs float32 ``[M]`` or None."""
    m, f2 = x.shape
    f = f2 // 2
    quantize = grad_fp8_dtype is not None
    dx = torch.empty((m, f2), dtype=grad_fp8_dtype if quantize else x.dtype, device=x.device)
    dxs = torch.empty((m, f2 // BLOCK_SIZE), dtype=torch.float32, device=x.device) if quantize else None
    dp = torch.empty(m, dtype=torch.float32, device=x.device) if probs is not None else None
    if m > 0 and f > 0:
        block_m, k_blocks, num_warps = config or BACKWARD_CONFIG
        k_blocks = min(k_blocks, triton.next_power_of_2(f // BLOCK_SIZE))
        while (f // BLOCK_SIZE) % k_blocks:  # column chunks must tile F exactly
            k_blocks //= 2
        dummy = x.new_empty(0)
        _weighted_swiglu_backward_kernel[(triton.cdiv(m, block_m),)](
            dy, x, probs if probs is not None else dummy, dx.view(torch.uint8) if quantize else dx,
            dxs if quantize else dummy, dp if dp is not None else dummy, m, f,
            HAS_PROBS=probs is not None, QUANTIZE_GRAD=quantize, BLOCK_M=block_m, K_BLOCKS=k_blocks,
            num_warps=num_warps, enable_fp_fusion=False,
            **_common(x, grad_fp8_dtype or torch.float8_e4m3fn, force_pow_2_scales, x.dtype),
        )
    return dx, dxs, dp
